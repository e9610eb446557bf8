"""`kdtree serve --tp 2` (CPU, two in-process ranks): the server over the tensor-parallel target gives
the text `kdtree run --tp 2` gives, requests in a concurrent batch equal each alone, and DDTree inside
the engine equals plain decoding — the exactness properties of tests/unit/test_tensor_parallel.cpp
through the HTTP API and the official openai client."""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import BIN, TOK, Server, kdtree_run

PROMPT = "Tensor parallel ranks add their partial sums in rank order"


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> object:
    """The tiny preset with 64-wide INT4 experts, so that two ranks hold 32 columns each (whole groups;
    the tiny preset's 32-wide experts cannot be split)."""
    root = tmp_path_factory.mktemp("tp")
    base = root / "base"
    subprocess.run([str(BIN), "make-model", "--preset", "tiny", "-o", str(base), "--force"], check=True, capture_output=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    d = root / "tiny-tp"
    subprocess.run([str(BIN), "make-model", "--config", str(root / "config.json"), "--seed", "3", "-o", str(d), "--force",
                    "--tokenizer", str(TOK)], check=True, capture_output=True)
    subprocess.run([str(BIN), "make-model", "--drafter-for", str(d), "--seed", "1", "-o", str(root / "drafter"),
                    "--force"], check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def tp_server(tp_model, tmp_path_factory):
    s = Server(tp_model, tmp_path_factory.mktemp("tp-logs") / "serve.log", "--tp", "2", "--parallel", "4")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def tp_spec_server(tp_model, tmp_path_factory):
    s = Server(tp_model, tmp_path_factory.mktemp("tp-spec-logs") / "serve.log", "--tp", "2", "--parallel", "4",
               "--draft", tp_model.parent / "drafter", "--budget", "4")
    yield s
    s.stop()


@pytest.mark.parametrize("temp,seed", [(0.0, 0), (0.8, 9)])
def test_tp_server_equals_run_and_ddtree(tp_server, tp_spec_server, tp_model, temp, seed):
    kw = dict(model="tiny-tp", prompt=PROMPT, temperature=temp, seed=seed, max_tokens=20, extra_body={"ignore_eos": True})
    plain = tp_server.client().completions.create(**kw)
    spec = tp_spec_server.client().completions.create(**kw)
    ref = kdtree_run("-m", tp_model, "-p", PROMPT, "--parse-special", "--tp", 2, "--temp", temp, "--seed", seed, "-n", 20,
                     "--ignore-eos")
    assert plain.choices[0].text == spec.choices[0].text == ref["text"]
    assert spec.model_extra["timings"]["spec_rounds"] > 0


def test_tp_server_batch_equals_alone(tp_server):
    c = tp_server.client()
    jobs = [(f"Rank order item {i}", 30 + i, 0.0 if i % 2 else 0.9) for i in range(6)]

    def gen(j):
        r = c.completions.create(model="tiny-tp", prompt=j[0], temperature=j[2], seed=j[1], max_tokens=12,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [gen(j) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as ex:
        batched = list(ex.map(gen, jobs))
    assert batched == alone


def test_serve_refuses_tp_that_does_not_divide(tp_model):
    p = subprocess.run([str(BIN), "serve", "-m", str(tp_model), "--tp", "3", "--port", "0"], capture_output=True, text=True,
                       timeout=60)
    assert 0 < p.returncode < 128 and "num_attention_heads" in p.stderr, p.stderr
