"""`kdtree bench`: a llama-bench style table (STYLE.md: model, size, backend, test, t/s, GB/s, % of
roofline) and one JSON object with --json."""
import json

from conftest import FIXTURES, kdtree

MODEL = FIXTURES / "k2-int4"


def test_bench_table():
    r = kdtree("bench", "-m", MODEL, "-p", 8, "-n", 4, "-r", 1, ok=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for col in ("model", "size", "backend", "test", "t/s", "GB/s"):
        assert col in header, f"column {col!r} missing from {header}"
    assert any("%" in c for c in header), header
    rows = {row[header.index("test")]: row for row in
            ([c.strip() for c in l.strip("|").split("|")] for l in lines[2:])}
    assert set(rows) == {"pp8", "tg4"}, rows
    for row in rows.values():
        assert float(row[header.index("t/s")]) > 0
        assert row[header.index("backend")] == "cpu"


def test_bench_json():
    r = kdtree("bench", "-m", MODEL, "-p", 8, "-n", 4, "-r", 1, "--json", ok=True)
    out = json.loads(r.stdout)
    assert out["prefill"]["tokens"] == 8 and out["decode"]["tokens"] == 4
    assert out["prefill"]["tokens_per_s"] > 0 and out["decode"]["tokens_per_s"] > 0
    assert out["weights_bytes"] == (MODEL / "model.safetensors").stat().st_size - 8 - int.from_bytes(
        (MODEL / "model.safetensors").read_bytes()[:8], "little")
    assert 0 < out["decode"]["fraction_of_read_bandwidth"] <= 1.5


def test_bench_rejects_cuda_and_zero_tokens():
    r = kdtree("bench", "-m", MODEL, "--device", "cuda")
    assert 0 < r.returncode < 128 and "cuda" in r.stderr, r.stderr
    r = kdtree("bench", "-m", MODEL, "-n", 0)
    assert r.returncode == 2 and "--n-gen" in r.stderr, r.stderr


def test_bench_verify_sizes():
    # --verify-sizes picks the tree sizes of the verify curve, in the order given
    r = kdtree("bench", "-m", MODEL, "-p", 8, "-n", 2, "-r", 1, "--verify-curve", "--verify-sizes", "3,1", "--json", ok=True)
    out = json.loads(r.stdout)
    assert [p["nodes"] for p in out["verify_curve"]] == [3, 1], out["verify_curve"]
    # without --verify-curve on the CPU it would be ignored: an error that says what to add
    r = kdtree("bench", "-m", MODEL, "--verify-sizes", "4")
    assert 0 < r.returncode < 128 and "--verify-curve" in r.stderr, r.stderr
    r = kdtree("bench", "-m", MODEL, "--verify-curve", "--verify-sizes", "0")
    assert r.returncode == 2 and "--verify-sizes" in r.stderr, r.stderr
