"""`kdtree inspect`: sizes against SPEC-MODEL.md §5's independently computed numbers, and a checkpoint's
parameter count against a count made in Python with the safetensors library."""
import math
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import DTYPE_SIZE, FIXTURES, MODEL_FIXTURES, kdtree

NON_TEXT = ("vision_tower.", "mm_projector.")


def inspect_json(*args) -> dict:
    return kdtree("inspect", *args, "--json", ok=True).json()


@pytest.fixture(scope="module")
def k2() -> dict:
    return inspect_json("--preset", "k2")


# SPEC-MODEL.md §5 (Kimi K2.5 text model, INT4 experts): the reference numbers.
SPEC_SIZES = [
    (("params", "total"), 1.0264e12, 1e-3),
    (("params", "active_with_embedding"), 32.86e9, 1e-3),
    (("params", "active"), 31.69e9, 1e-3),
    (("bytes", "weights_stored"), 594.2e9, 1e-3),
    (("bytes", "per_decoded_token"), 32.99e9, 2e-3),
]


@pytest.mark.parametrize("path,expected,rel", SPEC_SIZES, ids=[".".join(p) for p, _, _ in SPEC_SIZES])
def test_k2_sizes_match_spec(k2, path, expected, rel):
    got = k2[path[0]][path[1]]
    assert isinstance(got, int)
    assert got == pytest.approx(expected, rel=rel), f"{'.'.join(path)} = {got:.6g}, spec says {expected:.6g}"


def test_k2_kv_cache_per_token(k2):
    # 61 layers × (kv_lora 512 + rope 64) × 2 bytes.
    assert k2["bytes"]["kv_per_token_bf16"] == 70272 == 61 * (512 + 64) * 2


def test_k2_softmax_scale(k2):
    # (128 + 64)^-0.5 × (0.1 · ln 64 + 1)^2 (YaRN mscale_all_dim 1, factor 64).
    s = k2["attention"]["softmax_scale"]
    assert s == pytest.approx(0.144680, abs=1e-6)
    assert s == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2, rel=1e-12)


def test_k2_shape(k2):
    assert k2["architecture"] == "DeepseekV3ForCausalLM"
    assert k2["layers"] == {"total": 61, "dense": 1, "moe": 60}
    assert k2["moe"]["n_routed_experts"] == 384 and k2["moe"]["num_experts_per_tok"] == 8
    assert k2["vocab_size"] == 163840 and k2["hidden_size"] == 7168
    assert k2["int4"]["enabled"] and k2["int4"]["group_size"] == 32
    assert k2["int4"]["modules"] == 60 * 384 * 3


def test_k2_per_token_bytes_by_role_sum(k2):
    roles = k2["bytes"]["per_decoded_token_by_role"]
    assert sum(roles.values()) == k2["bytes"]["per_decoded_token"]
    # SPEC-MODEL.md §5's breakdown (GB): attention 12.34, routed 11.89, shared 5.28, lm_head 2.35.
    for role, gb in (("attention", 12.34), ("routed experts", 11.89), ("shared experts", 5.28), ("lm_head", 2.35)):
        assert roles[role] / 1e9 == pytest.approx(gb, abs=0.01), role


def test_memory_at_context(k2):
    out = inspect_json("--preset", "k2", "--ctx", 131072)
    assert out["memory"]["ctx"] == 131072
    assert out["memory"]["kv_bytes"] == 70272 * 131072  # ≈ 9.2 GB (SPEC-MODEL.md §5)
    assert out["memory"]["total_bytes"] == out["bytes"]["weights_stored"] + out["memory"]["kv_bytes"]


def test_k2_text_output():
    r = kdtree("inspect", "--preset", "k2", ok=True)
    assert "DeepseekV3ForCausalLM" in r.stdout and "kimi_k2" in r.stdout
    assert re.search(r"\b594\.\d+ GB\b", r.stdout), r.stdout
    assert "GB" in r.stdout and "70272" in r.stdout


# --- checkpoints ------------------------------------------------------------------------------------------

def text_tensors(d: Path):
    """(name, numel) of the text model's tensors, INT4 modules counted as N × K from weight_shape."""
    files = sorted(d.glob("*.safetensors"))
    files = [f for f in files if f.name != "golden.safetensors"]
    out, all_names, nbytes = {}, [], 0
    for f in files:
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                all_names.append(k)
                if k.startswith(NON_TEXT):
                    continue
                sl = st.get_slice(k)
                nbytes += math.prod(sl.get_shape()) * DTYPE_SIZE[sl.get_dtype()]
                if k.endswith((".weight_scale", ".weight_shape")):
                    continue
                if k.endswith(".weight_packed"):
                    n, kk = st.get_tensor(k[: -len("_packed")] + "_shape").tolist()
                    out[k[: -len(".weight_packed")]] = n * kk
                else:
                    out[k] = math.prod(sl.get_shape())
    return out, all_names, nbytes, files


def test_k25_sharded_inspect():
    d = FIXTURES / "k25-sharded"
    out = inspect_json("-m", d)
    numel, all_names, text_bytes, files = text_tensors(d)
    ck = out["checkpoint"]
    assert ck["files"] == 3 == len(files)
    assert ck["tensors"] == len(all_names)
    assert ck["bytes"] == sum(f.stat().st_size for f in files)
    assert out["tensor_prefix"] == "language_model.model."
    assert out["architecture"] == "KimiK25ForConditionalGeneration"
    n_vision = sum(n.startswith(NON_TEXT) for n in all_names)
    assert n_vision > 0
    assert ck["tensors_not_used"] == n_vision
    assert out["params"]["total"] == sum(numel.values())
    assert out["bytes"]["weights_stored"] == text_bytes


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_inspect_counts_match_safetensors(fixture):
    d = FIXTURES / fixture
    out = inspect_json("-m", d)
    numel, all_names, text_bytes, _ = text_tensors(d)
    assert out["params"]["total"] == sum(numel.values())
    assert out["bytes"]["weights_stored"] == text_bytes
    assert out["checkpoint"]["tensors"] == len(all_names)
    assert out["params"]["active"] < out["params"]["active_with_embedding"] < out["params"]["total"]
    if fixture != "k25-sharded":
        assert out["checkpoint"]["tensors_not_used"] == 0
        assert out["tensor_prefix"] == "model."


def test_inspect_config_equals_directory():
    d = FIXTURES / "k2-int4"
    a = inspect_json("-m", d)
    b = inspect_json("--config", d / "config.json")
    assert "checkpoint" not in b
    for k in ("params", "bytes", "attention", "moe", "int4", "layers"):
        assert a[k] == b[k], k


def test_inspect_preset_tiny_matches_written_tiny(tmp_path):
    d = tmp_path / "tiny"
    kdtree("make-model", "--preset", "tiny", "-o", d, ok=True)
    a = inspect_json("--preset", "tiny")
    b = inspect_json("-m", d)
    assert a["params"] == b["params"]
    assert a["bytes"]["weights_stored"] == b["bytes"]["weights_stored"] == text_tensors(d)[2]


def test_inspect_text_for_checkpoint():
    r = kdtree("inspect", "-m", FIXTURES / "k25-sharded", ok=True)
    assert "KimiK25ForConditionalGeneration" in r.stdout
    assert "GB" in r.stdout
    assert "3 file(s)" in r.stdout


def test_inspect_options_are_exclusive():
    r = kdtree("inspect", "--preset", "k2", "-m", FIXTURES / "k2-int4")
    assert r.returncode == 2 and "exclude" in r.stderr.lower(), str(r)
