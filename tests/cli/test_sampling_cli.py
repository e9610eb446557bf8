"""Sampling through the CLI: reproducible per seed (position-keyed Philox), top-k 1 is greedy, and
out-of-range parameters are rejected with a message naming the parameter."""
import pytest

from conftest import FIXTURES, assert_clean_failure, golden_greedy, golden_prompt, kdtree

FIXTURE = "k2-int4"
N = 32


def _sample(*flags, n=N, threads=None):
    extra = ["-t", threads] if threads else []
    r = kdtree(*extra, "run", "-m", FIXTURES / FIXTURE, "--prompt-ids", ",".join(map(str, golden_prompt(FIXTURE))),
               "-n", n, "--ignore-eos", "--json", *flags, ok=True)
    return r.json()


def test_same_seed_same_ids():
    a = _sample("--temp", "0.8", "--seed", "1")
    b = _sample("--temp", "0.8", "--seed", "1")
    assert len(a["output_ids"]) == N
    assert a["output_ids"] == b["output_ids"]
    assert a["sampling"]["seed"] == 1 and a["sampling"]["temperature"] == pytest.approx(0.8)


def test_different_seed_different_ids():
    a = _sample("--temp", "0.8", "--seed", "1")
    b = _sample("--temp", "0.8", "--seed", "2")
    assert a["output_ids"] != b["output_ids"]


def test_sampling_is_not_greedy_at_high_temperature():
    a = _sample("--temp", "1.5", "--seed", "7")
    assert a["output_ids"] != golden_greedy(FIXTURE)[:N]


def test_seed_result_does_not_depend_on_threads():
    a = _sample("--temp", "0.8", "--seed", "5", threads=1)
    b = _sample("--temp", "0.8", "--seed", "5", threads=2)
    assert a["output_ids"] == b["output_ids"]


def test_prefix_is_stable_when_n_grows():
    # The token at position p uses Philox(seed, p): a shorter run is a prefix of a longer one.
    short = _sample("--temp", "0.9", "--seed", "11", n=10)
    long = _sample("--temp", "0.9", "--seed", "11", n=N)
    assert long["output_ids"][:10] == short["output_ids"]


@pytest.mark.parametrize("temp", ["0.5", "1.0", "5.0"])
def test_top_k_one_is_greedy(temp):
    a = _sample("--temp", temp, "--top-k", "1", "--seed", "3")
    assert a["output_ids"] == golden_greedy(FIXTURE)[:N]


def test_tiny_top_p_is_greedy():
    # The nucleus of a distribution with top_p → 0 is just the most likely token.
    a = _sample("--temp", "1.0", "--top-p", "1e-6", "--seed", "4")
    assert a["output_ids"] == golden_greedy(FIXTURE)[:N]


def test_min_p_one_is_greedy():
    # min-p 1 keeps only tokens as likely as the top one (the greedy margins here are > 0.05).
    a = _sample("--temp", "1.0", "--min-p", "1", "--seed", "4")
    assert a["output_ids"] == golden_greedy(FIXTURE)[:N]


@pytest.mark.parametrize("temp", ["1e-30", "1e-45"])
def test_vanishing_temperature_is_greedy(temp):
    # exp((l − max) / T) underflows to 0 for every token but the top one: no NaN, just greedy.
    a = _sample("--temp", temp, "--seed", "6")
    assert a["output_ids"] == golden_greedy(FIXTURE)[:N]


def test_temp_zero_ignores_seed():
    a = _sample("--temp", "0", "--seed", "1")
    b = _sample("--temp", "0", "--seed", "99")
    assert a["output_ids"] == b["output_ids"] == golden_greedy(FIXTURE)[:N]


@pytest.mark.parametrize("flag,value,names", [
    ("--temp", "-1", ("--temp", "temperature")),
    ("--temp", "nan", ("--temp", "temperature")),
    ("--top-p", "0", ("--top-p", "top_p")),
    ("--top-p", "1.5", ("--top-p", "top_p")),
    ("--top-p", "-0.5", ("--top-p", "top_p")),
    ("--min-p", "2", ("--min-p", "min_p")),
    ("--min-p", "-0.1", ("--min-p", "min_p")),
    ("--top-k", "-1", ("--top-k", "top_k")),
])
def test_invalid_sampling_values_are_rejected(flag, value, names):
    r = kdtree("run", "-m", FIXTURES / FIXTURE, "--prompt-ids", "1,2,3", "-n", 2, f"{flag}={value}")
    assert_clean_failure(r)
    assert any(n in r.stderr for n in names), f"message does not name {flag}\n{r}"
    assert r.stdout == ""


@pytest.mark.parametrize("flag,value", [("--temp", "abc"), ("--top-k", "1.5"), ("--seed", "-3")])
def test_malformed_sampling_values_are_usage_errors(flag, value):
    r = kdtree("run", "-m", FIXTURES / FIXTURE, "--prompt-ids", "1,2,3", "-n", 2, f"{flag}={value}")
    assert_clean_failure(r, code=2)
    assert flag in r.stderr, str(r)
