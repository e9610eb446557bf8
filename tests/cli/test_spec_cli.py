"""kdtree run --spec ddtree|dflash through the CLI: the same tokens as --spec ar, the round
statistics in --json, and clear errors for misuse and for drafters that do not fit the target."""
import json
import pytest

from conftest import FIXTURES, golden, kdtree

TARGET = FIXTURES / "k2-int4"


def run_json(*args):
    r = kdtree("run", "-m", str(TARGET), *args, "--json", "-q")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("spec,extra", [
    ("ddtree", ["--budget", "1"]), ("ddtree", ["--budget", "16"]), ("ddtree", ["--budget", "64"]), ("dflash", []),
])
@pytest.mark.parametrize("draft", ["synthetic:oracle", "synthetic:0.5,0.3"])
def test_speculative_output_equals_ar(spec, extra, draft):
    prompt = ",".join(map(str, golden("k2-int4")["prompt_ids"]))
    ar = run_json("--prompt-ids", prompt, "-n", "48", "--ignore-eos")
    sp = run_json("--prompt-ids", prompt, "-n", "48", "--ignore-eos", "--spec", spec, "--draft", draft, *extra)
    assert sp["output_ids"] == ar["output_ids"] == [int(x) for x in golden("k2-int4")["greedy_ids"]]
    s = sp["spec"]
    assert s["mode"] == spec and "synthetic" in s["drafter"]
    assert s["target_forwards"] == s["rounds"] + 1
    assert sum(s["tau_histogram"]) == s["rounds"]
    assert 1 + s["accepted"] + s["rounds"] >= 48
    assert s["mean_accepted_length"] == pytest.approx((s["accepted"] + s["rounds"]) / s["rounds"])
    if draft == "synthetic:oracle" and spec == "dflash":
        assert s["mean_accepted_length"] > 6  # block 8: nearly every round takes the whole chain


def test_sampled_ddtree_with_a_dflash_drafter_equals_ar(tmp_path):
    draft = tmp_path / "drafter"
    r = kdtree("make-model", "--drafter-for", str(TARGET), "-o", str(draft), "--seed", "4")
    assert r.returncode == 0, r.stderr
    base = ["--prompt-ids", "5,6,7,8", "-n", "40", "--ignore-eos", "--temp", "0.8", "--seed", "11"]
    ar = run_json(*base)
    sp = run_json(*base, "--spec", "ddtree", "--draft", str(draft), "--budget", "6")
    assert sp["output_ids"] == ar["output_ids"]
    assert sp["spec"]["drafter"].startswith("DFlash")


@pytest.mark.parametrize("args,expect", [
    (["--spec", "ddtree"], "--draft"),
    (["--spec", "ar", "--draft", "synthetic:oracle"], "--draft only applies"),
    (["--budget", "4"], "--budget only applies"),
    (["--spec", "ddtree", "--draft", "synthetic:1.5"], "not a probability"),
    (["--spec", "ddtree", "--draft", "synthetic:0.7,0.7"], "sum to at most 1"),
    (["--spec", "ddtree", "--draft", "/nonexistent/drafter"], "/nonexistent/drafter"),
    (["--spec", "beam"], "spec"),
])
def test_speculative_misuse_is_a_clear_error(args, expect):
    r = kdtree("run", "-m", str(TARGET), "--prompt-ids", "1,2,3", "-n", "4", *args)
    assert 0 < r.returncode < 128
    assert expect in r.stderr, r.stderr


def _edit_drafter(tmp_path, edit):
    draft = tmp_path / "drafter"
    assert kdtree("make-model", "--drafter-for", str(TARGET), "-o", str(draft)).returncode == 0
    cfg = json.loads((draft / "config.json").read_text())
    edit(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))
    return draft


@pytest.mark.parametrize("edit,expect", [
    (lambda c: c.update(hidden_size=c["hidden_size"] * 2), "hidden"),
    (lambda c: c.update(vocab_size=c["vocab_size"] + 1), "vocab"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 99]), "99"),
    (lambda c: c.update(block_size=1), "block_size"),
])
def test_drafter_that_does_not_fit_the_target_is_refused(tmp_path, edit, expect):
    draft = _edit_drafter(tmp_path, edit)
    r = kdtree("run", "-m", str(TARGET), "--prompt-ids", "1,2,3", "-n", "4", "--spec", "ddtree", "--draft", str(draft))
    assert 0 < r.returncode < 128
    assert expect in r.stderr and "config.json" in r.stderr, r.stderr


def test_generation_config_eos_ids_stop_generation_too(tmp_path):
    """generation_config.json's eos_token_id (K2-Thinking: <|im_end|>) stops AR and DDTree alike."""
    from conftest import copy_fixture
    d = copy_fixture("k2-int4", tmp_path / "m")
    greedy = [int(x) for x in golden("k2-int4")["greedy_ids"]]
    stop = greedy[10]
    first = greedy.index(stop)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop], "do_sample": False}))
    prompt = ",".join(map(str, golden("k2-int4")["prompt_ids"]))
    for extra in ([], ["--spec", "ddtree", "--draft", "synthetic:0.8", "--budget", "4"]):
        r = kdtree("run", "-m", str(d), "--prompt-ids", prompt, "-n", "48", "--json", "-q", *extra)
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert j["finish_reason"] == "stop" and j["output_ids"] == greedy[:first + 1]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 99999}))
    r = kdtree("run", "-m", str(d), "--prompt-ids", prompt, "-n", "4")
    assert 0 < r.returncode < 128 and "generation_config.json" in r.stderr
