"""python/train_pair.py's checkpoint writer (make_fixtures.write_checkpoint_max): shards of at most a
given size and model.safetensors.index.json, the published K2 layout. Needs torch (the training
tooling's); without it this file is skipped — run it with the training venv, e.g.
  /work/venv-torch/bin/python -m pytest -q tests/cli/test_shard_writer.py
Checked: on the committed pair's target it writes exactly the committed split (same files, same
tensors, every file ≤ 6 MB) and kdtree decodes the rewritten checkpoint to the same tokens; on a
small random model every shard respects a tight limit, the tensors read back bit for bit, a tensor
larger than the limit is refused, and a stale single-file model.safetensors is removed."""
import json
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import REPO, kdtree  # noqa: E402

sys.path.insert(0, str(REPO / "python"))
mf = pytest.importorskip("make_fixtures")  # (imports transformers too)

PAIR_TARGET = REPO / "assets" / "pair" / "target"
LIMIT = 6_000_000


def test_writer_reproduces_the_committed_split(tmp_path):
    ck = mf.read_checkpoint(str(PAIR_TARGET))
    out = tmp_path / "target"
    out.mkdir()
    files = mf.write_checkpoint_max(str(out), ck, LIMIT)
    committed = json.loads((PAIR_TARGET / "model.safetensors.index.json").read_text())
    written = json.loads((out / "model.safetensors.index.json").read_text())
    assert written == committed
    assert sorted(files[:-1]) == sorted(set(committed["weight_map"].values()))
    for fn in files[:-1]:
        assert (out / fn).stat().st_size <= LIMIT, fn
    back = mf.read_checkpoint(str(out))
    assert set(back) == set(ck)
    for k, v in ck.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # kdtree decodes the rewritten checkpoint as it decodes the committed one.
    for f in PAIR_TARGET.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    prompt = json.loads((REPO / "assets" / "pair" / "eval_prompts.json").read_text())[0]["ids"]
    ids = ",".join(map(str, prompt))
    a = kdtree("run", "-m", PAIR_TARGET, "--prompt-ids", ids, "-n", 16, "--json", ok=True).json()
    b = kdtree("run", "-m", out, "--prompt-ids", ids, "-n", 16, "--json", ok=True).json()
    assert a["output_ids"] == b["output_ids"]


def test_writer_limits_on_a_small_model(tmp_path):
    g = torch.Generator().manual_seed(3)
    ck = {f"model.layers.{i}.w": torch.randn(40, 32, generator=g).to(torch.bfloat16) for i in range(6)}
    ck["model.norm.weight"] = torch.randn(32, generator=g)
    ck["model.layers.0.shape"] = torch.tensor([40, 32], dtype=torch.int32)
    ck["model.layers.0.packed"] = torch.randint(0, 2**31 - 1, (40, 4), generator=g, dtype=torch.int32)
    (tmp_path / "model.safetensors").write_bytes(b"stale")
    limit = 6000  # about two of the 2560-byte bf16 matrices a shard
    files = mf.write_checkpoint_max(str(tmp_path), ck, limit)
    assert not (tmp_path / "model.safetensors").exists()
    shards = files[:-1]
    assert len(shards) >= 4 and files[-1] == "model.safetensors.index.json"
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fn in shards:
        assert (tmp_path / fn).stat().st_size <= limit, fn
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ck)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ck.values())
    order = [index["weight_map"][k] for k in sorted(ck)]
    assert order == sorted(order), "tensors are laid out in name order"
    back = mf.read_checkpoint(str(tmp_path))
    for k, v in ck.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="do not fit"):
        mf.write_checkpoint_max(str(tmp_path / "x"), {"big": torch.zeros(4000, dtype=torch.float32)}, limit)
