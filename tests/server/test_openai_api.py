"""The OpenAI routes through the official `openai` client: completions, chat, streaming, usage, seeds
(identical to `kdtree run`), stop strings across token boundaries, logprobs, models, tokenize,
metrics, generation_config.json defaults."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import Server, jinja_kimi, kdtree_run

PROMPT = "Speculative decoding verifies a whole tree of guesses"


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model"
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["meta"]["n_ctx"] == 4096


def test_health_is_ok_once_loaded(server):
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


@pytest.mark.parametrize("temp,seed,top_k,top_p,min_p", [(0.0, 0, 0, 1.0, 0.0), (0.8, 7, 0, 1.0, 0.0), (1.0, 123, 40, 0.9, 0.02)])
def test_completion_equals_kdtree_run(client, tiny_model, enc, temp, seed, top_k, top_p, min_p):
    """Same settings, same seed → the same text and ids as the CLI (row invariance, DESIGN.md §2)."""
    ref = kdtree_run("-m", tiny_model, "-p", PROMPT, "--parse-special", "--temp", temp, "--seed", seed, "-n", 24,
                     "--ignore-eos", "--top-k", top_k, "--top-p", top_p, "--min-p", min_p)
    r = client.completions.create(model="tiny", prompt=PROMPT, temperature=temp, seed=seed, max_tokens=24, top_p=top_p,
                                  extra_body={"ignore_eos": True, "top_k": top_k, "min_p": min_p})
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(enc.encode(PROMPT, allowed_special="all")) == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.object == "text_completion" and r.model == "tiny"


def test_prompt_as_token_ids(client, enc):
    ids = enc.encode(PROMPT)
    a = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    b = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)


def test_same_seed_same_text_other_seed_differs(client):
    def gen(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, temperature=1.0, seed=seed, max_tokens=32,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert gen(11) == gen(11)
    assert gen(11) != gen(12)


def test_completion_stream_chunks_and_done(server, client):
    kw = dict(model="tiny", prompt=PROMPT, temperature=0.7, seed=3, max_tokens=20, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # Raw SSE framing: `data: {json}\n\n` events, `data: [DONE]` last.
    status, hdrs, body = server.request("POST", "/v1/completions", {**{k: v for k, v in kw.items() if k != "extra_body"},
                                                                    "ignore_eos": True, "stream": True})
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_chat_non_stream_and_stream_agree(client, enc):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    kw = dict(model="tiny", messages=msgs, temperature=0.9, seed=5, max_tokens=24)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant"
    # prompt_tokens = the jinja2 rendering of the committed template, tokenized by tiktoken.
    assert r.usage.prompt_tokens == len(enc.encode(jinja_kimi(msgs), allowed_special="all"))
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == (m.content or "")
    assert reasoning == (getattr(m, "reasoning_content", None) or "")
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [r.choices[0].finish_reason]
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_thinking_false_closes_reasoning(client, enc):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.prompt_tokens == len(enc.encode(jinja_kimi(msgs, thinking=False), allowed_special="all"))
    assert getattr(r.choices[0].message, "reasoning_content", None) in (None, "")


def test_max_tokens_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0,
                                       max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="tiny", prompt="x", temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def _boundary_stop(ref, enc) -> str:
    """A stop string made of the end of one generated token and the start of the next (ASCII both)."""
    ids = ref["output_ids"]
    for i in range(2, len(ids) - 1):
        a, b = enc.decode_single_token_bytes(ids[i]), enc.decode_single_token_bytes(ids[i + 1])
        if len(a) >= 2 and len(b) >= 2 and a.isascii() and b.isascii() and a[-2:].strip() and b[:2].strip():
            return (a[-2:] + b[:2]).decode()
    pytest.skip("no ASCII token boundary in this continuation")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens(client, tiny_model, enc, stream):
    ref = kdtree_run("-m", tiny_model, "-p", PROMPT, "--parse-special", "--temp", 0, "-n", 40, "--ignore-eos")
    stop = _boundary_stop(ref, enc)
    want = ref["text"][: ref["text"].index(stop)]
    kw = dict(model="tiny", prompt=PROMPT, temperature=0, max_tokens=40, stop=["@@never@@", stop],
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert text == want and stop not in text
    assert finish == ["stop"]


def test_completion_logprobs(client, tiny_model):
    r = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, alts in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(alts) == 3
        # greedy: the chosen token is the most likely one
        assert abs(chosen - max(alts.values())) < 1e-5


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=5, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5


def test_tokenize_detokenize_match_tiktoken(server, enc):
    text = "Hello, world! 世界 <|im_end|>"
    status, _, r = server.post("/tokenize", {"content": text})
    assert status == 200 and r["tokens"] == enc.encode(text, allowed_special="all")
    status, _, r2 = server.post("/tokenize", {"content": text, "parse_special": False})
    assert r2["tokens"] == enc.encode(text, disallowed_special=())
    status, _, d = server.post("/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["content"] == text
    msgs = [{"role": "user", "content": "Hi"}]
    status, _, t = server.post("/tokenize", {"messages": msgs})
    assert t["tokens"] == enc.encode(jinja_kimi(msgs), allowed_special="all")


def test_metrics_count_requests(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt="a b c", temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["kdtree_generation_tokens_total"] >= before["kdtree_generation_tokens_total"] + 4
    assert after["kdtree_prompt_tokens_total"] > before["kdtree_prompt_tokens_total"]
    assert after["kdtree_time_to_first_token_seconds_count"] == before["kdtree_time_to_first_token_seconds_count"] + 1
    assert after["kdtree_e2e_request_latency_seconds_count"] == before["kdtree_e2e_request_latency_seconds_count"] + 1
    for name in ("kdtree_requests_running", "kdtree_requests_waiting", "kdtree_kv_cache_usage_ratio",
                 "kdtree_prefix_cache_hit_rate", "kdtree_spec_mean_accepted_length",
                 'kdtree_time_per_output_token_seconds_bucket{le="+Inf"}'):
        assert name in after


def test_generation_config_defaults(tiny_model, tmp_path):
    """Fields a request leaves out come from generation_config.json (here: greedy and 5 tokens)."""
    model = tmp_path / "tiny-gc"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    s = Server(model, tmp_path / "serve.log")
    try:
        c = s.client()
        r = c.completions.create(model="tiny-gc", prompt=PROMPT, extra_body={"ignore_eos": True})
        greedy = c.completions.create(model="tiny-gc", prompt=PROMPT, temperature=0, max_tokens=5,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        assert r.choices[0].text == greedy.choices[0].text
    finally:
        s.stop()


def test_equivalent_spellings(server):
    """One-element prompt lists, integral floats and vLLM's top_k -1 mean what they say."""
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.7, "seed": 4, "ignore_eos": True}
    want = server.post("/v1/completions", base)[2]["choices"][0]["text"]
    for variant in ({"prompt": [PROMPT]}, {"max_tokens": 6.0}, {"top_k": -1}, {"top_k": 0},
                    {"max_tokens": 99, "max_completion_tokens": 6}, {"stop": None, "n": 1, "logprobs": None}):
        status, _, r = server.post("/v1/completions", {**base, **variant})
        assert status == 200, (variant, r)
        assert r["choices"][0]["text"] == want, variant
        assert r["usage"]["completion_tokens"] == 6


def test_streamed_logprobs_equal_non_streamed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0.6, seed=8, max_tokens=7,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    assert len(whole) == 7


def test_retrieve_one_model(client, server):
    """GET /v1/models/{id} as OpenAI's models.retrieve; an unknown id is 404 naming it."""
    import openai
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model" and m.owned_by == "kdtree"
    status, _, body = server.request("GET", "/v1/models/tiny")
    listed = json.loads(server.request("GET", "/v1/models")[2])["data"][0]
    assert status == 200 and json.loads(body) == listed
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in str(e.value)
    status, _, body = server.request("GET", "/v1/models/org/some-model")
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
