"""Kimi K2.5 / K2.6 chat templates: TypeScript tool declarations, thinking and preserve_thinking.

The reference is Python: Moonshot's own encoder (tests/fixtures/chat-templates/kimi_tool_declaration_ts.py,
an exact copy, source in that folder's README) run the way K2.5's tokenization_kimi.py runs it
(deep-sort the tools, encode, on any exception leave `tools_ts_str` undefined), then jinja2 renders
the template with it. `kdtree chat-template --template kimi-k25|kimi-k26` must give the same bytes.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BIN, FIXTURES, REPO
from test_chat_template import CONVERSATIONS, TOOLS, deep_sort, jinja_render, normalise

TEMPLATES = FIXTURES / "chat-templates"
_spec = importlib.util.spec_from_file_location("kimi_tool_declaration_ts", TEMPLATES / "kimi_tool_declaration_ts.py")
ts_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts_ref)


def reference_ts(tools):
    """tools_ts_str as K2.5's apply_chat_template computes it: None where the encoder raises."""
    try:
        return ts_ref.encode_tools_to_typescript_style(deep_sort(tools))
    except Exception:  # noqa: BLE001 - the tokenizer catches everything here too
        return None


def render_ref(name, messages, tools, thinking=None, preserve=None, add_generation_prompt=True):
    extra = {}
    if tools:
        ts = reference_ts(tools)
        if ts is not None:
            extra["tools_ts_str"] = ts
    if preserve is not None:
        extra["preserve_thinking"] = preserve
    return jinja_render(name, messages, tools, thinking, add_generation_prompt, **extra)


def render_kd(kind, messages, tools, tmp_path, thinking=None, preserve=None, ok=True):
    mfile = tmp_path / "messages.json"
    mfile.write_text(json.dumps(messages, ensure_ascii=False), encoding="utf-8")
    args = [str(BIN), "chat-template", "--template", kind, "--messages", str(mfile)]
    if tools is not None:
        tfile = tmp_path / "tools.json"
        tfile.write_text(json.dumps(tools, ensure_ascii=False), encoding="utf-8")
        args += ["--tools", str(tfile)]
    if thinking is not None:
        args += ["--thinking", "on" if thinking else "off"]
    if preserve is not None:
        args += ["--preserve-thinking", "on" if preserve else "off"]
    p = subprocess.run(args, capture_output=True, timeout=30, cwd=REPO)
    if not ok:
        return p
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode("utf-8")


def fn(name, params=None, description=None, **extra):
    f = {"name": name}
    if params is not None:
        f["parameters"] = params
    if description is not None:
        f["description"] = description
    f.update(extra)
    return {"type": "function", "function": f}


def obj(props, required=(), **extra):
    return {"type": "object", "properties": props, "required": list(required), **extra}


# Each entry: a tools array exercising one corner of the encoder. Those marked "fallback" make the
# Python encoder raise, so the template declares the tools as JSON instead.
TOOL_CASES = {
    "weather": TOOLS,
    "scalars_and_constraints": [fn("f", obj({
        "s": {"type": "string", "maxLength": 10, "minLength": 1, "pattern": "^[a-z]+$", "description": "a name"},
        "n": {"type": "number", "minimum": 1e-05, "maximum": 1e16, "default": 0.5},
        "i": {"type": "integer", "minimum": -3, "maximum": 7.5, "default": 2},
        "b": {"type": "boolean", "default": False},
        "z": {"type": "null"},
        "odd": {"type": "uuid", "maxLength": 3},
        "nulls": {"type": "string", "maximum": None, "pattern": None},
    }, ["s", "i"]), "Scalars.\n\nSecond paragraph\n")],
    "defaults": [fn("d", obj({
        "text": {"type": "string", "default": "héllo \"quoted\"\n\t\u0001"},
        "items": {"type": "array", "default": [1, "two", 3.0, None, True]},
        "conf": {"type": "object", "default": {"b": 1, "a": {"x": [1e-07]}}},
        "big": {"type": "number", "default": 1e22},
        "neg": {"type": "number", "default": -0.0},
        "none": {"type": "string", "default": None},
    }))],
    "nested_objects": [fn("nest", obj({
        "outer": obj({"inner": obj({"leaf": {"type": "string", "description": "deep leaf"}}, ["leaf"],
                                   description="inner object"),
                      "flag": {"type": "boolean"}}, ["inner"], description="outer\nobject"),
        "empty": {"type": "object"},
        "emptyprops": {"type": "object", "properties": {}},
    }, ["outer"]))],
    "arrays": [fn("arr", obj({
        "plain": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "described": {"type": "array", "items": {"type": "integer", "description": "an id", "minimum": 0}},
        "objs": {"type": "array", "items": obj({"k": {"type": "string"}}, ["k"], description="pair")},
        "noitems": {"type": "array"},
        "emptyitems": {"type": "array", "items": {}},
        "falseitems": {"type": "array", "items": False},
        "trueitems": {"type": "array", "items": True},
        "nested": {"type": "array", "items": {"type": "array", "items": {"type": "number", "description": "x"}}},
    }))],
    "enums": [fn("e", obj({
        "color": {"type": "string", "enum": ["red", "green", "blue"], "description": "pick one"},
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "mixed": {"enum": ["a", 1, 2.5, True, None]},
        "nullable": {"type": ["string", "null"], "enum": ["x", None]},
        "single": {"type": ["number"], "enum": [1, 2.0]},
        "boolish": {"type": "integer", "enum": [True, 0]},
    }, ["color"]))],
    "unions": [fn("u", obj({
        "any_of": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "number"}}, obj({"a": {"type": "string"}})],
                   "description": "several"},
        "types": {"type": ["string", "integer", "null", "object", "array", "boolean", "number"]},
        "bools": {"anyOf": [True, False]},
        "anyof_empty": {"anyOf": []},
    }))],
    "defs_and_refs": [fn("r", {"type": "object", "$defs": {
        "Point": obj({"x": {"type": "number"}, "y": {"type": "number"}}, ["x", "y"], description="A point"),
        "Color": {"type": "string", "enum": ["r", "g"]},
    }, "properties": {"at": {"$ref": "#/$defs/Point", "description": "where"},
                      "paint": {"$ref": "#/$defs/Color"},
                      "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}}}, "required": ["at"]})],
    "self_ref": [fn("tree", {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["value"], "additionalProperties": False}, "A tree")],
    "additional_properties": [fn("ap", obj({
        "free": {"type": "object", "additionalProperties": True},
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
        "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
        "typed_obj": {"type": "object", "additionalProperties": obj({"q": {"type": "string"}})},
        "nullap": {"type": "object", "additionalProperties": None, "properties": {"a": {"type": "string"}}},
    }), additionalProperties=False)],
    "bool_and_empty_schemas": [fn("b", obj({"anything": True, "nothing": False, "empty": {}}, ["anything"]))],
    "odd_functions": [fn("no_params"), fn("null_params", None, description=""),
                      {"type": "function", "function": {"parameters": {"type": "object"}}},
                      {"type": "function", "function": {}},
                      {"type": "_plugin", "_plugin": {"name": "web"}},
                      fn("multi", {}, "line one\nline two"),
                      fn("unicode_名前", obj({"città": {"type": "string", "description": "nome 🙂"}}, ["città"]))],
    "required_unknown_names": [fn("q", obj({"a": {"type": "string"}}, ["a", "missing", 3]))],
    "not_printed_bad_description": [fn("npd", {"type": "object", "description": 5,
                                               "properties": {"a": {"anyOf": [{"type": "string", "description": ["x"]}]}}})],
    "only_plugins": [{"type": "_plugin", "_plugin": {"name": "web"}}],
    "pydantic_style": [fn("book", {"$defs": {
        "Seat": {"enum": ["aisle", "window"], "title": "Seat", "type": "string"},
        "Passenger": {"properties": {"name": {"title": "Name", "type": "string"},
                                     "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Age"},
                                     "seat": {"$ref": "#/$defs/Seat", "default": "aisle"}},
                      "required": ["name"], "title": "Passenger", "type": "object"}},
        "properties": {"passengers": {"items": {"$ref": "#/$defs/Passenger"}, "title": "Passengers", "type": "array"},
                       "date": {"format": "date", "title": "Date", "type": "string"},
                       "notes": {"anyOf": [{"maxLength": 200, "type": "string"}, {"type": "null"}], "default": None}},
        "required": ["passengers", "date"], "title": "BookArgs", "type": "object"}, "Book seats.")],
    # --- the Python encoder raises: JSON declaration instead
    "fallback_allof": [fn("x", obj({"a": {"allOf": [{"$ref": "#/$defs/A"}]}}, [], **{"$defs": {"A": {"type": "string"}}}))],
    "fallback_bad_ref": [fn("x", obj({"a": {"$ref": "#/$defs/Nope"}}))],
    "fallback_ref_format": [fn("x", obj({"a": {"$ref": "http://example.com/schema"}}))],
    "fallback_enum_type": [fn("x", obj({"a": {"type": "string", "enum": ["ok", 3]}}))],
    "fallback_enum_types3": [fn("x", obj({"a": {"type": ["string", "integer", "null"], "enum": ["ok"]}}))],
    "fallback_union_unknown": [fn("x", obj({"a": {"type": ["string", "date"]}}))],
    "fallback_invalid_schema": [fn("x", obj({"a": {"description": "no type"}}))],
    "fallback_desc_not_string": [fn("x", obj({"a": {"type": "string", "description": 42}}))],
    "fallback_fn_desc_not_string": [fn("x", obj({}), description=["a"])],
    "fallback_additional_bad": [fn("x", obj({"a": {"type": "object", "additionalProperties": 5}}))],
    "fallback_schema_string": [fn("x", obj({"a": "string"}))],
    "fallback_tool_not_object": [fn("ok", obj({})), "not a tool"],
}

TS_CONVERSATIONS = ["user_only", "tool_loop", "tool_loop_done", "reasoning_history"]


@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_typescript_tools_match_reference(case, tmp_path):
    tools = TOOL_CASES[case]
    ts = reference_ts(tools)
    assert (ts is None) == case.startswith("fallback"), ts  # the table says which cases fall back
    messages = normalise(CONVERSATIONS["user_only"])
    want = render_ref("kimi-k25.jinja", messages, tools)
    assert render_kd("kimi-k25", messages, tools, tmp_path) == want
    if ts:
        assert ts in want  # the declaration really is the TypeScript text


@pytest.mark.parametrize("preserve", [None, True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("conv", TS_CONVERSATIONS + ["multi_turn", "named", "content_parts"])
def test_k26_matches_jinja(conv, thinking, preserve, tmp_path):
    messages = normalise(CONVERSATIONS[conv])
    tools = TOOL_CASES["defs_and_refs"] + TOOLS if conv in TS_CONVERSATIONS else None
    want = render_ref("kimi-k26.jinja", messages, tools, thinking, preserve)
    assert render_kd("kimi-k26", messages, tools, tmp_path, thinking, preserve) == want


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_k25_matches_jinja(conv, thinking, tmp_path):
    messages = normalise(CONVERSATIONS[conv])
    want = render_ref("kimi-k25.jinja", messages, TOOLS, thinking)
    assert render_kd("kimi-k25", messages, TOOLS, tmp_path, thinking) == want


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_k2_thinking_as_published_matches_jinja(conv, tmp_path):
    messages = normalise(CONVERSATIONS[conv])
    want = render_ref("moonshotai-Kimi-K2-Thinking.jinja", messages, TOOLS)
    assert render_kd("kimi-k2-thinking", messages, TOOLS, tmp_path) == want


def test_preserve_thinking_keeps_every_turn(tmp_path):
    """What the option is for, checked without the renderer's own output as the reference."""
    messages = normalise(CONVERSATIONS["reasoning_history"])
    kept = render_kd("kimi-k26", messages, None, tmp_path, preserve=True)
    dropped = render_kd("kimi-k26", messages, None, tmp_path, preserve=False)
    assert "<think>old thoughts</think>a1" in kept and "old thoughts" not in dropped
    # the last assistant turn has no tool calls, so without the option it is history too
    assert "<think>newest thoughts</think>" in kept and "newest thoughts" not in dropped


@pytest.mark.parametrize("kind,flag,value", [("kimi-k25", "--preserve-thinking", "on"),
                                             ("kimi", "--preserve-thinking", "off"),
                                             ("deepseek-v3", "--preserve-thinking", "on"),
                                             ("kimi-k2-thinking", "--thinking", "off")])
def test_options_a_template_lacks_are_refused(kind, flag, value, tmp_path):
    mfile = tmp_path / "m.json"
    mfile.write_text('[{"role": "user", "content": "hi"}]')
    p = subprocess.run([str(BIN), "chat-template", "--template", kind, "--messages", str(mfile), flag, value],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and flag.lstrip("-").replace("-", "_") in p.stderr and kind in p.stderr, p.stderr


@pytest.mark.parametrize("schema,path", [
    ({"type": "integer", "maximum": [1, 2]}, "properties.a.maximum"),          # str(list) is a Python repr
    ({"enum": [["a"], "b"]}, "properties.a.enum[0]"),
    ({"type": "string", "enum": "abc"}, "properties.a.enum"),                   # Python iterates the characters
    ({"type": 5}, "properties.a.type"),
])
def test_unreproducible_inputs_are_refused(schema, path, tmp_path):
    tools = [fn("x", obj({"a": schema}))]
    p = render_kd("kimi-k25", [{"role": "user", "content": "hi"}], tools, tmp_path, ok=False)
    err = p.stderr.decode()
    assert p.returncode == 1 and path in err and "tools" in err, err


# --- random schemas (hypothesis): the encoder and the native renderer agree on whatever comes out

names = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF, blacklist_characters="\x7f"), min_size=1, max_size=6)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False, width=64), st.text(max_size=8))
descriptions = st.one_of(st.none(), st.text(alphabet="ab \n/é", max_size=12))


def with_desc(d, desc):
    if desc is not None:
        d["description"] = desc
    return d


schemas = st.recursive(
    st.one_of(
        st.booleans(),
        st.builds(lambda t, d, c: with_desc({"type": t, **c}, d),
                  st.sampled_from(["string", "number", "integer", "boolean", "null"]), descriptions,
                  st.dictionaries(st.sampled_from(["maxLength", "minimum", "maximum", "pattern"]), scalars, max_size=2)),
        st.builds(lambda v, d: with_desc({"enum": v}, d), st.lists(scalars, min_size=1, max_size=4), descriptions),
        st.builds(lambda ts: {"type": ts}, st.lists(st.sampled_from(["string", "null", "array", "object"]), min_size=1, max_size=3)),
    ),
    lambda inner: st.one_of(
        st.builds(lambda p, r, d, ap: with_desc({"type": "object", "properties": p, "required": r,
                                                 **({} if ap is None else {"additionalProperties": ap})}, d),
                  st.dictionaries(names, inner, max_size=4), st.lists(names, max_size=2), descriptions,
                  st.one_of(st.none(), st.booleans(), inner)),
        st.builds(lambda i, d: with_desc({"type": "array", "items": i}, d), inner, descriptions),
        st.builds(lambda a: {"anyOf": a}, st.lists(inner, min_size=1, max_size=3)),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(props=st.dictionaries(names, schemas, max_size=5), desc=descriptions)
def test_random_schemas_match_reference(props, desc, tmp_path):
    tools = [fn("rand", {"type": "object", "properties": props}, desc)]
    messages = [{"role": "user", "content": "hi", "name": None}]
    want = render_ref("kimi-k25.jinja", normalise(messages), tools)
    p = render_kd("kimi-k25", messages, tools, tmp_path, ok=False)
    if p.returncode != 0:  # refused: only for the documented unreproducible cases
        assert "repr()" in p.stderr.decode(), p.stderr.decode()
        return
    assert p.stdout.decode("utf-8") == want


def nested(depth):
    schema = {"type": "string", "description": "leaf"}
    for i in range(depth):
        schema = {"type": "array", "items": schema} if i % 2 else obj({"x": schema}, ["x"], description=f"level {i}")
    return [fn("deep", obj({"root": schema}))]


def test_deep_schemas_match_then_are_refused(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    # nested(38) is 63 JSON levels, within the bound every JSON input has (core/untrusted.h
    # kMaxJsonDepth = 64, the server's request bound too); deeper is refused while parsing, before the
    # renderer's own schema (64) and argument (256) limits could be reached.
    tools = nested(38)
    assert render_kd("kimi-k25", messages, tools, tmp_path) == render_ref("kimi-k25.jinja", normalise(messages), tools)
    p = render_kd("kimi-k25", messages, nested(40), tmp_path, ok=False)
    assert p.returncode == 1 and b"tools: JSON nests deeper than 64" in p.stderr, p.stderr
    p = render_kd("kimi-k25", messages, nested(200), tmp_path, ok=False)
    assert p.returncode == 1 and b"tools: JSON nests deeper than 64" in p.stderr, p.stderr
    deep_args = {"a": None}
    for _ in range(300):
        deep_args = {"a": deep_args}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": deep_args}}]}]
    p = render_kd("kimi", msgs, None, tmp_path, ok=False)
    assert p.returncode == 1 and b"messages: JSON nests deeper than 64" in p.stderr, p.stderr


def test_integers_beyond_64_bits_are_refused(tmp_path):
    """Python keeps 2**64 exact; nlohmann::json would make it a double and print 1.8446744073709552e+19."""
    ok = [fn("n", obj({"a": {"type": "integer", "maximum": 2**64 - 1, "minimum": -2**63, "description": "9" * 30}}))]
    messages = [{"role": "user", "content": "hi"}]
    assert render_kd("kimi-k25", messages, ok, tmp_path) == render_ref("kimi-k25.jinja", normalise(messages), ok)
    for big in (2**64, -2**63 - 1, 10**30):
        tools = [fn("n", obj({"a": {"type": "integer", "maximum": big, "description": "1" * 30}}))]
        p = render_kd("kimi-k25", messages, tools, tmp_path, ok=False)
        assert p.returncode == 1 and b"does not fit in 64 bits" in p.stderr and str(big).encode() in p.stderr, p.stderr
