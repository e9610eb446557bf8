"""Bad input never crashes (DESIGN.md §2): every broken checkpoint and every bad command line ends in
a normal exit ≠ 0 with a message naming the file and, where there is one, the tensor or field.

Each checkpoint case copies a fixture into tmp_path and breaks one thing. Header-level corruption is
written byte for byte (8-byte LE length + JSON + data); tensor-level defects are otherwise well-formed
files written by the safetensors library itself, so the engine has exactly one thing to complain about.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from safetensors import safe_open

from conftest import (FIXTURES, RawSafetensors, assert_clean_failure, copy_fixture, edit_json, kdtree,
                      write_raw_safetensors)

K2 = "k2-int4"
K25 = "k25-sharded"
K2_FILE = "model.safetensors"
K25_SHARD = "model-00002-of-00003.safetensors"
INDEX = "model.safetensors.index.json"
L1 = "model.layers.1."
K25_L1 = "language_model.model.layers.1."


@dataclass
class Case:
    id: str
    fixture: str
    breaks: Callable[[Path], list[str] | None]  # mutates the copy; may return extra names to expect
    expect: list[str]  # substrings stderr must hold (file, tensor, field)
    inspect_fails: bool  # `inspect -m` reads config + headers only: it must fail on those, not on tensor data
    expect_any: list[str] = field(default_factory=list)  # at least one of these (filled in by `breaks`)


# --- mutators -------------------------------------------------------------------------------------

def truncate_data(name: str, cut: int = 1000):
    def f(d: Path):
        p = d / name
        raw = RawSafetensors(p)
        new_size = p.stat().st_size - cut
        data_len = new_size - 8 - raw.header_len
        os.truncate(p, new_size)
        # Every tensor whose bytes now run past the end is a correct thing to name.
        return [n for n in raw.names if raw.header[n]["data_offsets"][1] > data_len]
    return f


def truncate_header(name: str):
    def f(d: Path):
        p = d / name
        n = RawSafetensors(p).header_len
        os.truncate(p, 8 + n // 2)
    return f


def raw_file(name: str, header: bytes | str | dict, data: bytes = b"", length: int | None = None):
    def f(d: Path):
        write_raw_safetensors(d / name, header, data, length)
    return f


def write_bytes(name: str, content: bytes):
    def f(d: Path):
        (d / name).write_bytes(content)
    return f


def edit_header(name: str, fn):
    """Changes the header JSON in place, data section untouched."""
    def f(d: Path):
        raw = RawSafetensors(d / name)
        fn(raw.header)
        raw.write(d / name)
    return f


def rewrite(name: str, drop=(), replace=None):
    """A well-formed rewrite of one file (the defect is only what `drop`/`replace` say)."""
    def f(d: Path):
        p = d / name
        raw = RawSafetensors(p)
        reps = {k: v(raw) if callable(v) else v for k, v in (replace or {}).items()}
        raw.rewritten(p, drop=drop, replace=reps)
        with safe_open(str(p), "np") as st:  # the safetensors library accepts the result
            keys = set(st.keys())
        assert not (set(drop) & keys) and set(reps) <= keys
    return f


def edit_config(fn):
    def f(d: Path):
        edit_json(d / "config.json", fn)
    return f


def text_cfg(c: dict) -> dict:
    return c.get("text_config", c)


def edit_index(fn):
    def f(d: Path):
        edit_json(d / INDEX, fn)
    return f


def chain(*fs):
    def f(d: Path):
        out = []
        for g in fs:
            out += g(d) or []
        return out
    return f


def set_key(k, v):
    return lambda c: text_cfg(c).__setitem__(k, v)


def del_key(k):
    return lambda c: text_cfg(c).pop(k)


def set_weight_bits(bits):
    def fn(c):
        text_cfg(c)["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = bits
    return fn


def set_quant_method(m):
    def fn(c):
        text_cfg(c)["quantization_config"]["quant_method"] = m
        if "quantization_config" in c:
            c["quantization_config"]["quant_method"] = m
    return fn


def drop_quant(c):
    text_cfg(c).pop("quantization_config", None)
    c.pop("quantization_config", None)


def move_in_index(tensor: str, to_shard: str):
    def fn(idx):
        assert idx["weight_map"][tensor] != to_shard
        idx["weight_map"][tensor] = to_shard
    return fn


def remove_file(name: str):
    def f(d: Path):
        (d / name).unlink()
    return f


# A tensor header entry whose bytes are consistent with its own shape, for the header edits.
def _set(tensor, **kv):
    return lambda h: h[tensor].update(kv)


def _overlap(a, b):
    def fn(h):
        assert h[a]["dtype"] == h[b]["dtype"] and h[a]["shape"] == h[b]["shape"]
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
    return fn


def _past_end(tensor):
    def fn(h):
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        b, e = h[tensor]["data_offsets"]
        h[tensor]["data_offsets"] = [end, end + (e - b)]
    return fn


def _reversed(tensor):
    return lambda h: h[tensor].update(data_offsets=h[tensor]["data_offsets"][::-1])


def _i32_norm(raw):
    return ("I32", [64], np.ones(64, "<i4").tobytes())


def _fp8_kv_b(raw):
    return ("F8_E4M3", [256, 32], bytes(256 * 32))


def _weight_shape(rows, cols):
    return lambda raw: ("I32", [2], np.array([rows, cols], "<i4").tobytes())


def _packed_short(raw):
    return ("I32", [64, 11], bytes(64 * 11 * 4))


def _scale_f32(raw):
    return ("F32", [64, 3], np.ones((64, 3), "<f4").tobytes())


NORM0 = "model.layers.0.input_layernorm.weight"
NORM0_POST = "model.layers.0.post_attention_layernorm.weight"
KVB1 = L1 + "self_attn.kv_b_proj.weight"
EXP0_DOWN = L1 + "mlp.experts.0.down_proj"
K25_KVB1 = K25_L1 + "self_attn.kv_b_proj.weight"

CASES = [
    # --- safetensors container ---------------------------------------------------------------
    Case("truncated-in-data", K2, truncate_data(K2_FILE), [K2_FILE], True),
    Case("truncated-shard-in-data", K25, truncate_data(K25_SHARD), [K25_SHARD], True),
    Case("truncated-in-header", K2, truncate_header(K2_FILE), [K2_FILE, "header"], True),
    Case("truncated-shard-in-header", K25, truncate_header(K25_SHARD), [K25_SHARD, "header"], True),
    Case("header-length-beyond-eof", K2, raw_file(K2_FILE, '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                                                  bytes(4), length=1 << 20), [K2_FILE, "header"], True),
    Case("header-length-absurd", K2, raw_file(K2_FILE, "{}", length=1 << 62), [K2_FILE, "header"], True),
    Case("file-shorter-than-length-prefix", K2, write_bytes(K2_FILE, b"\x10\x00\x00"), [K2_FILE], True),
    Case("empty-file", K2, write_bytes(K2_FILE, b""), [K2_FILE], True),
    Case("header-invalid-json", K2, raw_file(K2_FILE, '{"model.embed_tokens.weight": {"dtype": "BF16", '),
         [K2_FILE, "JSON"], True),
    Case("header-not-an-object", K2, raw_file(K2_FILE, "[1, 2, 3]"), [K2_FILE], True),
    Case("header-invalid-utf8", K2, raw_file(K2_FILE, b'{"\xff\xfe": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                             bytes(4)), [K2_FILE], True),
    Case("unknown-dtype", K2, edit_header(K2_FILE, _set(NORM0, dtype="Q9")), [K2_FILE, NORM0, "Q9"], True),
    Case("shape-times-itemsize-mismatch", K2, edit_header(K2_FILE, _set(NORM0, shape=[65])), [K2_FILE, NORM0], True),
    Case("negative-dimension", K2, edit_header(K2_FILE, _set(NORM0, shape=[-64])), [K2_FILE, NORM0], True),
    Case("shape-not-integers", K2, edit_header(K2_FILE, _set(NORM0, shape=["64"])), [K2_FILE, NORM0], True),
    Case("overlapping-data-offsets", K2, edit_header(K2_FILE, _overlap(NORM0, NORM0_POST)),
         [K2_FILE, NORM0, NORM0_POST, "overlap"], True),
    Case("data-offsets-past-end", K2, edit_header(K2_FILE, _past_end(NORM0)), [K2_FILE, NORM0], True),
    Case("data-offsets-reversed", K2, edit_header(K2_FILE, _reversed(NORM0)), [K2_FILE, NORM0], True),
    Case("data-offsets-missing", K2, edit_header(K2_FILE, lambda h: h[NORM0].pop("data_offsets")),
         [K2_FILE, NORM0, "data_offsets"], True),
    Case("shape-overflows", K2, edit_header(K2_FILE, _set(NORM0, shape=[2**62, 2**62, 16])), [K2_FILE, NORM0], True),
    Case("data-offsets-not-integers", K2, edit_header(K2_FILE, _set(NORM0, data_offsets=[0.5, 128.5])),
         [K2_FILE, NORM0, "data_offsets"], True),
    Case("dtype-not-a-string", K2, edit_header(K2_FILE, _set(NORM0, dtype=7)), [K2_FILE, NORM0, "dtype"], True),
    Case("metadata-not-strings", K2, edit_header(K2_FILE, lambda h: h.update({"__metadata__": {"format": 1}})),
         [K2_FILE, "__metadata__"], True),
    Case("shard-unknown-dtype", K25, edit_header(K25_SHARD, _set(K25_L1 + "post_attention_layernorm.weight", dtype="X7")),
         [K25_SHARD, K25_L1 + "post_attention_layernorm.weight", "X7"], True),
    # --- tensors the model needs ---------------------------------------------------------------
    Case("missing-tensor", K2, rewrite(K2_FILE, drop=[KVB1]), [KVB1, K2_FILE], False),
    Case("missing-tensor-sharded", K25,
         chain(rewrite(K25_SHARD, drop=[K25_KVB1]), edit_index(lambda i: i["weight_map"].pop(K25_KVB1))),
         [K25_KVB1, INDEX], False),
    Case("wrong-shape", K2, edit_header(K2_FILE, _set(KVB1, shape=[32, 256])), [KVB1, K2_FILE, "[256, 32]"], False),
    Case("wrong-dtype-i32-norm", K2, rewrite(K2_FILE, replace={NORM0: _i32_norm}), [NORM0, K2_FILE, "I32"], False),
    Case("fp8-dense-weight", K2, rewrite(K2_FILE, replace={KVB1: _fp8_kv_b}), [KVB1, K2_FILE, "FP8"], False),
    Case("int4-weight-shape-disagrees", K2, rewrite(K2_FILE, replace={EXP0_DOWN + ".weight_shape": _weight_shape(64, 97)}),
         [EXP0_DOWN + ".weight_shape", K2_FILE, "97"], False),
    Case("int4-weight-shape-transposed", K25,
         rewrite("model-00002-of-00003.safetensors",
                 replace={K25_L1 + "mlp.experts.0.down_proj.weight_shape": _weight_shape(96, 64)}),
         [K25_L1 + "mlp.experts.0.down_proj.weight_shape", K25_SHARD], False),
    Case("int4-packed-wrong-shape", K2, rewrite(K2_FILE, replace={EXP0_DOWN + ".weight_packed": _packed_short}),
         [EXP0_DOWN + ".weight_packed", K2_FILE, "[64, 12]"], False),
    Case("int4-scale-wrong-dtype", K2, rewrite(K2_FILE, replace={EXP0_DOWN + ".weight_scale": _scale_f32}),
         [EXP0_DOWN + ".weight_scale", K2_FILE, "F32"], False),
    Case("int4-without-quantization-config", K2, edit_config(drop_quant),
         ["weight_packed", K2_FILE, "quantization_config"], False),
    Case("int4-group-size-disagrees-with-scales", K2,
         edit_config(lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16)),
         ["weight_scale", K2_FILE], False),
    Case("config-hidden-size-disagrees-with-tensors", K2, edit_config(set_key("hidden_size", 32)),
         [K2_FILE, "shape"], False),
    # --- shards and the index ------------------------------------------------------------------
    Case("shard-listed-but-absent", K25, remove_file(K25_SHARD), [INDEX, K25_SHARD], True),
    Case("index-lists-tensor-shard-lacks", K25,
         edit_index(move_in_index(K25_KVB1, "model-00001-of-00003.safetensors")),
         [INDEX, K25_KVB1, "model-00001-of-00003.safetensors"], True),
    Case("index-lists-unknown-tensor", K25,
         edit_index(lambda i: i["weight_map"].update({"language_model.model.layers.7.foo.weight": K25_SHARD})),
         [INDEX, "language_model.model.layers.7.foo.weight"], True),
    Case("index-not-json", K25, write_bytes(INDEX, b'{"weight_map": {'), [INDEX], True),
    Case("index-without-weight-map", K25, write_bytes(INDEX, b'{"metadata": {}}'), [INDEX, "weight_map"], True),
    Case("index-path-escapes-dir", K25,
         edit_index(lambda i: i["weight_map"].update({K25_KVB1: "../model-00002-of-00003.safetensors"})),
         [INDEX, K25_KVB1], True),
    Case("no-weights-at-all", K2, remove_file(K2_FILE), [K2_FILE], True),
    # --- config.json ------------------------------------------------------------------------------
    Case("config-hidden-size-zero", K2, edit_config(set_key("hidden_size", 0)), ["config.json", "hidden_size"], True),
    Case("config-experts-per-tok-too-big", K2, edit_config(set_key("num_experts_per_tok", 17)),
         ["config.json", "num_experts_per_tok"], True),
    Case("config-text-config-hidden-size-zero", K25, edit_config(set_key("hidden_size", 0)),
         ["config.json", "text_config", "hidden_size"], True),
    Case("config-negative-layers", K2, edit_config(set_key("num_hidden_layers", -1)),
         ["config.json", "num_hidden_layers"], True),
    Case("config-vocab-as-string", K2, edit_config(set_key("vocab_size", "512")), ["config.json", "vocab_size"], True),
    Case("config-missing-field", K2, edit_config(del_key("kv_lora_rank")), ["config.json", "kv_lora_rank"], True),
    Case("config-eos-outside-vocab", K2, edit_config(set_key("eos_token_id", 4096)), ["config.json", "eos_token_id"], True),
    Case("config-odd-rope-dim", K2, edit_config(set_key("qk_rope_head_dim", 15)), ["config.json", "qk_rope_head_dim"], True),
    Case("config-group-not-dividing-experts", K2, edit_config(set_key("n_group", 3)), ["config.json", "n_group"], True),
    Case("config-not-json", K2, write_bytes("config.json", b'{"vocab_size": 512,'), ["config.json", "JSON"], True),
    Case("config-empty", K2, write_bytes("config.json", b""), ["config.json"], True),
    Case("config-top-level-array", K2, write_bytes("config.json", b"[]"), ["config.json"], True),
    Case("config-missing", K2, remove_file("config.json"), ["config.json"], True),
    Case("quant-fp8", K2, edit_config(set_quant_method("fp8")), ["config.json", "FP8"], True),
    Case("quant-fp8-k25", K25, edit_config(set_quant_method("fp8")), ["config.json", "FP8"], True),
    Case("quant-8-bit", K2, edit_config(set_weight_bits(8)), ["config.json", "num_bits"], True),
    Case("quant-unknown-method", K2, edit_config(set_quant_method("awq")), ["config.json", "awq"], True),
]


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def broken(request, tmp_path):
    case: Case = request.param
    d = copy_fixture(case.fixture, tmp_path)
    extra = case.breaks(d) or []
    return case, d, extra


def _check_message(r, case: Case, extra: list[str]):
    assert_clean_failure(r)
    assert r.returncode != 2, f"a checkpoint defect is not a usage error\n{r}"
    for s in case.expect:
        assert s in r.stderr, f"stderr does not name {s!r}\n{r}"
    if extra:
        assert any(n in r.stderr for n in extra), f"stderr names none of the tensors past the cut {extra[:5]}\n{r}"
    assert r.stdout == "", f"nothing belongs on stdout after an error\n{r}"


def test_run_rejects_broken_checkpoint(broken):
    case, d, extra = broken
    r = kdtree("run", "-m", d, "--prompt-ids", "1,2,3", "-n", 2, "--json")
    _check_message(r, case, extra)


def test_inspect_rejects_broken_checkpoint(broken):
    case, d, extra = broken
    r = kdtree("inspect", "-m", d, "--json")
    if case.inspect_fails:
        _check_message(r, case, extra)
    elif r.returncode == 0:
        # inspect reads config.json and the headers only; a tensor-level defect is the loader's to find,
        # so inspect may still describe the checkpoint...
        assert "checkpoint" in r.json(), str(r)
    else:
        # ...or, if it does check tensors, it must say the same precise thing as run.
        _check_message(r, case, extra)


def test_control_copy_runs(tmp_path):
    # The table's premise: an unbroken copy of each fixture runs, so every failure above is the defect's.
    for fx in (K2, K25):
        d = copy_fixture(fx, tmp_path / "ok")
        kdtree("run", "-m", d, "--prompt-ids", "1,2,3", "-n", 2, "--json", ok=True)


@pytest.mark.parametrize("fixture,name", [(K2, K2_FILE), (K25, K25_SHARD)])
def test_identity_rewrite_still_runs(tmp_path, fixture, name):
    # The rewrite helper itself must not be what breaks a file.
    d = copy_fixture(fixture, tmp_path)
    ref = kdtree("run", "-m", FIXTURES / fixture, "--prompt-ids", "1,2,3", "-n", 4, "--json", "--ignore-eos", ok=True)
    rewrite(name)(d)
    r = kdtree("run", "-m", d, "--prompt-ids", "1,2,3", "-n", 4, "--json", "--ignore-eos", ok=True)
    assert r.json()["output_ids"] == ref.json()["output_ids"]


# --- -m that is not a checkpoint directory ---------------------------------------------------------

def test_model_is_a_regular_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not a directory")
    for cmd in (["run", "-m", f, "--prompt-ids", "1", "-n", 1], ["inspect", "-m", f]):
        r = kdtree(*cmd, ok=False)
        assert str(f) in r.stderr and "directory" in r.stderr, str(r)


def test_model_does_not_exist(tmp_path):
    d = tmp_path / "nope"
    r = kdtree("run", "-m", d, "--prompt-ids", "1", "-n", 1, ok=False)
    assert str(d) in r.stderr, str(r)


def test_model_safetensors_is_a_directory(tmp_path):
    d = copy_fixture(K2, tmp_path)
    (d / K2_FILE).unlink()
    (d / K2_FILE).mkdir()
    r = kdtree("run", "-m", d, "--prompt-ids", "1", "-n", 1, ok=False)
    assert K2_FILE in r.stderr, str(r)


# --- bad command lines -------------------------------------------------------------------------------

M = ["-m", FIXTURES / K2]


def test_unknown_flag_is_usage_error():
    r = kdtree("run", *M, "--prompt-ids", "1", "--bogus-flag")
    assert_clean_failure(r, code=2)
    assert "--bogus-flag" in r.stderr and "--help" in r.stderr, str(r)


def test_unknown_subcommand_is_usage_error():
    r = kdtree("frobnicate")
    assert_clean_failure(r, code=2)
    assert "frobnicate" in r.stderr, str(r)


def test_missing_model_is_usage_error():
    r = kdtree("run", "--prompt-ids", "1,2,3")
    assert_clean_failure(r, code=2)
    assert "--model" in r.stderr or "-m" in r.stderr, str(r)


def test_no_subcommand_is_usage_error():
    r = kdtree()
    assert_clean_failure(r, code=2)
    assert "subcommand" in r.stderr.lower(), str(r)


def test_non_numeric_prompt_id_is_named():
    r = kdtree("run", *M, "--prompt-ids", "1,x,3", ok=False)
    assert "'x'" in r.stderr and "--prompt-ids" in r.stderr, str(r)


@pytest.mark.parametrize("ids,bad", [("1,,3", "''"), ("-1", "'-1'"), ("1,2,", "''"), ("99999999999", "'99999999999'"),
                                     ("0x10", "'0x10'"), ("1.5", "'1.5'")])
def test_malformed_prompt_ids_are_named(ids, bad):
    r = kdtree("run", *M, "--prompt-ids", ids, ok=False)
    assert bad in r.stderr and "--prompt-ids" in r.stderr, str(r)


def test_prompt_id_outside_vocab_is_named():
    r = kdtree("run", *M, "--prompt-ids", "1,512,3", ok=False)
    assert "512" in r.stderr and "vocab" in r.stderr, str(r)


def test_text_prompt_explains_tokenizer():
    r = kdtree("run", *M, "-p", "Hello there", ok=False)
    assert "tokenizer" in r.stderr and "--prompt-ids" in r.stderr, str(r)


def test_spec_ddtree_is_a_clear_error():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "--spec", "ddtree", ok=False)
    assert "ddtree" in r.stderr and "--spec" in r.stderr, str(r)


def test_unknown_spec_is_a_clear_error():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "--spec", "medusa", ok=False)
    assert "medusa" in r.stderr, str(r)


def test_device_cuda_is_a_clear_error():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "--device", "cuda", ok=False)
    assert "cuda" in r.stderr and "--device" in r.stderr, str(r)


def test_draft_without_ddtree_is_a_clear_error(tmp_path):
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "--draft", tmp_path, ok=False)
    assert "--draft" in r.stderr, str(r)


@pytest.mark.parametrize("value", ["", " ", ","])
def test_empty_prompt_ids(value):
    r = kdtree("run", *M, "--prompt-ids", value, ok=False)
    assert "--prompt-ids" in r.stderr or "prompt" in r.stderr, str(r)


def test_no_prompt_at_all():
    r = kdtree("run", *M, "-n", 2, ok=False)
    assert "--prompt-ids" in r.stderr, str(r)


def test_prompt_and_text_together():
    r = kdtree("run", *M, "-p", "hi", "--prompt-ids", "1", ok=False)
    assert "--prompt" in r.stderr, str(r)


@pytest.mark.parametrize("ctx,ids", [(4, "1,2,3,4,5"), (4, "1,2,3,4")])
def test_prompt_longer_than_context(ctx, ids):
    r = kdtree("run", *M, "-c", ctx, "--prompt-ids", ids, "-n", 2, ok=False)
    assert "context" in r.stderr and str(ctx) in r.stderr, str(r)


def test_prompt_longer_than_model_context(tmp_path):
    d = copy_fixture(K2, tmp_path)
    edit_json(d / "config.json", lambda c: c.update(max_position_embeddings=4))
    r = kdtree("run", "-m", d, "--prompt-ids", "1,2,3,4,5", "-n", 2, ok=False)
    assert "context" in r.stderr, str(r)


@pytest.mark.parametrize("args,flag", [(["-n", "-1"], "--n-predict"), (["-n", "many"], "--n-predict"),
                                       (["-c", "-5"], "--ctx-size"), (["--decode-attn", "sideways"], "--decode-attn"),
                                       (["-t", "0"], "--threads")])
def test_out_of_range_flags_are_usage_errors(args, flag):
    pre, post = (args, []) if args[0] == "-t" else ([], args)
    r = kdtree(*pre, "run", *M, "--prompt-ids", "1,2,3", *post)
    assert_clean_failure(r, code=2)
    assert flag in r.stderr, str(r)


def test_dump_logits_to_unwritable_path(tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "logits.safetensors"
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 2, "--dump-logits", target, ok=False)
    assert str(target) in r.stderr, str(r)


def test_inspect_needs_a_source():
    r = kdtree("inspect", ok=False)
    assert "-m" in r.stderr and "--preset" in r.stderr, str(r)


def test_inspect_unknown_preset_lists_presets():
    r = kdtree("inspect", "--preset", "huge", ok=False)
    assert "huge" in r.stderr and all(p in r.stderr for p in ("tiny", "small", "medium", "k2")), str(r)


def test_inspect_config_file_not_json(tmp_path):
    f = tmp_path / "cfg.json"
    f.write_text("{oops")
    r = kdtree("inspect", "--config", f, ok=False)
    assert str(f) in r.stderr, str(r)


def test_bench_on_broken_checkpoint(tmp_path):
    d = copy_fixture(K2, tmp_path)
    truncate_header(K2_FILE)(d)
    r = kdtree("bench", "-m", d, "-p", 4, "-n", 2, "-r", 1, ok=False)
    assert K2_FILE in r.stderr, str(r)


# --- hostile files (issue 21) ----------------------------------------------------------------------
# A file written to hurt: nesting 100,000 levels deep (nlohmann's dump() and copy recurse once per
# level: rc 139 before the depth bound), a config that is a FIFO (open() blocked forever), a symlink
# to /dev/zero (read until memory ran out), a directory, a sparse file past the size cap, control
# bytes in a header. Each must end at once in exit 1 with a short, printable message naming the file
# (and the field, where the file could be parsed at all).

DEEP = 100_000
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
_HOLE = "__kdtree_hostile__"


def _json_with_raw(obj, set_at, raw: str) -> str:
    """json.dumps(obj) after set_at(obj, HOLE), with the HOLE string replaced by raw JSON text."""
    set_at(obj, _HOLE)
    text = json.dumps(obj)
    assert text.count(f'"{_HOLE}"') == 1
    return text.replace(f'"{_HOLE}"', raw)


def raw_json_value(name: str, set_at, raw: str):
    """Sets a value of JSON file `name` to raw JSON text (e.g. 100k nested brackets)."""
    def f(d: Path):
        p = d / name
        p.write_text(_json_with_raw(json.loads(p.read_text()), set_at, raw))
    return f


def raw_header_value(name: str, set_at, raw: str):
    """The same inside a safetensors header; the data section is untouched."""
    def f(d: Path):
        st = RawSafetensors(d / name)
        write_raw_safetensors(d / name, _json_with_raw(st.header, set_at, raw).encode(), st.data)
    return f


def fifo(name: str):
    def f(d: Path):
        (d / name).unlink(missing_ok=True)
        os.mkfifo(d / name)
    return f


def symlink_to(name: str, target: str):
    def f(d: Path):
        (d / name).unlink(missing_ok=True)
        os.symlink(target, d / name)
    return f


def directory(name: str):
    def f(d: Path):
        (d / name).unlink(missing_ok=True)
        (d / name).mkdir()
    return f


def sparse(name: str, size: int):
    def f(d: Path):
        with open(d / name, "wb") as fh:
            fh.truncate(size)
    return f


def at(key):
    """A setter (obj, value) for a top-level key."""
    return lambda c, v: c.__setitem__(key, v)


def at_dflash(key):
    return lambda c, v: c["dflash_config"].__setitem__(key, v)


def put(key, value):
    return lambda c: c.__setitem__(key, value)


def put_dflash(key, value):
    return lambda c: c["dflash_config"].__setitem__(key, value)


@dataclass
class Hostile:
    id: str
    target: str  # "model": run -m a broken fixture; "drafter": run --spec ddtree --draft a broken drafter;
    #              "tokenizer": tokenize -m a broken tokenizer directory
    breaks: Callable[[Path], None]
    expect: list[str]  # substrings stderr must hold
    fixture: str = K2


CONFIG_CAP = 16 << 20  # core/untrusted.h kMaxConfigBytes
HOSTILE = [
    # nesting
    Hostile("header-shape-deep", "model", raw_header_value(K2_FILE, lambda h, v: h[NORM0].update(shape=v), DEEP_ARRAY),
            [K2_FILE, "header", "nests deeper than 64"]),
    Hostile("config-hidden-size-deep", "model", raw_json_value("config.json", at("hidden_size"), DEEP_ARRAY),
            ["config.json", "nests deeper than 64"]),
    Hostile("config-eos-deep", "model", raw_json_value("config.json", at("eos_token_id"), DEEP_ARRAY),
            ["config.json", "nests deeper than 64"]),
    Hostile("config-eos-deep-object", "model",
            raw_json_value("config.json", at("eos_token_id"), '{"a":' * DEEP + "1" + "}" * DEEP),
            ["config.json", "nests deeper than 64"]),
    Hostile("generation-config-eos-deep", "model",
            lambda d: (d / "generation_config.json").write_text('{"eos_token_id": ' + DEEP_ARRAY + "}"),
            ["generation_config.json", "nests deeper than 64"]),
    Hostile("index-deep", "model", raw_json_value(INDEX, lambda i, v: i.__setitem__("metadata", v), DEEP_ARRAY),
            [INDEX, "nests deeper than 64"], fixture=K25),
    Hostile("drafter-architectures-deep", "drafter", raw_json_value("config.json", at("architectures"), DEEP_ARRAY),
            ["config.json", "nests deeper than 64"]),
    Hostile("drafter-target-layer-ids-deep", "drafter",
            raw_json_value("config.json", at_dflash("target_layer_ids"), DEEP_ARRAY), ["config.json", "nests deeper than 64"]),
    Hostile("drafter-attention-bias-deep", "drafter", raw_json_value("config.json", at("attention_bias"), DEEP_ARRAY),
            ["config.json", "nests deeper than 64"]),
    Hostile("tokenizer-json-deep", "tokenizer", raw_json_value("tokenizer.json", at("normalizer"), DEEP_ARRAY),
            ["tokenizer.json", "nests deeper than 64"], fixture="tokenizer-deepseek-small"),
    Hostile("tokenizer-config-deep", "tokenizer", raw_json_value("tokenizer_config.json", at("x"), DEEP_ARRAY),
            ["tokenizer_config.json", "nests deeper than 64"], fixture="tokenizer-kimi-small"),
    # deep enough to parse, too big to print: the message quotes a short excerpt
    Hostile("config-hidden-size-nested-60", "model", raw_json_value("config.json", at("hidden_size"), "[" * 60 + "]" * 60),
            ["config.json", "hidden_size", "[[[["]),
    Hostile("config-hidden-size-huge-array", "model",
            raw_json_value("config.json", at("hidden_size"), "[" + ",".join(["123456789"] * 200_000) + "]"),
            ["config.json", "hidden_size", "…"]),
    Hostile("config-eos-huge-string", "model", raw_json_value("config.json", at("eos_token_id"), '"' + "x" * 1_000_000 + '"'),
            ["config.json", "eos_token_id", "…"]),
    Hostile("generation-config-eos-huge", "model",
            lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [[' + "7," * 300_000 + "7]]}"),
            ["generation_config.json", "eos_token_id", "…"]),
    Hostile("drafter-architectures-huge", "drafter", raw_json_value("config.json", at("architectures"), "[" + "1," * 300_000 + "1]"),
            ["config.json", "architectures", "…"]),
    Hostile("drafter-attention-bias-wrong", "drafter", raw_json_value("config.json", at("attention_bias"), '[["a"]]'),
            ["config.json", "attention_bias"]),
    # files that are not regular files, or far too big
    Hostile("config-symlink-dev-zero", "model", symlink_to("config.json", "/dev/zero"),
            ["config.json", "not a regular file"]),
    Hostile("config-fifo", "model", fifo("config.json"), ["config.json", "FIFO"]),
    Hostile("config-directory", "model", directory("config.json"), ["config.json", "directory"]),
    Hostile("config-oversized", "model", sparse("config.json", CONFIG_CAP + 1), ["config.json", str(CONFIG_CAP)]),
    Hostile("generation-config-fifo", "model", fifo("generation_config.json"), ["generation_config.json", "FIFO"]),
    Hostile("generation-config-dev-zero", "model", symlink_to("generation_config.json", "/dev/zero"),
            ["generation_config.json", "not a regular file"]),
    Hostile("index-fifo", "model", fifo(INDEX), [INDEX, "FIFO"], fixture=K25),
    Hostile("index-oversized", "model", sparse(INDEX, CONFIG_CAP + 1), [INDEX, str(CONFIG_CAP)], fixture=K25),
    Hostile("shard-fifo", "model", fifo(K25_SHARD), [K25_SHARD, "not a regular file"], fixture=K25),
    Hostile("model-safetensors-fifo", "model", fifo(K2_FILE), [K2_FILE, "not a regular file"]),
    Hostile("model-safetensors-dev-zero", "model", symlink_to(K2_FILE, "/dev/zero"), [K2_FILE, "not a regular file"]),
    Hostile("drafter-config-fifo", "drafter", fifo("config.json"), ["config.json", "FIFO"]),
    Hostile("drafter-config-dev-zero", "drafter", symlink_to("config.json", "/dev/zero"), ["config.json", "not a regular file"]),
    Hostile("drafter-safetensors-fifo", "drafter", fifo("model.safetensors"), ["model.safetensors", "not a regular file"]),
    Hostile("tokenizer-config-fifo", "tokenizer", fifo("tokenizer_config.json"), ["tokenizer_config.json", "FIFO"],
            fixture="tokenizer-kimi-small"),
    Hostile("tiktoken-model-dev-zero", "tokenizer", symlink_to("tiktoken.model", "/dev/zero"),
            ["tiktoken.model", "not a regular file"], fixture="tokenizer-kimi-small"),
    Hostile("tokenizer-json-fifo", "tokenizer", fifo("tokenizer.json"), ["tokenizer.json", "FIFO"],
            fixture="tokenizer-deepseek-small"),
    # control bytes: never copied raw into the message
    Hostile("header-control-bytes-not-json", "model",
            raw_file(K2_FILE, b'{"\x1b[31mred\x07": {"dtype": "F32", \x01\x02\x7f\xc2\x9b\xff garbage'),
            [K2_FILE, "JSON"]),
    Hostile("header-escaped-control-in-name", "model",
            raw_file(K2_FILE, '{"\\u001b[2Jevil\\u0007": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}', bytes(4)),
            [K2_FILE, "Q9", "evil"]),
    Hostile("tiktoken-line-control-bytes", "tokenizer",
            lambda d: (d / "tiktoken.model").write_bytes(b"QQ== 0\n\x1b[31m a b\x07\n"),
            ["tiktoken.model", ":2:"], fixture="tokenizer-kimi-small"),
    # work bounded by sense: a drafter block far past the CLI's own cap
    Hostile("drafter-block-size-4096", "drafter", lambda d: edit_json(d / "config.json", put("block_size", 4096)),
            ["config.json", "block_size", "4096", "64"]),
    Hostile("drafter-dflash-block-size-4096", "drafter",
            lambda d: edit_json(d / "config.json", put_dflash("block_size", 4096)), ["config.json", "block_size", "64"]),
]


# Shard indexes: the target and the DFlash drafter (CPU and GPU) read them through one reader
# (io/checkpoint.h ShardDir), so a drafter's index gets every check the target's has.
def drafter_index(edit=None):
    """An index naming every tensor of the drafter's model.safetensors (then edited): the index wins."""
    def f(d: Path):
        idx = {"metadata": {}, "weight_map": {n: K2_FILE for n in RawSafetensors(d / K2_FILE).names}}
        if edit:
            edit(idx)
        (d / INDEX).write_text(json.dumps(idx, indent=1))
    return f


def index_lists_twice(tensor: str, other_shard: str):
    """The index lists `tensor` a second time (one JSON object, the key twice), under another shard."""
    def f(d: Path):
        p = d / INDEX
        head = '"weight_map": {'
        text = p.read_text()
        assert head in text
        p.write_text(text.replace(head, head + json.dumps(tensor) + ": " + json.dumps(other_shard) + ",", 1))
    return f


HOSTILE += [
    Hostile("index-lists-tensor-twice", "model", index_lists_twice(K25_KVB1, "model-00001-of-00003.safetensors"),
            [INDEX, K25_KVB1, "twice"], fixture=K25),
    Hostile("drafter-index-path-escapes-dir", "drafter",
            drafter_index(lambda i: i["weight_map"].update({"fc.weight": "../" + K2_FILE})),
            [INDEX, "fc.weight", "not a file in this directory"]),
    Hostile("drafter-index-shard-absent", "drafter",
            drafter_index(lambda i: i["weight_map"].update({"fc.weight": "model-00002-of-00002.safetensors"})),
            [INDEX, "model-00002-of-00002.safetensors", "absent"]),
    Hostile("drafter-index-lists-unknown-tensor", "drafter",
            drafter_index(lambda i: i["weight_map"].update({"layers.9.foo.weight": K2_FILE})),
            [INDEX, "layers.9.foo.weight", "does not hold it"]),
    Hostile("drafter-index-lists-tensor-twice", "drafter",
            lambda d: (drafter_index()(d), index_lists_twice("fc.weight", K2_FILE)(d)),
            [INDEX, "fc.weight", "twice"]),
    Hostile("drafter-index-deep", "drafter",
            lambda d: (drafter_index()(d), raw_json_value(INDEX, lambda i, v: i.__setitem__("metadata", v), DEEP_ARRAY)(d)),
            [INDEX, "nests deeper than 64"]),
    Hostile("drafter-index-oversized", "drafter", sparse(INDEX, CONFIG_CAP + 1), [INDEX, str(CONFIG_CAP)]),
    Hostile("drafter-shard-dev-zero", "drafter",
            lambda d: (drafter_index(lambda i: i["weight_map"].update({"fc.weight": "zero.safetensors"}))(d),
                       symlink_to("zero.safetensors", "/dev/zero")(d)),
            ["zero.safetensors", "not a regular file"]),
]


@pytest.fixture(scope="module")
def drafter_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter") / "k2-int4-dflash"
    kdtree("make-model", "--drafter-for", FIXTURES / K2, "-o", d, ok=True)
    return d


def _assert_short_printable(r):
    bad = sorted({c for c in r.stderr if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) < 0xa0})
    assert not bad, f"raw control characters {bad!r} in stderr\n{r}"
    assert "\ufffd" not in r.stderr, f"invalid UTF-8 copied into stderr\n{r}"
    assert len(r.stderr) < 5000, f"stderr is {len(r.stderr)} chars: an unbounded copy of the input?\n{r}"


@pytest.mark.parametrize("case", HOSTILE, ids=[c.id for c in HOSTILE])
def test_hostile_file_is_refused_fast_and_cleanly(case: Hostile, tmp_path, drafter_template):
    if case.target == "drafter":
        d = tmp_path / "drafter"
        shutil.copytree(drafter_template, d)
        case.breaks(d)
        args = ["run", "-m", FIXTURES / K2, "--prompt-ids", "1,2,3", "-n", 2, "--spec", "ddtree", "--draft", d]
    elif case.target == "tokenizer":
        d = tmp_path / case.fixture
        shutil.copytree(FIXTURES / case.fixture, d)
        case.breaks(d)
        args = ["tokenize", "-m", d, "--text", "hello"]
    else:
        d = copy_fixture(case.fixture, tmp_path)
        case.breaks(d)
        args = ["run", "-m", d, "--prompt-ids", "1,2,3", "-n", 2, "--json"]
    r = kdtree(*args, timeout=30)  # a FIFO that blocks, or a read of /dev/zero, fails by timeout
    assert_clean_failure(r, code=1)
    for s in case.expect:
        assert s in r.stderr, f"stderr does not name {s!r}\n{r}"
    _assert_short_printable(r)
    assert r.stdout == "", str(r)


def test_inspect_refuses_hostile_config_too(tmp_path):
    d = copy_fixture(K2, tmp_path)
    raw_json_value("config.json", at("hidden_size"), DEEP_ARRAY)(d)
    for args in (["inspect", "-m", d], ["inspect", "--config", d / "config.json"]):
        r = kdtree(*args, timeout=30)
        assert_clean_failure(r, code=1)
        assert "config.json" in r.stderr and "nests deeper" in r.stderr, str(r)
    os.mkfifo(tmp_path / "fifo.json")
    r = kdtree("inspect", "--config", tmp_path / "fifo.json", timeout=30)
    assert_clean_failure(r, code=1)
    assert "fifo.json" in r.stderr and "FIFO" in r.stderr, str(r)


def test_chat_template_refuses_deep_messages_and_tools(tmp_path):
    msgs = tmp_path / "msgs.json"
    msgs.write_text('[{"role": "user", "content": ' + DEEP_ARRAY + "}]")
    r = kdtree("chat-template", "--template", "kimi", "--messages", msgs, timeout=30)
    assert_clean_failure(r, code=1)
    assert "messages" in r.stderr and "nests deeper" in r.stderr, str(r)
    msgs.write_text('[{"role": "user", "content": "hi"}]')
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "f", "parameters": ' + DEEP_ARRAY + "}}]")
    r = kdtree("chat-template", "--template", "kimi-k25", "--messages", msgs, "--tools", tools, timeout=30)
    assert_clean_failure(r, code=1)
    assert "tools" in r.stderr and "nests deeper" in r.stderr, str(r)
    os.mkfifo(tmp_path / "fifo.json")
    r = kdtree("chat-template", "--template", "kimi", "--messages", tmp_path / "fifo.json", timeout=30)
    assert_clean_failure(r, code=1)
    assert "--messages" in r.stderr and "FIFO" in r.stderr, str(r)


def test_tokenize_jsonl_refuses_deep_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('"ok"\n' + DEEP_ARRAY + "\n")
    r = kdtree("tokenize", "-m", FIXTURES / "tokenizer-kimi-small", "--file", f, "--jsonl", timeout=30)
    assert_clean_failure(r, code=1)
    assert f"{f}:2" in r.stderr and "nests deeper" in r.stderr, str(r)


# --- limits on work and input that was silently altered (issue 21) -----------------------------------

def test_budget_beyond_cap_is_a_fast_clear_error():
    # Memory grows with budget²: 100000 took 11 GB and never printed. Refused before anything loads.
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 4, "--spec", "ddtree", "--draft", "synthetic:0.9",
               "--budget", 100000, timeout=10)
    assert_clean_failure(r, code=1)
    assert "--budget" in r.stderr and "100000" in r.stderr and "1024" in r.stderr, str(r)
    r = kdtree("tree", "--logits", tmp_logits_path(), "--budget", 100000, timeout=10)
    assert_clean_failure(r, code=1)
    assert "--budget" in r.stderr and "1024" in r.stderr, str(r)


def tmp_logits_path() -> Path:
    # `tree` checks the budget before it opens the file.
    return Path("/nonexistent/logits.safetensors")


def test_budget_at_cap_is_accepted():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 4, "--spec", "ddtree", "--draft", "synthetic:0.9",
               "--budget", 1024, "--json", "-q", ok=True)
    assert r.json()["spec"]["budget"] == 1024


@pytest.mark.parametrize("cmd,args,flag", [
    ("run", ["--seed", "18446744073709551616"], "--seed"),  # 2^64: was saturated to 2^64 − 1
    ("run", ["--seed", "99999999999999999999999"], "--seed"),
    ("run", ["--seed", "-1"], "--seed"),  # was wrapped to 2^64 − 1
    ("run", ["--seed", "0x10"], "--seed"),  # was read as hex
    ("run", ["--top-k", "4294967296"], "--top-k"),
    ("run", ["--top-k", "1.5"], "--top-k"),
    ("run", ["-n", "9223372036854775808"], "--n-predict"),  # 2^63: was saturated to 2^63 − 1
    ("run", ["-c", "99999999999999999999"], "--ctx-size"),
    ("run", ["--budget", "99999999999999999999"], "--budget"),
    ("run", ["--block-size", "-3"], "--block-size"),
    ("run", ["--block-size", "65"], "--block-size"),
    ("threads", ["-t", "18446744073709551617"], "--threads"),
    ("make-model", ["--seed", "18446744073709551616"], "--seed"),
    ("make-model", ["--seed", "-5"], "--seed"),
    ("make-model", ["--shards", "4294967297"], "--shards"),
    ("make-model", ["--block-size", "4096"], "--block-size"),
    ("inspect", ["--ctx", "99999999999999999999"], "--ctx"),
    ("bench", ["-r", "18446744073709551617"], "--repetitions"),
    ("tree", ["--budget", "-99999999999999999999"], "--budget"),
])
def test_integer_flags_do_not_saturate_or_wrap(tmp_path, cmd, args, flag):
    if cmd == "run":
        argv = ["run", *M, "--prompt-ids", "1,2,3", "-n", 2, *args] if args[0] != "-n" else ["run", *M, "--prompt-ids", "1", *args]
    elif cmd == "threads":
        argv = [*args, "run", *M, "--prompt-ids", "1,2,3"]
    elif cmd == "make-model":
        argv = ["make-model", "--preset", "tiny", "-o", tmp_path / "m", *args]
    elif cmd == "inspect":
        argv = ["inspect", "--preset", "tiny", *args]
    elif cmd == "bench":
        argv = ["bench", *M, *args]
    else:
        argv = ["tree", "--logits", tmp_path / "l.safetensors", *args]
    r = kdtree(*argv, timeout=30)
    assert_clean_failure(r, code=2)
    assert flag in r.stderr, str(r)
    assert not (tmp_path / "m").exists(), "make-model wrote a model despite the bad flag"


def test_seed_at_uint64_max_is_accepted():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 2, "--temp", "0.8", "--seed", "18446744073709551615",
               "--json", "-q", ok=True)
    assert r.json()["sampling"]["seed"] == 18446744073709551615


def test_leading_zeros_are_decimal_not_octal():
    a = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 4, "--temp", "0.8", "--seed", "010", "--json", "-q", ok=True)
    assert a.json()["sampling"]["seed"] == 10


def test_block_size_with_a_real_drafter(drafter_template):
    base = ["run", *M, "--prompt-ids", "1,2,3", "-n", 4, "--spec", "ddtree", "--draft", drafter_template]
    cfg = json.loads((drafter_template / "config.json").read_text())
    own = cfg.get("dflash_config", {}).get("block_size", cfg.get("block_size"))
    assert own == 8
    # A different block size was silently ignored: now refused, naming both values and the file.
    r = kdtree(*base, "--block-size", 4, timeout=30)
    assert_clean_failure(r, code=1)
    assert "--block-size" in r.stderr and "4" in r.stderr and "block_size = 8" in r.stderr, str(r)
    assert "config.json" in r.stderr, str(r)
    # The drafter's own block size, stated again, is not an error.
    r = kdtree(*base, "--block-size", 8, "--json", "-q", ok=True)
    assert r.json()["spec"]["block_size"] == 8


def test_block_size_without_speculation_is_an_error():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 2, "--block-size", 4)
    assert_clean_failure(r, code=1)
    assert "--block-size" in r.stderr, str(r)


def test_block_size_still_sets_a_synthetic_drafter():
    r = kdtree("run", *M, "--prompt-ids", "1,2,3", "-n", 4, "--spec", "dflash", "--draft", "synthetic:oracle",
               "--block-size", 4, "--json", "-q", ok=True)
    assert r.json()["spec"]["block_size"] == 4
