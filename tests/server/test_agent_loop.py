"""A multi-turn agent loop through the official client: tools declared, a forced (named) call, the
tool result and the reasoning fed back, then auto / required / none. Each turn's prompt_tokens is
checked against an independent rendering — jinja2 on the committed Kimi template, tokenized by
tiktoken — plus the documented tool_choice prefill. The model is random, so what it says is not
checked, only that markers never leak and the objects have OpenAI's shape."""
from __future__ import annotations

import json

from conftest import jinja_kimi

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

SECTION = "<|tool_calls_section_begin|>"


def n_tokens(enc, text: str) -> int:
    return len(enc.encode(text, allowed_special="all"))


def no_markers(msg):
    for text in (msg.content or "", getattr(msg, "reasoning_content", None) or ""):
        assert "<|tool_call" not in text and "<think>" not in text and "</think>" not in text, text


def as_dicts(msgs):
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in msgs]


def test_agent_loop(client, enc):
    msgs = [{"role": "system", "content": "You are a weather agent."},
            {"role": "user", "content": "What's the weather in Paris?"}]
    # Turn 1: a named call is forced by prefilling its markers (after closing the <think> prefill).
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=12, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    rendered = jinja_kimi(msgs, TOOLS)
    assert rendered.endswith("<think>")
    prefill = "</think>" + SECTION + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    assert r.usage.prompt_tokens == n_tokens(enc, rendered + prefill)
    m = r.choices[0].message
    assert m.tool_calls and m.tool_calls[0].id == "functions.get_weather:0"
    assert m.tool_calls[0].type == "function" and m.tool_calls[0].function.name == "get_weather"
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    no_markers(m)

    # Turn 2: the agent runs the tool and sends back its call (with reasoning) and the result.
    msgs += [{"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
              "tool_calls": [{"id": m.tool_calls[0].id, "type": "function",
                              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "rain, 12 °C"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=16, seed=2)
    assert r.usage.prompt_tokens == n_tokens(enc, jinja_kimi(msgs, TOOLS))
    m2 = r.choices[0].message
    no_markers(m2)

    # Turn 3: the answer goes back into history (content + reasoning), a new question, a call required.
    msgs += [{"role": "assistant", "content": m2.content or "It rains.",
              "reasoning_content": getattr(m2, "reasoning_content", None) or "done"},
             {"role": "user", "content": "And in Oslo?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, seed=3, tool_choice="required")
    assert r.usage.prompt_tokens == n_tokens(enc, jinja_kimi(msgs, TOOLS) + "</think>" + SECTION)
    no_markers(r.choices[0].message)

    # tool_choice none: the tools stay declared (vLLM's default), nothing is parsed as a call.
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, seed=4, tool_choice="none")
    assert r.usage.prompt_tokens == n_tokens(enc, jinja_kimi(msgs, TOOLS))
    assert not r.choices[0].message.tool_calls

    # Thinking off: the generation prompt closes <think></think>; the named prefill then has no </think>.
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, seed=5,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.prompt_tokens == n_tokens(
        enc, jinja_kimi(msgs, TOOLS, thinking=False) + SECTION
        + "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>")


def test_streamed_named_call_sends_id_and_name_first(client):
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    kw = dict(model="tiny", messages=msgs, tools=TOOLS, max_tokens=10, seed=7,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].id == "functions.get_weather:0" and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert args == whole.tool_calls[0].function.arguments
