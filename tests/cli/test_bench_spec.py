"""`kdtree bench --draft`: AR against speculative decoding on real prompts, one process (the trained pair
of assets/pair). Checked here: every configuration reproduces AR's tokens (the bench refuses to report
otherwise), the trained drafter's τ is far above a random drafter's, the rates are medians of the
repetitions it reports, the repetition-loop flag agrees with a detector written here, and the flags
that do not fit are refused with messages that name them."""
import json

import jsonschema

from conftest import REPO, kdtree, run_json

PAIR = REPO / "assets" / "pair"
TARGET, DRAFTER = PAIR / "target", PAIR / "drafter"
PROMPTS_FILE = PAIR / "eval_prompts.json"
PROMPTS = json.loads(PROMPTS_FILE.read_text())
SCHEMA = REPO / "bench" / "schemas" / "tool_call.json"


def has_loop(ids, n=8, count=3):
    """An n-gram of n tokens seen `count` times or more (occurrences may overlap)."""
    seen = {}
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i:i + n])
        seen[g] = seen.get(g, 0) + 1
        if seen[g] >= count:
            return True
    return False


def median(xs):
    xs = sorted(xs)
    k = len(xs)
    return xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2])


def test_bench_spec_json():
    r = kdtree("bench", "-m", TARGET, "--draft", DRAFTER, "--prompts", PROMPTS_FILE, "--prompt-limit", 2,
               "--budget", "8,auto", "-n", 48, "-r", 3, "--json", ok=True)
    out = json.loads(r.stdout)
    assert out["spec"] == "ddtree" and out["n_gen"] == 48 and out["repetitions"] == 3
    assert out["loop_rule"] == {"ngram": 8, "count": 3}
    assert [p["index"] for p in out["prompts"]] == [0, 1]
    for p in out["prompts"]:
        # AR's tokens, as `kdtree run` decodes them (EOS ignored, as the bench does).
        ar = run_json(TARGET, PROMPTS[p["index"]]["ids"], "--ignore-eos", n=48)["output_ids"]
        assert p["output_ids"] == ar
        assert p["loop"] == has_loop(ar)
        assert len(p["ar_tokens_per_s_runs"]) == 3 and p["ar_tokens_per_s"] == median(p["ar_tokens_per_s_runs"])
        runs = {x["config"]: x for x in p["runs"]}
        assert set(runs) == {"8", "auto"}
        for x in runs.values():
            assert x["exact"] is True
            assert len(x["tokens_per_s_runs"]) == 3 and x["tokens_per_s"] == median(x["tokens_per_s_runs"])
            assert abs(x["speedup"] - x["tokens_per_s"] / p["ar_tokens_per_s"]) < 1e-9
        # The trained drafter at a fixed budget of 8: τ well above a random drafter's ≈ 1 (the τ guard's
        # floors at budget 16 are 5.0 on these prompts at 128 tokens).
        assert runs["8"]["budget"] == 8 and runs["8"]["tau"] >= 2.5, runs["8"]
        assert runs["auto"]["budget"] == "auto"
        a = runs["auto"]
        assert 0 <= a["ar_steps"] <= a["rounds"] < 48  # medians over the repetitions
        # The start-up ceiling (a drafter always right, × AR): where every repetition found it below
        # the gate (1.5×), none drafted a round — every round an AR step.
        assert len(a["ceiling_x_ar_runs"]) == 3 and all(c > 0 for c in a["ceiling_x_ar_runs"]), a
        if max(a["ceiling_x_ar_runs"]) < 1.5:
            assert a["ar_steps"] == a["rounds"], a
    assert {s["config"] for s in out["summary"]} == {"8", "auto"}
    for s in out["summary"]:
        assert s["prompts"] + s["loop_prompts"] == 2


def test_bench_spec_chain_and_sampling_table():
    r = kdtree("bench", "-m", TARGET, "--draft", DRAFTER, "--spec", "dflash", "--budget", "chain,auto", "--prompt-ids",
               ",".join(map(str, PROMPTS[3]["ids"])), "-n", 32, "-r", 1, "--temp", "0.8", "-s", "5", ok=True)
    assert "T = 0.8" in r.stdout and "chain auto" in r.stdout and "chain     " in r.stdout, r.stdout
    assert "median over" in r.stdout, r.stdout


def test_bench_spec_under_a_json_schema():
    """Under a JSON Schema (through the engine, as serve runs a constrained request): each output is AR's under
    the grammar for the masked and the unmasked draft tree (the bench fails otherwise), valid for the schema by
    `jsonschema` (the independent validator); the masked tree spends fewer nodes a round than the budget and
    never loses τ to the unmasked one on these prompts."""
    r = kdtree("bench", "-m", TARGET, "--draft", DRAFTER, "--prompts", PROMPTS_FILE, "--prompt-limit", 3,
               "--budget", "16", "-n", 96, "-r", 1, "--json-schema", SCHEMA, "--json", ok=True)
    out = json.loads(r.stdout)
    schema = json.loads(SCHEMA.read_text())
    assert out["constraint"] == {"json_schema": str(SCHEMA)} and len(out["prompts"]) == 3
    for p in out["prompts"]:
        assert p["finish_reason"] == "stop", p
        jsonschema.validate(json.loads(p["text"]), schema)
        (run,) = p["runs"]
        m, u = run["masked"], run["unmasked"]  # (both reproduced AR's tokens: the bench fails otherwise)
        assert u["drafted_per_round"] == 16 and 0 < m["drafted_per_round"] < 16, run
        assert m["tau"] >= u["tau"] >= 1, run
    t = kdtree("bench", "-m", TARGET, "--draft", DRAFTER, "--prompts", PROMPTS_FILE, "--prompt-limit", 1,
               "--budget", "8", "-n", 96, "-r", 1, "--json-schema", SCHEMA, ok=True)
    assert "masked draft" in t.stdout and "outputs == AR" in t.stdout, t.stdout


def test_bench_spec_refuses_what_does_not_fit():
    base = ["bench", "-m", TARGET, "--draft", DRAFTER]
    ids = ",".join(map(str, PROMPTS[0]["ids"]))
    cases = [
        (base + ["--budget", "foo", "--prompt-ids", ids], "--budget 'foo'"),
        (base + ["--budget", "16", "--budget-max", "32", "--prompt-ids", ids], "--budget-max"),
        (base + ["--spec", "dflash", "--budget", "16", "--prompt-ids", ids], "--budget"),
        (base + ["--spec", "chainz", "--prompt-ids", ids], "--spec chainz"),
        (base + ["--budget", "chain", "--prompt-ids", ids], "--budget chain"),
        (base, "--prompt-ids"),
        (base + ["--prompts", REPO / "no-such-prompts.json"], "cannot open"),
        (["bench", "-m", TARGET, "--budget", "16"], "add --draft"),
        (["bench", "-m", TARGET, "--temp", "0.8"], "add --draft"),
        (["bench", "-m", TARGET, "--json-schema", SCHEMA], "add --draft"),
        (base + ["--prompt-ids", ids, "--json-schema", SCHEMA, "--gbnf", SCHEMA], "give one constraint"),
        (base + ["--prompt-ids", ids, "--json-schema", REPO / "no-such-schema.json"], "cannot open"),
        (base + ["--prompt-ids", ids, "--json-schema", PROMPTS_FILE], "--json-schema"),  # not a schema object
        (base + ["--prompt-ids", ids, "--gbnf", SCHEMA], "--gbnf"),  # JSON is not GBNF
        (base + ["--prompt-ids", ids, "--spec", "dflash", "--budget", "chain", "--json-schema", SCHEMA], "--spec ddtree"),
    ]
    for args, want in cases:
        r = kdtree(*args)
        assert 0 < r.returncode < 128 and want in r.stderr, (args, r.stderr)
