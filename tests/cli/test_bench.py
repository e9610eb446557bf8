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


def test_bench_serve_on_the_cpu_with_the_chunked_prefill_test():
    # The engine's load test on the CPU (-m DIR) and, last, one long prompt arriving among decoding
    # streams at three prefill chunks. What must hold whatever the timings: the levels' request
    # counts, the long prompt prefilled in ceil(P / K) steps (a step holds one chunk of it), so the
    # streams saw at least that many token gaps while it prefilled — one step, one gap each, at the
    # whole-prompt chunk.
    P, S = 300, 3
    r = kdtree("bench", "-m", MODEL, "--serve", "1,2", "-p", 16, "-n", 8, "-r", 1, "--long-prompt", P,
               "--prefill-chunks", "16,64,1000", "--streams", S, "--json", ok=True)
    out = json.loads(r.stdout[r.stdout.index("\n{") + 1:])
    assert out["device"] == "cpu"
    assert [(l["concurrency"], l["requests"]) for l in out["levels"]] == [(1, 8), (2, 8)]
    assert all(l["tokens_per_s"] > 0 and l["tpot_p50_ms"] > 0 for l in out["levels"])
    lp = out["long_prompt"]
    assert lp["tokens"] == P and lp["streams"] == S
    runs = {x["prefill_chunk"]: x for x in lp["runs"]}
    assert sorted(runs) == [16, 64, P], runs  # a chunk above P is the whole prompt
    for k, x in runs.items():
        steps = -(-P // k)
        assert x["ttft_ms"] > 0 and x["tpot_before_p50_ms"] > 0, x
        assert steps <= x["steps_during"] <= steps + 2, (k, x)
        assert x["gaps_during"] >= S * (steps - 1), (k, x)
        assert x["tpot_during_p50_ms"] <= x["tpot_during_p99_ms"] <= x["tpot_during_max_ms"] + 1e-9, x
    assert runs[P]["gaps_during"] <= 2 * S, runs[P]
    assert "| prefill chunk | long prompt TTFT ms |" in r.stdout


def test_bench_serve_flags_are_checked():
    for args, expect in [(["--long-prompt", "64"], "add --serve"),
                         (["--serve", "1", "--prefill-chunks", "16"], "add --long-prompt"),
                         (["--serve", "1", "--verify-curve"], "no verify curve"),
                         (["--serve", "1", "--long-prompt", "300000"], "holds")]:
        r = kdtree("bench", "-m", MODEL, "-p", 8, "-n", 4, *args)
        assert r.returncode != 0 and expect in r.stderr, (args, r.stderr)


def test_bench_preset_layers_needs_the_preset_and_a_depth_k2_has():
    r = kdtree("bench", "-m", MODEL, "--preset-layers", 6)
    assert r.returncode != 0 and "add --preset k2-slice" in r.stderr, r.stderr
    r = kdtree("bench", "--device", "cuda", "--preset", "k2-slice", "--preset-layers", 62)
    assert r.returncode != 0 and "--preset-layers" in r.stderr, r.stderr
