"""Constrained output (issue 20): response_format json_schema / json_object on /v1/chat/completions and
llama.cpp's `grammar` on /v1/completions, through the official openai client. Every answer that the
grammar completed is validated by `jsonschema` (the independent reference); answers cut by max_tokens
must say so. The tiny model is random, so sampled answers wander: the schemas bound their strings and
arrays so that answers end. Requests run alone and concurrently (batched in the engine), streamed and
not, greedy and sampled, with plain decoding and with DDTree (whose answers must equal plain decoding's).
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from conftest import BIN, Server

MSGS = [{"role": "user", "content": "Answer in JSON."}]

WEATHER = {  # an OpenAI-style strict tool schema
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}
SCHEMAS = {
    "weather": WEATHER,
    "nested": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "kind": {"const": "report"},
        },
        "required": ["ok", "tags", "kind"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 1, "maxItems": 5},
}


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client, schema, seed, temperature=1.0, stream=False, max_tokens=256):
    kw = dict(model="tiny", messages=MSGS, seed=seed, temperature=temperature, max_tokens=max_tokens,
              response_format=response_format(schema))
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return c.message.content, c.finish_reason, (c.model_extra or {}).get("error")
    text, finish, err = "", None, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        text += c.delta.content or ""
        if c.finish_reason:
            finish, err = c.finish_reason, (c.model_extra or {}).get("error")
    return text, finish, err


def check(schema, text, finish, err):
    """A completed answer validates; a cut one says so. Returns whether it completed."""
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
        assert err is None
        return True
    assert finish == "length", finish
    assert err and "grammar" in err, err
    return False


def test_json_schema_answers_validate_batched_streamed_and_not(client):
    jobs = [(name, seed, seed % 2 == 1) for name in SCHEMAS for seed in range(60)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda j: (j, chat(client, SCHEMAS[j[0]], seed=j[1], stream=j[2])), jobs))
    done = {name: 0 for name in SCHEMAS}
    for (name, seed, stream), (text, finish, err) in results:
        try:
            done[name] += check(SCHEMAS[name], text, finish, err)
        except (jsonschema.ValidationError, json.JSONDecodeError, AssertionError) as e:
            raise AssertionError(f"{name} seed {seed} stream {stream}: {text!r} ({finish}): {e}") from e
    # The schemas are bounded: almost every sampled answer ends within max_tokens.
    for name, n in done.items():
        assert n >= 45, (name, n, "of 60 completed")


# Keywords compiled to digit-string and regular grammars (grammar/json_number.h, json_format.h): integer
# ranges, decimal bounds, multipleOf, the string formats with a checker in jsonschema's FormatChecker
# (date, ipv4, ipv6, uuid, email; others need extra packages), a discriminated oneOf.
KEYWORDS = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -40, "exclusiveMaximum": 125},
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.25},
        "m": {"type": "integer", "multipleOf": 7},
        "day": {"type": "string", "format": "date"},
        "ip": {"type": "string", "format": "ipv4"},
        "ip6": {"type": "string", "format": "ipv6"},
        "id": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email"},
        "shape": {"oneOf": [
            {"type": "object", "properties": {"kind": {"const": "dot"}}, "required": ["kind"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "box"}, "w": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["kind", "w"], "additionalProperties": False}]},
    },
    "required": ["n", "x", "m", "day", "ip", "ip6", "id", "mail", "shape"],
    "additionalProperties": False,
}


def test_numeric_bounds_formats_and_one_of_validate(client):
    validator = jsonschema.Draft202012Validator(KEYWORDS, format_checker=jsonschema.FormatChecker())
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda seed: chat(client, KEYWORDS, seed=seed, max_tokens=400), range(40)))
    done = 0
    for seed, (text, finish, err) in enumerate(results):
        if check(KEYWORDS, text, finish, err):
            errors = [e.message for e in validator.iter_errors(json.loads(text))]
            assert not errors, (seed, text, errors)
            done += 1
    assert done >= 10, done


def test_greedy_is_deterministic_and_alone_equals_batched(client):
    alone = [chat(client, s, seed=0, temperature=0.0) for s in SCHEMAS.values()]
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda s: chat(client, s, seed=0, temperature=0.0), SCHEMAS.values()))
    assert alone == batched
    for schema, (text, finish, err) in zip(SCHEMAS.values(), alone):
        check(schema, text, finish, err)


def test_seeded_sampling_is_reproducible(client):
    a = chat(client, WEATHER, seed=11, temperature=0.9)
    b = chat(client, WEATHER, seed=11, temperature=0.9, stream=True)
    assert a == b
    check(WEATHER, *a)


def test_json_object_is_an_object(client):
    # Free-form strings rarely close under a random model, so most answers are cut: those must say so.
    for seed in range(8):
        r = client.chat.completions.create(model="tiny", messages=MSGS, seed=seed, temperature=1.0, max_tokens=48,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length" and "grammar" in c.model_extra["error"]
            assert c.message.content.startswith("{")


def test_max_tokens_cut_says_so(client):
    text, finish, err = chat(client, WEATHER, seed=3, max_tokens=3)
    assert finish == "length" and "grammar" in err
    head = '{"location": "'  # the only way the schema can start
    assert text and (head.startswith(text) or text.startswith(head)), text


def test_gbnf_grammar_on_completions(client):
    grammar = 'root ::= ("yes" | "no") ", " digits "!"\ndigits ::= [0-9]{1,3}\n'
    for seed in range(6):
        r = client.completions.create(model="tiny", prompt="Is it?", seed=seed, temperature=1.0, max_tokens=32,
                                      extra_body={"grammar": grammar})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}!", c.text), c.text


def test_a_grammar_past_the_work_budget_is_400_and_others_are_served(client, server):
    """A valid grammar that keeps thousands of parses alive (3000 copies of an ambiguous, nullable x
    before a counted run) spends the matcher's work budget within a few tokens (issue 21): the request
    gets a 400 naming the cause, quickly, while a good constrained request beside it is answered."""
    hostile = "root ::= " + "x " * 3000 + '[a-d]{200} "e"\nx ::= [a-d]? [a-d]? | [a-c] [a-d] [a-d]?\n'
    good = 'root ::= ("yes" | "no") ", " digits "!"\ndigits ::= [0-9]{1,3}\n'

    def bad():
        t0 = time.monotonic()
        status, _, r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 64, "temperature": 0,
                                                       "grammar": hostile})
        return status, r, time.monotonic() - t0

    def fine(seed):
        r = client.completions.create(model="tiny", prompt="Is it?", seed=seed, temperature=1.0, max_tokens=32,
                                      extra_body={"grammar": good})
        return r.choices[0]

    with ThreadPoolExecutor(4) as ex:
        hostile_f = ex.submit(bad)
        goods = [ex.submit(fine, seed) for seed in range(3)]
        status, r, secs = hostile_f.result()
        answers = [f.result() for f in goods]
    assert status == 400 and r["error"]["type"] == "invalid_request_error", r
    assert "budget of parser steps" in r["error"]["message"] and "one parse" in r["error"]["message"], r
    assert secs < 30, f"the hostile grammar held its request {secs:.1f} s"
    for c in answers:
        assert c.finish_reason == "stop" and re.fullmatch(r"(yes|no), [0-9]{1,3}!", c.text), c
    status, _, _ = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "grammar": good})
    assert status == 200


def test_unsupported_schema_is_400_naming_the_path(client, server):
    status, _, r = server.post("/v1/chat/completions", {"messages": MSGS, "response_format": response_format(
        {"type": "object", "properties": {"n": {"type": "object", "minProperties": 3}}})})
    assert status == 400 and r["error"]["param"] == "response_format"
    assert "$.properties.n.minProperties: not supported" in r["error"]["message"]


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter-grammar") / "tiny-dflash"
    subprocess.run([str(BIN), "make-model", "--drafter-for", str(tiny_model), "--seed", "0", "-o", str(d), "--force"],
                   check=True, capture_output=True)
    s = Server(tiny_model, tmp_path_factory.mktemp("spec-grammar") / "serve.log", "--draft", d, "--budget", "4", "--parallel", "4")
    yield s
    s.stop()


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 5), (1.0, 8)])
def test_ddtree_under_a_grammar_equals_plain_decoding(client, spec_server, temperature, seed):
    spec = spec_server.client()
    for name, schema in SCHEMAS.items():
        plain = chat(client, schema, seed=seed, temperature=temperature)
        tree = chat(spec, schema, seed=seed, temperature=temperature)
        assert tree == plain, name
        check(schema, *tree)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}},
    {"type": "function", "function": {"name": "pick", "strict": True, "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
        "required": ["color", "n"], "additionalProperties": False}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_strict_tool_calls_validate(client, tool_choice):
    calls = 0
    for seed in range(12):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=tool_choice, seed=seed,
                                           temperature=1.0, max_tokens=160)
        c = r.choices[0]
        if c.finish_reason == "length":
            continue  # cut: nothing to validate (a call cut inside its arguments carries an error)
        assert c.finish_reason == "tool_calls", c
        for tc in c.message.tool_calls:
            assert tc.function.name in SCHEMA_OF
            if isinstance(tool_choice, dict):
                assert tc.function.name == "pick"
            jsonschema.validate(json.loads(tc.function.arguments), SCHEMA_OF[tc.function.name])
            assert re.fullmatch(r"functions\.(get_weather|pick):[0-9]+", tc.id), tc.id
            calls += 1
    assert calls >= 6


LOOSE_TOOLS = [  # no strict tool: tool_choice required / named alone puts the call under the grammar
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_forced_tool_choice_is_enforced_without_strict_tools(client, tool_choice):
    # Free-form JSON arguments from a random model often run to max_tokens; a cut answer still holds
    # no text outside the call (the grammar allows none), and every finished one is a declared call.
    calls = 0
    for seed in range(16):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=LOOSE_TOOLS, tool_choice=tool_choice, seed=seed,
                                           temperature=1.0, max_tokens=200)
        c = r.choices[0]
        if c.finish_reason == "length":
            assert not c.message.content, c.message
            continue
        assert c.finish_reason == "tool_calls", c
        assert c.message.tool_calls and not c.message.content, c.message
        for tc in c.message.tool_calls:
            assert tc.function.name in ("lookup", "ping"), tc
            if isinstance(tool_choice, dict):
                assert tc.function.name == "ping"
            assert isinstance(json.loads(tc.function.arguments), dict), tc.function.arguments
            calls += 1
    assert calls >= 3, calls


def test_strict_tools_auto_text_or_valid_calls(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=24)
        c = r.choices[0]
        for tc in c.message.tool_calls or []:
            if not (c.model_extra or {}).get("error"):
                jsonschema.validate(json.loads(tc.function.arguments), SCHEMA_OF[tc.function.name])
        assert c.finish_reason in ("stop", "length", "tool_calls")


def test_strict_tools_and_response_format_is_400(server):
    status, _, r = server.post("/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "response_format": {"type": "json_object"}})
    assert status == 400 and "strict tools" in r["error"]["message"]


def test_a_repeated_schema_reuses_its_grammar_and_masks(client, server):
    """A schema sent again (an agent sends its tools every turn) is compiled once, and the masks its first
    request walked serve the second: with the same seed the answer and its grammar states are the same, so
    the second request walks none (/metrics counts both)."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["word", "n"], "additionalProperties": False}
    before = server.metrics()
    first = chat(client, schema, seed=11)
    mid = server.metrics()
    second = chat(client, schema, seed=11)
    after = server.metrics()
    assert first == second
    assert mid["kdtree_grammar_cache_misses_total"] == before["kdtree_grammar_cache_misses_total"] + 1
    assert after["kdtree_grammar_cache_misses_total"] == mid["kdtree_grammar_cache_misses_total"]
    assert after["kdtree_grammar_cache_hits_total"] == mid["kdtree_grammar_cache_hits_total"] + 1
    assert mid["kdtree_grammar_masks_walked_total"] > before["kdtree_grammar_masks_walked_total"]
    assert after["kdtree_grammar_masks_walked_total"] == mid["kdtree_grammar_masks_walked_total"]
    assert after["kdtree_grammar_masks_shared_total"] > mid["kdtree_grammar_masks_shared_total"]
    assert after["kdtree_grammar_masks_bytes"] > 0
