"""`kdtree serve --draft DFLASH_DIR`: DDTree inside the batching engine gives the same text as plain
decoding and as `kdtree run --spec ddtree`, alone and in a concurrent batch, and reports its
speculative statistics in timings and /metrics."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import BIN, Server, kdtree_run

PROMPT = "Speculative decoding verifies a whole tree of guesses"


@pytest.fixture(scope="module")
def drafter(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter") / "tiny-dflash"
    subprocess.run([str(BIN), "make-model", "--drafter-for", str(tiny_model), "--seed", "0", "-o", str(d), "--force"],
                   check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def spec_server(tiny_model, drafter, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("spec") / "serve.log", "--draft", drafter, "--budget", "4",
               "--parallel", "4")
    yield s
    s.stop()


@pytest.mark.parametrize("temp,seed", [(0.0, 0), (0.8, 21)])
def test_ddtree_server_equals_plain_and_run(spec_server, client, tiny_model, drafter, temp, seed):
    kw = dict(model="tiny", prompt=PROMPT, temperature=temp, seed=seed, max_tokens=24, extra_body={"ignore_eos": True})
    spec = spec_server.client().completions.create(**kw)
    plain = client.completions.create(**kw)
    ref = kdtree_run("-m", tiny_model, "-p", PROMPT, "--parse-special", "--temp", temp, "--seed", seed, "-n", 24,
                     "--ignore-eos", "--spec", "ddtree", "--draft", drafter, "--budget", 4)
    assert spec.choices[0].text == plain.choices[0].text == ref["text"]
    t = spec.model_extra["timings"]
    assert t["spec_rounds"] > 0 and t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["mean_accepted_length"] >= 1.0
    # Round by round as `kdtree run` (batch-invariant engine), and Σ τ = tokens − 1 (the prefill's first token).
    assert t["spec_round_tau"] == ref["spec"]["round_tau"] and sum(t["spec_round_tau"]) == t["predicted_n"] - 1


def test_ddtree_batch_equals_solo(spec_server):
    c = spec_server.client()
    jobs = [(f"Item {i} of the batch", 50 + i) for i in range(8)]

    def gen(j, stream=False):
        kw = dict(model="tiny", prompt=j[0], temperature=0.9, seed=j[1], max_tokens=16, extra_body={"ignore_eos": True})
        if stream:
            return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
        return c.completions.create(**kw).choices[0].text

    solo = [gen(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=8) as ex:
        together = list(ex.map(lambda j: gen(j, stream=True), jobs))
    assert together == solo
    m = spec_server.metrics()
    assert m["kdtree_spec_rounds_total"] > 0 and m["kdtree_spec_mean_accepted_length"] >= 1.0
