"""`--tp R` (alias `--tensor-parallel`) on run and bench, CPU: R in-process ranks. Greedy output of the
HF fixtures under TP equals transformers' own greedy continuation (the goldens, an independent
reference) up to the first near-tie, DDTree over the TP target equals AR over it, and an R the
model cannot be split into is a clear error naming the dimension and the valid R."""
import pytest

from conftest import FIXTURES, golden, golden_greedy, golden_prompt, ids_arg, kdtree, run_json


@pytest.mark.parametrize("name,R", [("k2-bf16", 2), ("k2-bf16", 4), ("dsv3-group", 4), ("k25-sharded", 2)])
def test_tp_greedy_equals_transformers(name, R):
    got = run_json(FIXTURES / name, golden_prompt(name), "--tp", R, "--ignore-eos")["output_ids"]
    want = golden_greedy(name)
    margin = golden(name)["greedy_margin"]
    # TP adds o_proj's and down_proj's partial sums in another order than one rank: equal tokens are
    # owed only while transformers' top-2 margin is clear of rounding (1e-4 of the logits' scale here).
    scale = float(abs(golden(name)["greedy_logits"]).max())
    n = next((i for i, m in enumerate(margin) if m < 1e-4 * scale), len(want))
    assert got[:n] == want[:n]
    assert n >= len(want) // 2, f"the fixture's margins allow only {n} tokens of comparison"


@pytest.mark.parametrize("extra", [["--spec", "ddtree", "--draft", "synthetic:0.5,0.3", "--budget", "8"],
                                   ["--spec", "dflash", "--draft", "synthetic:0.7"]])
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_tp_speculative_equals_tp_ar(extra, temp):
    model = FIXTURES / "k2-bf16"
    base = ["--tensor-parallel", "2", "--ignore-eos", "--temp", temp, "--seed", "5"]
    ar = run_json(model, golden_prompt("k2-bf16"), *base, n=40)
    sp = run_json(model, golden_prompt("k2-bf16"), *base, *extra, n=40)
    assert sp["output_ids"] == ar["output_ids"]
    assert sp["spec"]["rounds"] > 0


@pytest.mark.parametrize("args,expect", [
    (["--tp", "3"], "num_attention_heads"),
    (["--tp", "0"], "--tp"),
    (["--tp", "2", "--devices", "0,1"], "--devices"),
    (["--tp", "x"], "--tp"),
])
def test_tp_misuse_is_a_clear_error(args, expect):
    r = kdtree("run", "-m", FIXTURES / "k2-bf16", "--prompt-ids", "1,2,3", "-n", "4", *args, ok=False)
    assert expect in r.stderr, r.stderr


def test_tp_refuses_int4_slices_that_break_groups():
    # k2-int4's routed experts are 96 wide: 48 columns a rank would split a 32-group of down_proj.
    r = kdtree("run", "-m", FIXTURES / "k2-int4", "--prompt-ids", "1,2,3", "-n", "4", "--tp", "2", ok=False)
    assert "group" in r.stderr, r.stderr


def test_bench_tp_reports_its_ranks():
    j = kdtree("bench", "-m", FIXTURES / "k2-bf16", "-p", "8", "-n", "4", "-r", "1", "--tp", "2", "--json", ok=True).json()
    assert j["tensor_parallel"] == 2
    assert j["decode"]["tokens"] == 4 and j["decode"]["tokens_per_s"] > 0


@pytest.mark.parametrize("R", [2, 4])
def test_bench_times_the_tp_target_from_a_checkpoint_with_the_reductions_share(R):
    # The decode steps and the verify curve run through the TP target: rank 0 spends time in the
    # communicator (2 reductions a layer + the argmax exchange) in every forward, a share of it.
    d = FIXTURES / "k2-bf16"
    j = kdtree("bench", "-m", d, "-p", "8", "-n", "4", "-r", "2", "--tp", R, "--verify-curve", "--verify-sizes", "1,4,16",
               "--json", ok=True).json()
    comm = j["tensor_parallel_comm"]
    assert comm["ranks"] == R and comm["reductions_per_step"] == 2 * 3  # 3 layers
    assert comm["decode_ms_per_token"] == pytest.approx(j["decode"]["ms"] / 4)
    assert 0 < comm["decode_comm_ms_per_token"] < comm["decode_ms_per_token"]
    assert comm["decode_comm_share"] == pytest.approx(comm["decode_comm_ms_per_token"] / comm["decode_ms_per_token"])
    assert [p["nodes"] for p in j["verify_curve"]] == [1, 4, 16]
    for p in j["verify_curve"]:
        assert 0 < p["comm_ms"] < p["ms"], p
    # One rank has no communicator: no share is reported.
    one = kdtree("bench", "-m", d, "-p", "8", "-n", "2", "-r", "1", "--verify-curve", "--verify-sizes", "1", "--json", ok=True).json()
    assert "tensor_parallel_comm" not in one and "comm_ms" not in one["verify_curve"][0]
    text = kdtree("bench", "-m", d, "-p", "8", "-n", "4", "-r", "1", "--tp", R, ok=True).stdout
    assert f"tensor parallel over {R} CPU ranks: 6 reductions a step; rank 0 spends" in text, text


def test_bench_serve_runs_the_engine_over_the_tp_target():
    # The engine's load test under --tp R: every level's requests are served by the engine over R CPU
    # ranks (what `serve --tp R` runs), and the output says which target it was; an R the model cannot
    # be split into is refused before loading, as in run.
    import json
    r = kdtree("bench", "-m", FIXTURES / "k2-bf16", "--serve", "1,2", "-p", 8, "-n", 4, "-r", 1, "--tp", 2, "--json", ok=True)
    out = json.loads(r.stdout[r.stdout.index("\n{") + 1:])
    assert out["device"] == "cpu, tensor parallel over 2 ranks"
    assert [(l["concurrency"], l["requests"]) for l in out["levels"]] == [(1, 8), (2, 8)]
    assert all(l["tokens_per_s"] > 0 and l["tpot_p50_ms"] > 0 for l in out["levels"])
    bad = kdtree("bench", "-m", FIXTURES / "k2-bf16", "--serve", "1", "-p", 8, "-n", 4, "--tp", 3, ok=False)
    assert "num_attention_heads" in bad.stderr, bad.stderr


def test_bench_draft_runs_the_trained_pair_over_the_tp_target():
    # The speculative bench over --tp 2 (the drafter from rank 0's taps): it fails by itself if any
    # configuration's output differs from AR's; and the tree accepts drafted tokens.
    import json
    pair = FIXTURES.parent.parent / "assets" / "pair"
    args = ["bench", "-m", pair / "target", "--draft", pair / "drafter", "--prompts", pair / "eval_prompts.json",
            "--prompt-limit", 1, "--budget", 8, "-n", 16, "-r", 1, "--json"]
    tp = json.loads(kdtree(*args, "--tp", 2, ok=True).stdout)
    one = json.loads(kdtree(*args, ok=True).stdout)
    assert tp["device"] == "cpu, tensor parallel over 2 ranks"
    assert tp["prompts"][0]["output_ids"] == one["prompts"][0]["output_ids"]
    run = tp["prompts"][0]["runs"][0]
    assert run["exact"] is True and run["tau"] > 1.0, run
