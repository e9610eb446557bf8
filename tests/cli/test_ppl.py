"""`kdtree ppl` against HF transformers' logits scored with llama.cpp's perplexity convention
(tests/fixtures/quality/ppl_golden.json, python/make_quality_fixtures.py: a re-implementation of
tools/perplexity/perplexity.cpp in numpy over HF fp32 logits), and --kl-divergence against the same
script's KL of HF's bf16 model vs its compressed-tensors INT4 g32 twin."""
from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, kdtree

Q = FIXTURES / "quality"
TINY = Q / "ppl-tiny"
TEXT = Q / "ppl.txt"
GOLDEN = json.loads((Q / "ppl_golden.json").read_text())


def ppl_json(model, *extra):
    return kdtree("ppl", "-m", model, "-f", TEXT, "--json", "-q", *extra, ok=True).json()


@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_ppl_matches_hf_logits_with_llama_cpp_convention(case):
    g = GOLDEN["cases"][case]
    j = ppl_json(TINY, "-c", g["ctx"], "--stride", g["stride"], "--bos", "on" if g["bos"] else "off")
    assert j["n_scored"] == g["n_scored"] and j["n_chunks"] == g["n_chunks"]
    assert j["n_tokens"] == GOLDEN["n_tokens_no_bos"] + (1 if g["bos"] else 0)
    assert j["ppl"] == pytest.approx(g["ppl"], rel=1e-5)
    assert j["ppl_stderr"] == pytest.approx(g["ppl_stderr"], rel=1e-4)
    assert len(j["running_ppl"]) == g["n_chunks"] and j["running_ppl"][-1] == pytest.approx(j["ppl"])


def test_text_output_and_progress():
    r = kdtree("ppl", "-m", TINY, "-f", TEXT, "-c", "64", ok=True)
    assert r.stdout.startswith("Final estimate: PPL = ")
    assert "PPL =" in r.stderr and "tokens/s" in r.stderr


@pytest.fixture(scope="module")
def int4_twin(tmp_path_factory):
    d = tmp_path_factory.mktemp("q") / "ppl-tiny-int4"
    kdtree("quantize", "-m", TINY, "-o", d, ok=True)
    return d


@pytest.mark.parametrize("k,key", [(4256, "kl_mean_full"), (8, "kl_mean_top8_tail")])
def test_kl_divergence_matches_hf(int4_twin, tmp_path, k, key):
    g = GOLDEN["kl_int4_g32"]
    ref = tmp_path / "bf16.logits"
    base = ppl_json(TINY, "-c", 64, "--bos", "off", "--save-logits", ref, "--top-k", k)
    assert base["ppl"] == pytest.approx(g["ppl_base"], rel=1e-5)
    j = ppl_json(int4_twin, "-c", 64, "--bos", "off", "--kl-divergence", ref)
    kl = j["kl"]
    assert j["ppl"] == pytest.approx(g["ppl"], rel=1e-5)
    assert kl["ppl_base"] == pytest.approx(g["ppl_base"], rel=1e-5)
    assert kl["delta_ppl"] == pytest.approx(g["delta_ppl"], rel=1e-3)
    assert kl["kl_mean"] == pytest.approx(g[key], rel=1e-4)
    assert abs(kl["top1_agreement"] - g["top1_agreement"]) <= 1.5 / g["n_scored"]
    if k == 4256:
        assert kl["kl_percentiles"]["median"] == pytest.approx(g["kl_median_full"], rel=1e-3)
        assert kl["kl_percentiles"]["max"] == pytest.approx(g["kl_max_full"], rel=1e-3)
        assert kl["reference_tail_mass_max"] < 1e-5
    else:
        assert kl["reference_tail_mass_mean"] > 0.5  # a flat random model: top-8 says little, and says so


def test_kl_of_a_model_against_itself_is_zero(tmp_path):
    ref = tmp_path / "r.logits"
    ppl_json(TINY, "-c", 64, "--save-logits", ref)
    kl = ppl_json(TINY, "-c", 64, "--kl-divergence", ref)["kl"]
    assert abs(kl["kl_mean"]) < 1e-6 and kl["top1_agreement"] == 1.0 and abs(kl["delta_ppl"]) < 1e-6


def test_text_shorter_than_two_contexts_is_an_error():
    r = kdtree("ppl", "-m", TINY, "-f", TEXT, "-c", "2048", ok=False)
    assert "fewer than 2 × --ctx = 4096" in r.stderr


def test_reference_made_with_other_settings_is_refused(tmp_path):
    ref = tmp_path / "r.logits"
    ppl_json(TINY, "-c", 64, "--save-logits", ref)
    r = kdtree("ppl", "-m", TINY, "-f", TEXT, "-c", "32", "--kl-divergence", ref, ok=False)
    assert "--ctx 64" in r.stderr and "same settings" in r.stderr
    r = kdtree("ppl", "-m", TINY, "-f", TEXT, "-c", "64", "--kl-divergence", TINY / "model.safetensors", ok=False)
    assert "is not kdtree-ppl-logits/1" in r.stderr


@pytest.mark.parametrize("args,msg", [(["--stride", "64", "-c", "64"], "--stride 64 must be in"),
                                      (["-c", "2"], "at least 4 tokens"),
                                      (["--device", "tpu"], "unknown device")])
def test_bad_options(args, msg):
    r = kdtree("ppl", "-m", TINY, "-f", TEXT, *args, ok=False)
    assert msg in r.stderr


def test_missing_file_and_tokenizer(tmp_path):
    r = kdtree("ppl", "-m", TINY, "-f", tmp_path / "nope.txt", ok=False)
    assert "nope.txt" in r.stderr
    r = kdtree("ppl", "-m", FIXTURES / "k2-bf16", "-f", TEXT, ok=False)
    assert "no tokenizer" in r.stderr
