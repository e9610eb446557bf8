"""`kdtree run --json`: the DESIGN.md §5 contract (one JSON object on stdout, logs on stderr) and HF
parity through the CLI: greedy output_ids equal transformers' greedy continuation on every fixture."""
import pytest

from conftest import (FIXTURES, MODEL_FIXTURES, N_GOLDEN, copy_fixture, edit_json, golden_greedy,
                      golden_prompt, ids_arg, kdtree, run_json)

TIMING_KEYS = {"load_ms", "prefill_ms", "decode_ms", "n_prompt", "n_decoded", "prefill_tokens_per_s",
               "decode_tokens_per_s"}
SPEC_KEYS = {"mode", "rounds", "mean_accepted_length", "budget"}


def _check_contract(out: dict, prompt: list[int], n_out: int) -> None:
    for key in ("prompt_ids", "output_ids", "text", "finish_reason", "timings", "spec"):
        assert key in out, f"missing key {key!r} in {sorted(out)}"
    assert out["prompt_ids"] == prompt
    assert isinstance(out["output_ids"], list) and all(isinstance(i, int) for i in out["output_ids"])
    assert len(out["output_ids"]) == n_out
    assert out["text"] is None or isinstance(out["text"], str)
    t = out["timings"]
    assert TIMING_KEYS <= set(t), f"timings lacks {TIMING_KEYS - set(t)}"
    assert t["n_prompt"] == len(prompt)
    assert t["n_decoded"] == n_out
    for k in ("load_ms", "prefill_ms", "decode_ms", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert isinstance(t[k], (int, float)) and t[k] >= 0, (k, t[k])
    if n_out > 0:
        assert t["prefill_ms"] > 0 and t["prefill_tokens_per_s"] > 0
    s = out["spec"]
    assert SPEC_KEYS <= set(s), f"spec lacks {SPEC_KEYS - set(s)}"
    assert s["mode"] == "ar"
    assert s["budget"] is None
    assert s["rounds"] == n_out  # AR: one token per round
    assert s["mean_accepted_length"] == pytest.approx(1.0)
    if n_out > 0 and "target_forwards" in s:
        assert s["target_forwards"] == n_out  # the prefill yields token 1, each decode step one more


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_greedy_json_matches_hf_golden(fixture):
    prompt = golden_prompt(fixture)
    r = kdtree("run", "-m", FIXTURES / fixture, "--prompt-ids", ids_arg(prompt), "-n", N_GOLDEN,
               "--ignore-eos", "--json", ok=True)
    out = r.json()  # the whole of stdout is one JSON object
    assert r.stdout.count("\n") == 1 and r.stdout.endswith("\n"), "stdout must hold the JSON object alone"
    _check_contract(out, prompt, N_GOLDEN)
    assert out["output_ids"] == golden_greedy(fixture)
    assert out["finish_reason"] == "length"
    # Logs (the load line, the timing summary) go to stderr, never stdout.
    assert "load time" in r.stderr and "eval time" in r.stderr


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_expanded_decode_attention_gives_same_ids(fixture):
    out = run_json(FIXTURES / fixture, golden_prompt(fixture), "--ignore-eos", "--decode-attn", "expanded")
    assert out["output_ids"] == golden_greedy(fixture)


def test_json_quiet_stdout_unchanged_and_stderr_silent():
    prompt = golden_prompt("k2-int4")
    r = kdtree("-q", "run", "-m", FIXTURES / "k2-int4", "--prompt-ids", ids_arg(prompt), "-n", 8,
               "--ignore-eos", "--json", ok=True)
    assert r.json()["output_ids"] == golden_greedy("k2-int4")[:8]
    assert r.stderr.strip() == ""


def test_plain_output_streams_ids_on_stdout():
    prompt = golden_prompt("k2-int4")
    r = kdtree("run", "-m", FIXTURES / "k2-int4", "--prompt-ids", ids_arg(prompt), "-n", 8, "--ignore-eos",
               ok=True)
    assert [int(x) for x in r.stdout.split()] == golden_greedy("k2-int4")[:8]


def test_thread_count_does_not_change_output():
    prompt = golden_prompt("k2-bf16")
    one = kdtree("-t", "1", "run", "-m", FIXTURES / "k2-bf16", "--prompt-ids", ids_arg(prompt), "-n", 16,
                 "--ignore-eos", "--json", ok=True).json()
    two = kdtree("-t", "2", "run", "-m", FIXTURES / "k2-bf16", "--prompt-ids", ids_arg(prompt), "-n", 16,
                 "--ignore-eos", "--json", ok=True).json()
    assert one["output_ids"] == two["output_ids"] == golden_greedy("k2-bf16")[:16]


def test_n_zero_generates_nothing():
    prompt = golden_prompt("k2-int4")
    out = run_json(FIXTURES / "k2-int4", prompt, n=0)
    _check_contract(out, prompt, 0)
    assert out["output_ids"] == []
    assert out["finish_reason"] == "length"
    assert out["timings"]["decode_ms"] == 0


def test_n_zero_forward_count_is_consistent():
    # spec.target_forwards must count the forwards that ran: with -n 0 either the prefill runs (and is
    # timed) and the count is 1, or nothing runs and the count is 0.
    out = run_json(FIXTURES / "k2-int4", golden_prompt("k2-int4"), n=0)
    prefill_ran = out["timings"]["prefill_ms"] > 0
    assert out["spec"]["target_forwards"] == (1 if prefill_ran else 0), (out["timings"], out["spec"])


def test_context_limit_caps_generation_with_length():
    # -c bounds prompt + generated tokens; generation stops at the context with finish "length".
    prompt = golden_prompt("k2-int4")
    out = run_json(FIXTURES / "k2-int4", prompt, "--ignore-eos", "-c", len(prompt) + 5, n=40)
    assert out["output_ids"] == golden_greedy("k2-int4")[:5]
    assert out["finish_reason"] == "length"


# --- EOS --------------------------------------------------------------------------------------

def _eos_candidate(fixture: str) -> tuple[int, int]:
    """(index, token) of a token whose first appearance in the golden continuation is well inside it."""
    greedy = golden_greedy(fixture)
    for i in range(5, len(greedy) - 5):
        if greedy[i] not in greedy[:i]:
            return i, greedy[i]
    raise AssertionError("no usable EOS candidate")


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    fixture = "k2-int4"
    i, tok = _eos_candidate(fixture)
    d = copy_fixture(fixture, tmp_path_factory.mktemp("eos"))
    edit_json(d / "config.json", lambda c: c.update(eos_token_id=tok))
    return fixture, d, i, tok


def test_eos_stops_after_the_stop_token(eos_model):
    fixture, d, i, tok = eos_model
    out = run_json(d, golden_prompt(fixture))
    assert out["finish_reason"] == "stop"
    assert out["output_ids"] == golden_greedy(fixture)[:i + 1]
    assert out["output_ids"][-1] == tok
    assert out["timings"]["n_decoded"] == i + 1


def test_eos_list_form_stops_too(tmp_path):
    fixture = "k25-sharded"
    i, tok = _eos_candidate(fixture)
    d = copy_fixture(fixture, tmp_path)
    # K2.5 keeps the text model's fields in text_config; eos_token_id may be a list there.
    edit_json(d / "config.json", lambda c: c["text_config"].update(eos_token_id=[0, tok]))
    greedy = golden_greedy(fixture)
    stop_at = min(j for j, t in enumerate(greedy) if t in (0, tok))
    out = run_json(d, golden_prompt(fixture))
    assert out["finish_reason"] == "stop"
    assert out["output_ids"] == greedy[:stop_at + 1]


def test_ignore_eos_runs_to_n(eos_model):
    fixture, d, i, tok = eos_model
    out = run_json(d, golden_prompt(fixture), "--ignore-eos")
    assert out["finish_reason"] == "length"
    assert out["output_ids"] == golden_greedy(fixture)
    assert tok in out["output_ids"]


def test_eos_at_n_boundary_is_stop(eos_model):
    # The stop token is also the n-th token: EOS wins, so the reason is "stop".
    fixture, d, i, tok = eos_model
    out = run_json(d, golden_prompt(fixture), n=i + 1)
    assert out["output_ids"][-1] == tok
    assert out["finish_reason"] == "stop"

