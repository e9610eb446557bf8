"""`kdtree run --dump-logits F`: a safetensors file with `logits` [steps, vocab] F32, one row per
generated position, read back with safetensors.numpy and compared to HF's greedy logits."""
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import (FIXTURES, MODEL_FIXTURES, N_GOLDEN, copy_fixture, edit_json, golden, golden_greedy,
                      golden_prompt, run_json, vocab_size)

REL_TOL = 1e-4  # max |engine − HF| / max |HF| over the whole [48, V] block


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_dump_logits_match_hf_greedy_logits(fixture, tmp_path):
    f = tmp_path / "logits.safetensors"
    out = run_json(FIXTURES / fixture, golden_prompt(fixture), "--ignore-eos", "--dump-logits", f)
    logits = load_file(str(f))["logits"]
    V = vocab_size(FIXTURES / fixture)
    assert logits.dtype == np.float32
    assert logits.shape == (N_GOLDEN, V)
    assert np.isfinite(logits).all()
    assert logits.argmax(axis=1).tolist() == out["output_ids"] == golden_greedy(fixture)
    ref = golden(fixture)["greedy_logits"]
    assert ref.shape == logits.shape
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel <= REL_TOL, f"{fixture}: max abs diff / max abs = {rel:.3g}"


def test_dump_logits_rows_follow_an_early_stop(tmp_path):
    # With an EOS stop the file holds exactly the generated steps, the last row choosing the EOS id.
    fixture = "dsv3-group"
    greedy = golden_greedy(fixture)
    i = next(j for j in range(4, N_GOLDEN) if greedy[j] not in greedy[:j])
    d = copy_fixture(fixture, tmp_path)
    edit_json(d / "config.json", lambda c: c.update(eos_token_id=greedy[i]))
    f = tmp_path / "logits.safetensors"
    out = run_json(d, golden_prompt(fixture), "--dump-logits", f)
    assert out["finish_reason"] == "stop"
    logits = load_file(str(f))["logits"]
    assert logits.shape == (i + 1, vocab_size(d))
    assert logits.argmax(axis=1).tolist() == out["output_ids"] == greedy[:i + 1]
    ref = golden(fixture)["greedy_logits"][:i + 1]
    assert np.abs(logits - ref).max() / np.abs(ref).max() <= REL_TOL


def test_dump_logits_with_n_zero_is_an_empty_valid_file(tmp_path):
    f = tmp_path / "logits.safetensors"
    run_json(FIXTURES / "k2-int4", golden_prompt("k2-int4"), "--dump-logits", f, n=0)
    with safe_open(str(f), "np") as st:
        assert "logits" in st.keys()
        assert st.get_slice("logits").get_shape() == [0, vocab_size(FIXTURES / "k2-int4")]
        assert st.get_slice("logits").get_dtype() == "F32"


def test_dump_logits_sampled_rows_are_the_model_distribution(tmp_path):
    # At T > 0 the dumped rows are still the raw logits (not tempered), so they equal the greedy run's
    # rows wherever the sampled prefix agrees with greedy — at least row 0, which depends on the prompt only.
    fixture = "k2-int4"
    f = tmp_path / "sampled.safetensors"
    run_json(FIXTURES / fixture, golden_prompt(fixture), "--ignore-eos", "--temp", "0.8", "--seed", "1",
             "--dump-logits", f, n=4)
    logits = load_file(str(f))["logits"]
    assert logits.shape[0] == 4
    ref = golden(fixture)["greedy_logits"][0]
    assert np.abs(logits[0] - ref).max() / np.abs(ref).max() <= REL_TOL
