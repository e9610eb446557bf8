"""kdtree run --json per-round speculative statistics (issue 16 §2 observability).

spec.round_tau (always, with --spec): each round's τ, the tokens it committed — its accepted drafted
tokens plus the target's own next one, fewer only when a stop id or the length limit ends the round
inside the tree. The prefill commits the first token, so Σ round_tau = tokens generated − 1 (the
same count as dflash_generate's acceptance_lengths). --json-rounds full adds spec.round_trees: per
round the start position, the draft tree (tokens root first, parents, depths) and the accepted path,
which must replay the output: path tokens after the root are the next generated tokens."""
import json

import pytest

from conftest import FIXTURES, copy_fixture, golden, kdtree

TARGET = FIXTURES / "k2-int4"
PROMPT = ",".join(map(str, golden("k2-int4")["prompt_ids"]))


def run_json(model, *args):
    r = kdtree("run", "-m", str(model), "--prompt-ids", PROMPT, *args, "--json", "-q")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    d = tmp_path_factory.mktemp("rounds") / "drafter"
    r = kdtree("make-model", "--drafter-for", str(TARGET), "-o", str(d), "--seed", "4")
    assert r.returncode == 0, r.stderr
    return d


def check_rounds(j, n_prompt, full):
    s, out = j["spec"], j["output_ids"]
    tau = s["round_tau"]
    assert len(tau) == s["rounds"]
    assert sum(tau) == len(out) - 1 if out else tau == []
    assert all(t >= 1 for t in tau)
    assert s["accepted"] == sum(t - 1 for t in tau)
    assert s["tau_histogram"] == [tau.count(i) for i in range(len(s["tau_histogram"]))]
    if not full:
        assert "round_trees" not in s
        return
    trees = s["round_trees"]
    assert len(trees) == len(tau)
    pos = n_prompt  # the position of the first generated token (the first round's root)
    for r, t in zip(trees, tau):
        n = len(r["tokens"])
        assert len(r["parents"]) == len(r["depths"]) == n and r["parents"][0] == -1 and r["depths"][0] == 0
        for i in range(1, n):
            assert 0 <= r["parents"][i] < i and r["depths"][i] == r["depths"][r["parents"][i]] + 1
        if s["mode"] == "dflash":
            assert r["parents"] == list(range(-1, n - 1))  # the top-1 chain
        assert r["start"] == pos and r["tokens"][0] == out[pos - n_prompt]
        path = r["path"]
        assert r["tau"] == t and len(path) == t and path[0] == 0
        for a, b in zip(path, path[1:]):
            assert r["parents"][b] == a
        # The accepted nodes' tokens are the next committed tokens.
        assert [r["tokens"][i] for i in path[1:]] == out[pos - n_prompt + 1:pos - n_prompt + t]
        pos += t
    assert pos - n_prompt == len(out) - 1


@pytest.mark.parametrize("spec,extra", [("ddtree", ["--budget", "6"]), ("dflash", [])])
@pytest.mark.parametrize("draft", ["synthetic:0.6,0.2", "synthetic:oracle", "dflash"])
@pytest.mark.parametrize("full", [False, True])
def test_round_tau_sums_to_the_generated_tokens(spec, extra, draft, full, drafter):
    d = str(drafter) if draft == "dflash" else draft
    ar = run_json(TARGET, "-n", "40", "--ignore-eos")
    j = run_json(TARGET, "-n", "40", "--ignore-eos", "--spec", spec, "--draft", d, *extra,
                 *(["--json-rounds", "full"] if full else []))
    assert j["output_ids"] == ar["output_ids"]
    check_rounds(j, len(j["prompt_ids"]), full)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_length_limit_inside_a_round(n):
    # Oracle chain, block 8: the last round is cut by -n, and the invariant still holds.
    j = run_json(TARGET, "-n", str(n), "--ignore-eos", "--spec", "dflash", "--draft", "synthetic:oracle",
                 "--json-rounds", "full")
    assert len(j["output_ids"]) == n
    check_rounds(j, len(j["prompt_ids"]), True)


def test_stop_id_inside_a_round(tmp_path):
    d = copy_fixture("k2-int4", tmp_path / "m")
    greedy = [int(x) for x in golden("k2-int4")["greedy_ids"]]
    stop = greedy[10]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop], "do_sample": False}))
    j = run_json(d, "-n", "48", "--spec", "dflash", "--draft", "synthetic:oracle", "--json-rounds", "full")
    assert j["finish_reason"] == "stop" and j["output_ids"] == greedy[:greedy.index(stop) + 1]
    check_rounds(j, len(j["prompt_ids"]), True)


@pytest.mark.parametrize("args", [
    ["--json-rounds", "full", "--json"],  # no --spec
    ["--json-rounds", "full", "--spec", "dflash", "--draft", "synthetic:oracle"],  # no --json
])
def test_json_rounds_full_needs_json_and_spec(args):
    r = kdtree("run", "-m", str(TARGET), "--prompt-ids", "1,2", "-n", "2", *args)
    assert 0 < r.returncode < 128 and "--json-rounds full needs --json and --spec" in r.stderr, r.stderr


def test_json_rounds_is_documented_in_help():
    r = kdtree("run", "--help")
    assert r.returncode == 0 and "--json-rounds" in r.stdout and "round_trees" in r.stdout
