"""`kdtree quantize` against compressed-tensors' own compressor (tests/fixtures/quality/quantize_golden.json,
made by python/make_quality_fixtures.py with compressed-tensors 0.20.1): whole-file bytes, the
quantization_config, sharding, loading the result, and bad input."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES, RawSafetensors, assert_clean_failure, copy_fixture, edit_json, kdtree

GOLDEN = json.loads((FIXTURES / "quality" / "quantize_golden.json").read_text())
SRC = FIXTURES / "k2-bf16"


@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_bytes_equal_compressed_tensors_compressor(case, tmp_path):
    g = GOLDEN["cases"][case]
    ignore = [] if case == "g32-kimi" else [a for p in g["ignore"] for a in ("--ignore", p)]
    out = tmp_path / "q"
    r = kdtree("quantize", "-m", SRC, "-o", out, "--group", g["group"], *ignore, "--json", ok=True)
    j = r.json()
    assert j["quantized_modules"] == g["quantized_modules"]
    st = RawSafetensors(out / "model.safetensors")
    assert len(st.names) == g["tensors"]
    got = {n: hashlib.sha256(st.bytes_of(n)).hexdigest() for n in st.names}
    diff = [n for n in g["tensor_sha256"] if got.get(n) != g["tensor_sha256"][n]]
    assert not diff, f"tensors differing from compressed-tensors: {diff[:5]}"
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == g["file_sha256"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == g["quantization_config"]
    src_cfg = json.loads((SRC / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    assert "GB/s" in r.stderr


def test_sharded_output_has_an_index_and_the_same_tensors(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    kdtree("quantize", "-m", SRC, "-o", one, ok=True)
    r = kdtree("quantize", "-m", SRC, "-o", many, "--max-shard-size", "100KB", "--json", ok=True)
    shards = r.json()["shards"]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    idx = json.loads((many / "model.safetensors.index.json").read_text())
    ref = RawSafetensors(one / "model.safetensors")
    seen = {}
    for s in shards:
        part = RawSafetensors(many / s)
        for n in part.names:
            seen[n] = part.bytes_of(n)
            assert idx["weight_map"][n] == s
    assert sorted(seen) == sorted(ref.names)
    assert all(seen[n] == ref.bytes_of(n) for n in ref.names)
    assert idx["metadata"]["total_size"] == sum(len(b) for b in seen.values())
    # a module's three tensors share a shard
    for n in idx["weight_map"]:
        if n.endswith(".weight_packed"):
            m = n[: -len(".weight_packed")]
            assert idx["weight_map"][m + ".weight_scale"] == idx["weight_map"][n] == idx["weight_map"][m + ".weight_shape"]


def test_output_runs_in_kdtree_and_dequantizes_close_to_bf16(tmp_path):
    out = tmp_path / "q"
    kdtree("quantize", "-m", SRC, "-o", out, ok=True)
    r = kdtree("run", "-m", out, "--prompt-ids", "1,2,3", "-n", "4", "--json", ok=True)
    assert len(r.json()["output_ids"]) == 4
    q = RawSafetensors(out / "model.safetensors")
    src = RawSafetensors(SRC / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.down_proj"
    w = src.array(name + ".weight")
    packed = q.array(name + ".weight_packed").view(np.uint32)
    scale = q.array(name + ".weight_scale")
    nib = np.stack([(packed >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(w.shape).astype(np.int64) - 8
    deq = nib * np.repeat(scale, 32, axis=1)
    err = np.abs(deq - w).reshape(w.shape[0], -1, 32).max(-1)
    # within half a step, plus the bf16 rounding of the quotient (spacing 1/32 near 7.5)
    assert np.all(err <= (0.5 + 1 / 64) * scale * 1.001)
    assert list(q.array(name + ".weight_shape")) == list(w.shape) and q.header[name + ".weight_shape"]["dtype"] == "I64"


def test_missing_tensor_is_named(tmp_path):
    m = copy_fixture("k2-bf16", tmp_path)
    RawSafetensors(m / "model.safetensors").rewritten(m / "model.safetensors", drop=("model.layers.1.mlp.experts.3.up_proj.weight",))
    r = kdtree("quantize", "-m", m, "-o", tmp_path / "out", ok=False)
    assert "model.layers.1.mlp.experts.3.up_proj" in r.stderr
    assert not (tmp_path / "out").exists()


def test_non_bf16_weight_is_refused(tmp_path):
    m = copy_fixture("k2-bf16", tmp_path)
    st = RawSafetensors(m / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.gate_proj.weight"
    f32 = st.array(name).astype("<f4")
    st.rewritten(m / "model.safetensors", replace={name: ("F32", list(f32.shape), f32.tobytes())})
    r = kdtree("quantize", "-m", m, "-o", tmp_path / "out", ok=False)
    assert name in r.stderr and "F32" in r.stderr and "bf16" in r.stderr


def test_quantized_input_is_refused(tmp_path):
    r = kdtree("quantize", "-m", FIXTURES / "k2-int4", "-o", tmp_path / "out", ok=False)
    assert "already has a quantization_config" in r.stderr


@pytest.mark.parametrize("pattern,msg", [("*experts*", "unknown pattern syntax"),
                                          ("re:(unclosed", "not a valid regular expression"),
                                          ("model.layers.9.mlp.experts.0.up_proj", "matches no Linear module"),
                                          ("Linear", "matches no Linear module")])
def test_bad_ignore_pattern(pattern, msg, tmp_path):
    r = kdtree("quantize", "-m", SRC, "-o", tmp_path / "out", "--ignore", pattern, ok=False)
    assert msg in r.stderr


def test_group_that_does_not_divide_the_columns(tmp_path):
    r = kdtree("quantize", "-m", SRC, "-o", tmp_path / "out", "--group", "128", ok=False)
    assert "not a multiple of --group 128" in r.stderr


def test_non_empty_output_and_bad_sizes(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    r = kdtree("quantize", "-m", SRC, "-o", tmp_path / "out", ok=False)
    assert "not empty" in r.stderr and (tmp_path / "out" / "x").read_text() == "keep me"
    r = kdtree("quantize", "-m", SRC, "-o", tmp_path / "o2", "--max-shard-size", "5XB", ok=False)
    assert "unknown unit" in r.stderr
