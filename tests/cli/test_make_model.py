"""`kdtree make-model`: deterministic bytes per seed, published formats (single file, shards + index,
compressed-tensors INT4), read back with the safetensors library."""
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import (FIXTURES, RawSafetensors, assert_clean_failure, kdtree, run_json, save_tensors,
                      unpack_int4)

PROMPT = [1, 2, 3, 4, 5]
EXPERT = "model.layers.1.mlp.experts.3"


def make(out: Path, *args, seed=3, ok=True):
    return kdtree("make-model", "--preset", "tiny", "-o", out, "--seed", seed, *args, ok=ok)


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mm") / "tiny-s3"
    make(d)
    return d


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mm") / "tiny-s3-shards"
    make(d, "--shards", 3)
    return d


def test_same_seed_same_bytes(tiny, tmp_path):
    again = tmp_path / "again"
    make(again)
    a, b = files_of(tiny), files_of(again)
    assert sorted(a) == ["config.json", "model.safetensors"]
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs with seed 3"


def test_different_seed_different_weights(tiny, tmp_path):
    other = tmp_path / "s4"
    make(other, seed=4)
    assert (tiny / "config.json").read_bytes() == (other / "config.json").read_bytes()
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    a = RawSafetensors(tiny / "model.safetensors")
    b = RawSafetensors(other / "model.safetensors")
    assert a.names == b.names
    # Not just one stray byte: the embedding itself is different.
    assert a.bytes_of("model.embed_tokens.weight") != b.bytes_of("model.embed_tokens.weight")


def test_tiny_runs_and_is_deterministic(tiny):
    a = run_json(tiny, PROMPT, "--ignore-eos", n=16)
    b = run_json(tiny, PROMPT, "--ignore-eos", n=16)
    assert len(a["output_ids"]) == 16 and a["output_ids"] == b["output_ids"]
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for t in a["output_ids"])


def test_written_files_are_valid_for_the_safetensors_library(tiny):
    with safe_open(str(tiny / "model.safetensors"), "np") as st:
        keys = set(st.keys())
        assert st.metadata() == {"format": "pt"}  # what HF's save_pretrained writes
    raw = RawSafetensors(tiny / "model.safetensors")
    assert keys == set(raw.names)
    assert (8 + raw.header_len) % 8 == 0, "data section should start 8-byte aligned"
    # Tensors are back to back: no gaps, no overlaps, and the data section ends with the last one.
    spans = sorted(tuple(raw.header[n]["data_offsets"]) for n in raw.names)
    assert spans[0][0] == 0 and spans[-1][1] == len(raw.data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_shards_cover_every_tensor(tiny, tiny_sharded):
    names = sorted(p.name for p in tiny_sharded.iterdir())
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert names == sorted(["config.json", "model.safetensors.index.json", *shards])
    index = json.loads((tiny_sharded / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    held: dict[str, str] = {}
    for s in shards:
        with safe_open(str(tiny_sharded / s), "np") as st:
            for k in st.keys():
                assert k not in held, f"{k} is in both {held[k]} and {s}"
                held[k] = s
    assert set(held) == set(wm), (set(held) ^ set(wm))
    for k, s in wm.items():
        assert held[k] == s, f"index puts {k} in {s}, but it is in {held[k]}"
    assert set(wm.values()) == set(shards), "every shard holds something"
    # The same tensors as the single-file model, byte for byte.
    single = RawSafetensors(tiny / "model.safetensors")
    assert set(single.names) == set(wm)
    by_shard = {s: RawSafetensors(tiny_sharded / s) for s in shards}
    for k in single.names:
        t = by_shard[wm[k]]
        assert t.header[k]["dtype"] == single.header[k]["dtype"]
        assert t.header[k]["shape"] == single.header[k]["shape"]
        assert t.bytes_of(k) == single.bytes_of(k), k
    # HF's index metadata: total_size is the sum of the tensors' bytes.
    if "metadata" in index and "total_size" in index["metadata"]:
        assert index["metadata"]["total_size"] == sum(len(single.bytes_of(k)) for k in single.names)


def test_sharded_generates_like_single_file(tiny, tiny_sharded):
    a = run_json(tiny, PROMPT, "--ignore-eos", n=16)
    b = run_json(tiny_sharded, PROMPT, "--ignore-eos", n=16)
    assert a["output_ids"] == b["output_ids"]


def test_shards_are_deterministic(tiny_sharded, tmp_path):
    again = tmp_path / "again"
    make(again, "--shards", 3)
    assert files_of(again) == files_of(tiny_sharded)


def test_more_shards_than_tensors_makes_no_orphan_files(tmp_path):
    # Either refused, or every file written is a shard the index points to (as in a published checkpoint).
    d = tmp_path / "many"
    r = make(d, "--shards", 400, ok=None)
    if r.returncode != 0:
        assert_clean_failure(r)
        assert "--shards" in r.stderr, str(r)
        return
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    written = {p.name for p in d.glob("*.safetensors")}
    orphans = written - set(wm.values())
    assert not orphans, f"{len(orphans)} shard files hold no indexed tensor, e.g. {sorted(orphans)[:3]}"


def test_non_empty_dir_needs_force(tiny, tmp_path):
    d = tmp_path / "busy"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    r = make(d, ok=False)
    assert str(d) in r.stderr and "--force" in r.stderr, str(r)
    assert (d / "notes.txt").read_text() == "keep me"
    assert not (d / "model.safetensors").exists()
    make(d, "--force")
    assert (d / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_existing_model_dir_needs_force(tiny, tmp_path):
    d = tmp_path / "m"
    make(d)
    r = make(d, seed=9, ok=False)
    assert "--force" in r.stderr
    assert (d / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_output_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = make(f, ok=False)
    assert str(f) in r.stderr, str(r)


def test_unknown_preset_lists_presets(tmp_path):
    r = kdtree("make-model", "--preset", "gigantic", "-o", tmp_path / "x", ok=False)
    assert "gigantic" in r.stderr
    for p in ("tiny", "small", "medium", "k2"):
        assert p in r.stderr, f"preset {p} not listed\n{r}"
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_k2_preset_is_refused_for_writing(tmp_path):
    r = kdtree("make-model", "--preset", "k2", "-o", tmp_path / "k2", ok=False)
    assert "k2" in r.stderr and "inspect" in r.stderr, str(r)


def test_make_model_from_a_fixture_config(tmp_path):
    # --config follows a published config.json (here the K2-Thinking-style fixture's) and the result runs.
    d = tmp_path / "from-cfg"
    kdtree("make-model", "--config", FIXTURES / "k2-int4" / "config.json", "-o", d, "--seed", 1, ok=True)
    src = json.loads((FIXTURES / "k2-int4" / "config.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "moe_intermediate_size", "vocab_size"):
        assert cfg[k] == src[k], k
    out = run_json(d, PROMPT, "--ignore-eos", n=4)
    assert len(out["output_ids"]) == 4


# --- INT4 in compressed-tensors pack-quantized form ----------------------------------------------------

def test_unpacker_matches_compressed_tensors_bytes():
    # Proves the numpy unpacker below on compressed-tensors' own packing (int4_vectors, made by
    # compressed_tensors.pack_to_int32), so the make-model checks use the published convention.
    with safe_open(str(FIXTURES / "int4_vectors.safetensors"), "np") as v:
        for q_name, packed_name in (("q", "packed_ct"), ("q_g16", "packed_g16")):
            if q_name not in v.keys():
                continue
            q = v.get_tensor(q_name)
            assert q.min() == -8 and q.max() == 7
            assert np.array_equal(unpack_int4(v.get_tensor(packed_name), q.shape[1]), q), packed_name


def test_int4_expert_tensors_are_compressed_tensors_format(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    group = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    raw = RawSafetensors(tiny / "model.safetensors")
    with safe_open(str(tiny / "model.safetensors"), "np") as st:
        for proj, (N, K) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
            m = f"{EXPERT}.{proj}"
            assert f"{m}.weight" not in st.keys()
            packed = st.get_tensor(f"{m}.weight_packed")
            assert packed.dtype == np.int32 and packed.shape == (N, K // 8)
            sl = st.get_slice(f"{m}.weight_scale")
            assert sl.get_dtype() == "BF16" and sl.get_shape() == [N, K // group]
            shape = st.get_tensor(f"{m}.weight_shape")
            assert shape.dtype == np.int32 and shape.tolist() == [N, K]

            q = unpack_int4(packed, K).astype(np.int32)
            assert q.min() >= -8 and q.max() <= 7
            scale = raw.array(f"{m}.weight_scale")
            assert np.isfinite(scale).all() and (scale >= 0).all()
            # scale = bf16(absmax / 8) and q = clamp(round(w / scale), -8, 7): the largest weight of every
            # non-zero group lands on an end of the range. A wrong nibble offset or sign convention fails here.
            qg = q.reshape(N, K // group, group)
            live = scale > 0
            ends = (qg.max(axis=2) == 7) | (qg.min(axis=2) == -8)
            assert ends[live].all(), f"{m}: {int((~ends[live]).sum())} groups do not reach ±8/7"
            assert (qg[~live] == 0).all()
            assert len(np.unique(q)) > 8, f"{m}: values barely spread: {np.unique(q)}"


def test_int4_model_equals_its_dequantised_dense_copy(tiny, tmp_path):
    # Replace every INT4 module by a dense F32 `.weight` = (nibble − 8) · scale, computed in numpy with
    # the compressed-tensors convention, and drop quantization_config: the engine must produce the same
    # tokens and (near-)same logits from both, so its INT4 path reads make-model's files as published.
    cfg = json.loads((tiny / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    raw = RawSafetensors(tiny / "model.safetensors")
    modules = [n[: -len(".weight_packed")] for n in raw.names if n.endswith(".weight_packed")]
    assert modules
    tensors = {n: (raw.header[n]["dtype"], raw.header[n]["shape"], raw.bytes_of(n)) for n in raw.names
               if not n.endswith((".weight_packed", ".weight_scale", ".weight_shape"))}
    for m in modules:
        N, K = raw.array(f"{m}.weight_shape").tolist()
        q = unpack_int4(raw.array(f"{m}.weight_packed"), K).astype(np.float32)
        scale = raw.array(f"{m}.weight_scale")
        w = q * np.repeat(scale, group, axis=1)
        tensors[f"{m}.weight"] = ("F32", (N, K), w.astype("<f4").tobytes())
    dense = tmp_path / "dense"
    dense.mkdir()
    save_tensors(dense / "model.safetensors", tensors, metadata={"format": "pt"})
    cfg.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(cfg))

    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a = run_json(tiny, PROMPT, "--ignore-eos", "--dump-logits", fa, n=12)
    b = run_json(dense, PROMPT, "--ignore-eos", "--dump-logits", fb, n=12)
    assert a["output_ids"] == b["output_ids"]
    la, lb = load_file(str(fa))["logits"], load_file(str(fb))["logits"]
    assert np.abs(la - lb).max() / np.abs(lb).max() <= 1e-5
