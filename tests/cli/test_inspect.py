"""`kdtree inspect`: sizes against SPEC-MODEL.md §5's independently computed numbers, and a checkpoint's
parameter count against a count made in Python with the safetensors library."""
import json
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


# --- tensor parallel: inspect --tp R (issue 14) --------------------------------------------------------------
# Golden numbers from Kimi K2's shapes (SPEC-MODEL.md §1) with the storage formulas written out here:
# bf16 2 B a value; INT4 rows × cols / 2 packed + rows × cols/32 bf16 scales + an 8-byte weight_shape.

K2 = dict(V=163840, h=7168, inter=18432, moe=2048, L=61, H=64, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128,
          E=384, dense=1, moe_layers=60)
H200_GIB = 139


def bf16(r, c):
    return r * c * 2


def int4(r, c):
    return r * c // 2 + r * (c // 32) * 2


def k2_rank_bytes(R):
    """One rank's weights at TP R: replicated tensors in full + its slice of the rest."""
    k = K2
    replicated = (bf16(k["V"], k["h"])  # embedding
                  + (k["L"] * (2 * k["h"] + k["q_lora"] + k["kv_lora"]) + k["h"]) * 2  # norms
                  + k["L"] * (bf16(k["q_lora"], k["h"]) + bf16(k["kv_lora"] + k["rope"], k["h"]))  # q_a, kv_a
                  + k["moe_layers"] * (bf16(k["E"], k["h"]) + k["E"] * 4)  # router + fp32 bias
                  + k["moe_layers"] * k["E"] * 3 * 8)  # every INT4 module's weight_shape
    heads = k["H"] // R
    split = (k["L"] * (bf16(heads * (k["nope"] + k["rope"]), k["q_lora"]) + bf16(heads * (k["nope"] + k["v"]), k["kv_lora"])
                       + bf16(k["h"], heads * k["v"]))
             + k["dense"] * 3 * bf16(k["inter"] // R, k["h"])
             + k["moe_layers"] * 3 * bf16(k["moe"] // R, k["h"])
             + k["moe_layers"] * k["E"] * (2 * int4(k["moe"] // R, k["h"]) + int4(k["h"], k["moe"] // R))
             + bf16(k["V"] // R, k["h"]))
    return replicated, replicated + split


def k2_workspace(R):
    """The workspace estimate inspect states: 2 GiB + 256 rows of fp32 activations on one rank."""
    k = K2
    mlp = max(k["inter"] // R, k["moe"] // R + 8 * (k["moe"] // R))
    per_row = 4 * ((4 + R) * k["h"] + k["q_lora"] + k["kv_lora"] + k["rope"]
                   + (k["H"] // R) * (k["nope"] + k["rope"] + k["kv_lora"] + k["v"]) + 2 * mlp + k["V"] // R)
    return 2 * 2 ** 30 + 256 * per_row, per_row


def test_k2_tp8_fits_an_h200_with_its_numbers():
    out = inspect_json("--preset", "k2", "--tp", 8)
    tp = out["tp"]
    replicated, per_rank = k2_rank_bytes(8)
    assert tp["ranks"] == 8 and tp["heads_per_rank"] == 64 // 8 and tp["moe_intermediate_per_rank"] == 2048 // 8
    assert tp["dense_intermediate_per_rank"] == 18432 // 8 and tp["vocab_rows_per_rank"] == 163840 // 8
    assert tp["replicated_bytes"] == replicated
    assert tp["weight_bytes_per_rank"] == per_rank
    assert tp["weight_bytes_by_rank"] == [per_rank] * 8
    # Σ ranks = the unsharded total + 7 × what every rank holds in full.
    assert sum(tp["weight_bytes_by_rank"]) == out["bytes"]["weights_stored"] + 7 * replicated
    assert per_rank / 1e9 == pytest.approx(594.2 / 8 + replicated / 1e9 * 7 / 8, rel=2e-3)
    assert tp["kv_bytes_per_token_per_rank"] == 61 * (512 + 64) * 2  # the latent is not split
    ws, per_row = k2_workspace(8)
    assert tp["workspace"]["bytes"] == ws and tp["workspace"]["bytes_per_row"] == per_row
    gpu = H200_GIB * 2 ** 30
    assert tp["gpu_memory_bytes"] == gpu
    assert tp["kv_tokens_fit"] == (gpu - per_rank - ws) // 70272
    assert tp["reductions_per_step"] == 2 * 61 and tp["reduction_bytes_per_row"] == 7168 * 4

    text = kdtree("inspect", "--preset", "k2", "--tp", 8, ok=True).stdout
    assert "8 ranks: 8 heads, expert slice 256" in text, text
    assert f"weights {per_rank / 1e9:.3f} GB" in text, text
    assert f"{(gpu - per_rank - ws) // 70272} KV tokens" in text, text
    assert "122 a step" in text and "28672 B a row" in text, text


def test_k2_tp1_is_refused_with_the_numbers_and_what_to_do():
    r = kdtree("inspect", "--preset", "k2", "--tp", 1, ok=False)
    _, per_rank = k2_rank_bytes(1)
    assert r.returncode == 1, str(r)
    assert "does not fit a 139 GiB GPU" in r.stderr, r.stderr
    assert f"{per_rank / 1e9:.3f} GB" in r.stderr, r.stderr  # ≈ 594.2 GB of weights on one GPU
    assert f"{H200_GIB * 2 ** 30 / 1e9:.3f} GB" in r.stderr, r.stderr
    assert "--tp 8 fits" in r.stderr, r.stderr  # the smallest R (of 2, 4, 8, …) that holds K2 and the KV
    # The plan is printed all the same (stdout), saying it does not fit; the refusal is the error (exit 1).
    assert "tp            1 ranks" in r.stdout and "DOES NOT FIT  139 GiB (" in r.stdout, r.stdout
    assert f"weights {per_rank / 1e9:.3f} GB" in r.stdout, r.stdout


def test_k2_tp4_with_a_long_context_is_refused_suggesting_less_context():
    # At R = 4, 594.2/4 + replicated ≈ 152 GB of weights already exceed 139 GiB: more ranks is the answer.
    r = kdtree("inspect", "--preset", "k2", "--tp", 4, ok=False)
    assert "--tp 8 fits" in r.stderr, r.stderr
    # At R = 8 on a 90 GiB GPU the weights fit, a 1M-token context does not.
    _, per_rank = k2_rank_bytes(8)
    ws, _ = k2_workspace(8)
    fit = (90 * 2 ** 30 - per_rank - ws) // 70272
    assert 0 < fit < 1_000_000
    r = kdtree("inspect", "--preset", "k2", "--tp", 8, "--gpu-memory", 90, "--ctx", 1_000_000, ok=False)
    assert f"--ctx {fit} or less fits at --tp 8" in r.stderr, r.stderr
    # The latent KV is on every rank, so more ranks free only weight bytes: the first R that holds 1M tokens.
    def fits(R):
        return (90 * 2 ** 30 - k2_rank_bytes(R)[1] - k2_workspace(R)[0]) // 70272
    first = next(R for R in (16, 32, 64) if fits(R) >= 1_000_000)
    assert f"--tp {first} fits" in r.stderr and f"room for {fits(first)} KV tokens" in r.stderr, r.stderr
    ok = inspect_json("--preset", "k2", "--tp", 8, "--gpu-memory", 90, "--ctx", fit)
    assert ok["tp"]["kv_tokens_fit"] == fit


def test_k2_tp3_is_refused():
    r = kdtree("inspect", "--preset", "k2", "--tp", 3, ok=False)
    assert r.returncode == 1
    assert "num_attention_heads = 64 is not divisible by R = 3" in r.stderr, r.stderr
    assert "Valid R for this model: 1, 2, 4, 8, 16, 32, 64" in r.stderr, r.stderr


def test_tp_on_a_checkpoint_keeps_int4_groups_whole():
    # tests/fixtures/k25-sharded: 4 heads, INT4 experts 64 wide (two groups of 32), vocab 512.
    d = FIXTURES / "k25-sharded"
    out = inspect_json("-m", d, "--tp", 2)
    assert out["tp"]["heads_per_rank"] == 2 and out["tp"]["moe_intermediate_per_rank"] == 32
    assert out["tp"]["vocab_rows_per_rank"] == 256 and out["tp"]["vocab_rows_last_rank"] == 256
    r = kdtree("inspect", "-m", d, "--tp", 4, ok=False)
    assert "down_proj: its input dim 64 / R = 4 gives a slice of 16 columns, not a multiple of the INT4 group size 32" \
        in r.stderr, r.stderr
    assert "Valid R for this model: 1, 2" in r.stderr, r.stderr


def test_tp_flags_in_help_and_the_limit_without_tp_plans_one_gpu():
    h = kdtree("inspect", "--help", ok=True).stdout
    assert "--tp" in h and "--gpu-memory-limit" in h and "per-GPU memory plan" in h and "GiB" in h, h
    # Without --tp the limit plans one GPU (R = 1): K2's 594 GB do not fit 80 GiB; the plan is printed, then refused.
    _, per_rank = k2_rank_bytes(1)
    for flag in ("--gpu-memory-limit", "--gpu-memory"):  # --gpu-memory: the older name
        r = kdtree("inspect", "--preset", "k2", flag, 80, ok=False)
        assert r.returncode == 1, str(r)
        assert "does not fit a 80 GiB GPU" in r.stderr and f"{per_rank / 1e9:.3f} GB" in r.stderr, r.stderr
        assert "DOES NOT FIT  80 GiB (" in r.stdout and "tp            1 ranks" in r.stdout, r.stdout
    assert kdtree("inspect", "--preset", "k2", "--tp", 0).returncode == 2
    assert kdtree("inspect", "--preset", "k2", "--gpu-memory-limit", 0).returncode == 2


def safetensors_bytes(d: Path) -> int:
    """Data bytes of every tensor in a checkpoint directory, from the headers (the format parsed by hand)."""
    total = 0
    for f in sorted(d.glob("*.safetensors")):
        if f.name.startswith("golden"):
            continue
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, t in header.items():
            if name != "__metadata__":
                total += t["data_offsets"][1] - t["data_offsets"][0]
    return total


def fixture_workspace(cfg: dict, R: int) -> int:
    """The plan's stated workspace estimate, from config.json: 2 GiB + 256 rows × the fp32 values one
    row keeps live on a rank (model/tp_plan.h's formula, written out again)."""
    h, H = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, kv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    dense = cfg["first_k_dense_replace"] > 0
    moe = cfg["num_hidden_layers"] > cfg["first_k_dense_replace"]
    mlp = max(cfg["intermediate_size"] // R if dense else 0,
              (cfg["moe_intermediate_size"] * cfg["n_shared_experts"] // R + cfg["num_experts_per_tok"] *
               (cfg["moe_intermediate_size"] // R)) if moe else 0)
    per_row = 4 * ((4 + R) * h + cfg["q_lora_rank"] + kv + rope + (H // R) * (nope + rope + kv + v) + 2 * mlp
                   + -(-cfg["vocab_size"] // R))
    return 2 * 2 ** 30 + 256 * per_row


@pytest.mark.parametrize("R", [1, 2])
def test_gpu_memory_limit_on_a_checkpoint_refuses_then_fits_with_the_numbers(R):
    # No GPU is needed: the plan comes from config.json and the safetensors headers.
    d = FIXTURES / "k2-bf16"
    cfg = json.loads((d / "config.json").read_text())
    kv_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    ws = fixture_workspace(cfg, R)
    tp = ["--tp", R] if R > 1 else []
    ctx = 4096
    fits = inspect_json("-m", d, *tp, "--gpu-memory-limit", 4, "--ctx", ctx)["tp"]
    weights = fits["weight_bytes_per_rank"]
    if R == 1:  # one GPU holds every tensor of the checkpoint (all of them are the text model's)
        assert weights == safetensors_bytes(d)
    assert fits["workspace"]["bytes"] == ws and fits["kv_bytes_per_token_per_rank"] == kv_token
    assert fits["fits"] is True and fits["refusal"] == ""
    assert fits["kv_tokens_fit"] == (4 * 2 ** 30 - weights - ws) // kv_token
    # 2 GiB cannot hold the 2 GiB fixed workspace and the rest: the plan is printed, then refused (exit 1).
    r = kdtree("inspect", "-m", d, *tp, "--gpu-memory-limit", 2, "--ctx", ctx, "--json", ok=False)
    assert r.returncode == 1, str(r)
    plan = r.json()["tp"]
    assert plan["fits"] is False and plan["kv_tokens_fit"] == 0 and plan["weight_bytes_per_rank"] == weights
    assert plan["refusal"] in r.stderr
    need = weights + ws + ctx * kv_token
    assert f"does not fit a 2 GiB GPU ({2 * 2 ** 30 / 1e9:.3f} GB)" in r.stderr, r.stderr
    assert f"weights {weights / 1e9:.3f} GB a rank + workspace {ws / 1e9:.3f} GB (estimate)" in r.stderr, r.stderr
    assert f"= {need / 1e9:.3f} GB a GPU" in r.stderr, r.stderr
    # Text: the plan, its verdict on stdout, the numbers and a way out on stderr.
    t = kdtree("inspect", "-m", d, *tp, "--gpu-memory-limit", 2, ok=False)
    assert "DOES NOT FIT  2 GiB (" in t.stdout and "refused" in t.stdout, t.stdout
    assert "no valid --tp fits this GPU" in t.stderr, t.stderr  # the fixed 2 GiB alone fills it at every R


@pytest.mark.parametrize("cmd", [["run", "--prompt-ids", "1,2", "-n", "2"], ["bench", "-p", "4", "-n", "2"], ["serve"]])
def test_gpu_memory_limit_is_for_gpus_and_documented(cmd):
    h = kdtree(cmd[0], "--help", ok=True).stdout
    assert "--gpu-memory-limit" in h and "GiB kdtree may use on each GPU" in h, h
    r = kdtree(*cmd[:1], "-m", FIXTURES / "k2-bf16", *cmd[1:], "--gpu-memory-limit", 8, ok=False)
    assert "--gpu-memory-limit: it applies with --device cuda only" in r.stderr, r.stderr
