"""`kdtree chat-template` renders exactly what Python jinja2 renders from the published chat templates.

The templates (tests/fixtures/chat-templates/, sources in its README) are rendered the way
transformers' apply_chat_template does: a sandboxed environment with trim_blocks, lstrip_blocks and
loopcontrols, and `tojson` as json.dumps(ensure_ascii=False); Kimi's tokenizer also deep-sorts the
tools' keys before rendering (tokenization_kimi.py's deep_sort_dict).
"""
from __future__ import annotations

import json
import subprocess

import pytest

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

from conftest import BIN, FIXTURES, REPO  # noqa: E402

TEMPLATES = FIXTURES / "chat-templates"


def deep_sort(x):
    if isinstance(x, dict):
        return {k: deep_sort(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [deep_sort(v) for v in x]
    return x


def jinja_render(name: str, messages, tools, thinking, add_generation_prompt=True, **extra) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    template = env.from_string((TEMPLATES / name).read_text(encoding="utf-8"))
    kwargs = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<｜begin▁of▁sentence｜>")
    if tools:
        kwargs["tools"] = deep_sort(tools) if "kimi" in name.lower() else tools
    if thinking is not None:
        kwargs["thinking"] = thinking
    kwargs.update(extra)  # e.g. tools_ts_str, preserve_thinking (test_chat_tools_ts.py)
    return template.render(**kwargs)


def kdtree_render(kind: str, messages, tools, thinking, tmp_path, add_generation_prompt=True) -> str:
    mfile = tmp_path / "messages.json"
    mfile.write_text(json.dumps(messages, ensure_ascii=False), encoding="utf-8")
    args = [str(BIN), "chat-template", "--template", kind, "--messages", str(mfile)]
    if tools:
        tfile = tmp_path / "tools.json"
        tfile.write_text(json.dumps(tools, ensure_ascii=False), encoding="utf-8")
        args += ["--tools", str(tfile)]
    if thinking is not None:
        args += ["--thinking", "on" if thinking else "off"]
    if not add_generation_prompt:
        args.append("--no-generation-prompt")
    p = subprocess.run(args, capture_output=True, timeout=30, cwd=REPO)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode("utf-8")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather — in °C, for a city (北京 too)",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7.5, "default": 1e-05}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]


def call(i, name, args):
    return {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi\r\nthere \t"}],
    "two_systems": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"},
                    {"role": "system", "content": "B"}, {"role": "user", "content": "r"}],
    "multi_turn": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                   {"role": "user", "content": "and 2+2?"}, {"role": "assistant", "content": "4"},
                   {"role": "user", "content": "数字と漢字 🙂"}],
    "named": [{"role": "user", "name": "alice", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "bye"}],
    "reasoning_history": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>x</think>a2", "reasoning_content": "newest thoughts"}],
    "tool_loop": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need both cities.",
         "tool_calls": [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_weather", '{"city":"東京"}')]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 12}'},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": '{"temp": 20}'}],
    "tool_loop_done": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call(0, "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
        {"role": "assistant", "content": "It rains.", "reasoning_content": "done"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "tool_calls": [call(1, "get_weather", '{"city": "Oslo", "days": 2}')],
         "reasoning_content": "call again"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "sun"}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}],
}


def normalise(messages):
    """The messages as the template sees them: a missing content is None (OpenAI's null)."""
    out = []
    for m in messages:
        m = dict(m)
        m.setdefault("content", None)
        out.append(m)
    return out


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_kimi_matches_jinja(conv, tools, thinking, tmp_path):
    messages = normalise(CONVERSATIONS[conv])
    want = jinja_render("kimi-k2.jinja", messages, tools, thinking)
    got = kdtree_render("kimi", messages, tools, thinking, tmp_path)
    assert got == want


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_deepseek_v3_matches_jinja(conv, tmp_path):
    if conv == "content_parts":
        pytest.skip("DeepSeek-V3's template concatenates content as a string")
    messages = normalise(CONVERSATIONS[conv])
    for m in messages:  # the template reads tool['type'] and string content
        if m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    want = jinja_render("deepseek-v3.jinja", messages, TOOLS, None)
    got = kdtree_render("deepseek-v3", messages, TOOLS, None, tmp_path)
    assert got == want


@pytest.mark.parametrize("kind,name", [("kimi", "kimi-k2.jinja"), ("deepseek-v3", "deepseek-v3.jinja")])
def test_no_generation_prompt(kind, name, tmp_path):
    messages = normalise(CONVERSATIONS["multi_turn"])
    want = jinja_render(name, messages, None, None, add_generation_prompt=False)
    assert kdtree_render(kind, messages, None, None, tmp_path, add_generation_prompt=False) == want


def test_kimi_facts_from_the_spec(tmp_path):
    """SPEC-MODEL.md §4: default system prompt, tool_declare, generation prompt, <think> prefill."""
    text = kdtree_render("kimi", [{"role": "user", "content": "hi"}], TOOLS[1:], None, tmp_path)
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function": {"name": "search"')
    assert "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>" in text
    assert text.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    off = kdtree_render("kimi", [{"role": "user", "content": "hi"}], None, False, tmp_path)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")


def test_bad_messages_name_the_field(tmp_path):
    mfile = tmp_path / "m.json"
    for body, expect in [('[{"role": "robot", "content": "x"}]', "messages[0].role"),
                         ('[{"role": "user", "content": 5}]', "messages[0].content"),
                         ('[{"role": "user"', "not valid JSON"),
                         ('[{"role": "assistant", "tool_calls": [{"id": "x"}]}]', "messages[0].tool_calls[0].function")]:
        mfile.write_text(body)
        p = subprocess.run([str(BIN), "chat-template", "--template", "kimi", "--messages", str(mfile)],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 1 and expect in p.stderr, (body, p.stderr)


# --- choosing the template from a checkpoint (chat_template.jinja or tokenizer_config.json) ---

KNOWN = {"moonshotai-Kimi-K2-Thinking.jinja": "kimi-k2-thinking", "kimi-k2.jinja": "kimi",
         "kimi-k25.jinja": "kimi-k25", "kimi-k26.jinja": "kimi-k26", "deepseek-v3.jinja": "deepseek-v3"}
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
         {"role": "user", "content": "q"}]


def render_dir(d, tmp_path, extra=()):
    mfile = tmp_path / "probe.json"
    mfile.write_text(json.dumps(PROBE))
    return subprocess.run([str(BIN), "chat-template", "-m", str(d), "--messages", str(mfile), *extra],
                          capture_output=True, timeout=30)


def checkpoint(tmp_path, files):
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text, encoding="utf-8")
    return d


@pytest.mark.parametrize("how", ["jinja_file", "config_string", "config_list", "crlf"])
@pytest.mark.parametrize("fixture", list(KNOWN))
def test_known_templates_are_recognised_exactly(fixture, how, tmp_path):
    text = (TEMPLATES / fixture).read_text(encoding="utf-8")
    if how == "jinja_file":
        files = {"chat_template.jinja": text}
    elif how == "config_string":
        files = {"tokenizer_config.json": json.dumps({"chat_template": text.rstrip("\n")})}
    elif how == "config_list":
        files = {"tokenizer_config.json": json.dumps({"chat_template": [
            {"name": "tool_use", "template": "x"}, {"name": "default", "template": text}]})}
    else:
        files = {"chat_template.jinja": text.replace("\n", "\r\n")}
    p = render_dir(checkpoint(tmp_path, files), tmp_path)
    assert p.returncode == 0 and p.stderr == b"", p.stderr  # no warning: known byte for byte
    want = jinja_render(fixture, normalise(PROBE), None, None)
    assert p.stdout.decode() == want


@pytest.mark.parametrize("fixture,kind", [("kimi-k25.jinja", "kimi-k25"), ("kimi-k26.jinja", "kimi-k26"),
                                          ("moonshotai-Kimi-K2-Thinking.jinja", "kimi-k2-thinking"),
                                          ("kimi-k2.jinja", "kimi"), ("deepseek-v3.jinja", "deepseek-v3")])
def test_near_templates_render_with_a_warning(fixture, kind, tmp_path):
    text = "{#- a local edit #}" + (TEMPLATES / fixture).read_text(encoding="utf-8")
    p = render_dir(checkpoint(tmp_path, {"chat_template.jinja": text}), tmp_path)
    err = p.stderr.decode()
    assert p.returncode == 0 and "warning" in err and f"rendering it as {kind}" in err and "--template" in err, err
    assert p.stdout.decode() == jinja_render(fixture, normalise(PROBE), None, None)  # the comment renders nothing


@pytest.mark.parametrize("text,expect", [
    ((FIXTURES / "chat-templates" / "kimi-k2.jinja").read_text().replace("last_non_tool_call_assistant_msg", "cut"),
     "unrecognised Kimi chat template"),
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "unrecognised chat template"),
    ("{{ bos_token }}{% for m in messages %}<｜User｜>{{ m.content }}<｜Assistant｜><think>\n{% endfor %}", "thinking"),
    ((FIXTURES / "chat-templates" / "deepseek-v3.jinja").read_text().replace("is_first_sp=true)", "is_first_sp=true, "
                                                                              "is_last_user=false)"), "revision"),
    ((FIXTURES / "chat-templates" / "deepseek-v3.jinja").read_text().replace("is_first_sp", "first_sp"), "revision"),
])
def test_unknown_templates_are_an_error(text, expect, tmp_path):
    p = render_dir(checkpoint(tmp_path, {"chat_template.jinja": text}), tmp_path)
    err = p.stderr.decode()
    assert p.returncode == 1 and expect in err and "--template" in err, err
    p = render_dir(tmp_path / "ckpt", tmp_path, ["--template", "kimi"])  # the way out the error names
    assert p.returncode == 0, p.stderr


def test_no_template_falls_back_to_the_tokenizer_family_with_a_warning(tmp_path):
    p = render_dir(FIXTURES / "tokenizer-kimi-small", tmp_path)
    assert p.returncode == 0 and b"no chat template" in p.stderr and b"using kimi" in p.stderr, p.stderr
    assert p.stdout.decode() == jinja_render("kimi-k2.jinja", normalise(PROBE), None, None)
    ds = checkpoint(tmp_path, {"tokenizer.json": (FIXTURES / "tokenizer-deepseek-small" / "tokenizer.json").read_text()})
    p = render_dir(ds, tmp_path)
    assert p.returncode == 0 and b"using deepseek-v3" in p.stderr, p.stderr
    (ds / "tokenizer.json").unlink()
    p = render_dir(tmp_path, tmp_path)  # nothing at all
    assert p.returncode == 1 and b"no chat template and no tokenizer" in p.stderr, p.stderr


def test_bad_tokenizer_config_template_field(tmp_path):
    for cfg, expect in [({"chat_template": 5}, "expected a string or a list"),
                        ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "named \"default\"")]:
        p = render_dir(checkpoint(tmp_path, {"tokenizer_config.json": json.dumps(cfg)}), tmp_path)
        assert p.returncode == 1 and expect in p.stderr.decode() and "tokenizer_config.json" in p.stderr.decode()


def test_fixture_hashes_in_the_binary_are_current():
    """chat.cpp's table of known templates is keyed by a hash of these files; a stale entry would
    make a fixture 'unknown', which test_known_templates_are_recognised_exactly would catch; this
    names the file to update."""
    for fixture in KNOWN:
        with open(TEMPLATES / fixture, encoding="utf-8", newline="") as f:
            text = f.read().replace("\r\n", "\n").rstrip(" \t\n\r\f\v")
        h = 0xcbf29ce484222325
        for b in text.encode():
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        src = (REPO / "src" / "tokenizer" / "chat.cpp").read_text(encoding="utf-8")
        assert f"0x{h:016x}ull" in src, f"update the hash of {fixture} in src/tokenizer/chat.cpp to 0x{h:016x}"


@pytest.mark.parametrize("kind,name", [("kimi", "kimi-k2.jinja"), ("kimi-k26", "kimi-k26.jinja"),
                                       ("kimi-k2-thinking", "moonshotai-Kimi-K2-Thinking.jinja")])
def test_null_reasoning_renders_like_jinja(kind, name, tmp_path):
    """A JSON-null reasoning_content is Python None, which the templates print as "None"."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [call(0, "search", "{}")]},
                {"role": "tool", "tool_call_id": "functions.search:0", "content": None}]
    want = jinja_render(name, messages, None, None)
    assert "<think>None</think>" in want
    assert kdtree_render(kind, messages, None, None, tmp_path) == want


@pytest.mark.parametrize("msg", [{"role": "user", "content": None}, {"role": "user"},
                                 {"role": "assistant", "content": None}, {"role": "system"}])
def test_deepseek_refuses_what_jinja_cannot_render(msg, tmp_path):
    mfile = tmp_path / "m.json"
    mfile.write_text(json.dumps([{"role": "user", "content": "hi"}, msg]))
    p = subprocess.run([str(BIN), "chat-template", "--template", "deepseek-v3", "--messages", str(mfile)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "messages[1].content" in p.stderr, p.stderr
    with pytest.raises(Exception):  # and jinja2 indeed fails on it
        jinja_render("deepseek-v3.jinja", [{"role": "user", "content": "hi"}, {"content": None, **msg}], None, None)


OBJ_ARGS = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.f:0", "type": "function",
                 "function": {"name": "f", "arguments": {"zeta": 1, "alpha": [2.5, {"y": None, "b": "é"}], "mid": True}}}]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "ok"}]


@pytest.mark.parametrize("kind,name", [("kimi", "kimi-k2.jinja"), ("kimi-k25", "kimi-k25.jinja"),
                                       ("kimi-k2-thinking", "moonshotai-Kimi-K2-Thinking.jinja")])
def test_object_arguments_keep_the_clients_key_order(kind, name, tmp_path):
    want = jinja_render(name, OBJ_ARGS, None, None)
    assert '{"zeta": 1, "alpha": [2.5, {"y": null, "b": "é"}], "mid": true}' in want
    assert kdtree_render(kind, OBJ_ARGS, None, None, tmp_path) == want


@pytest.mark.parametrize("change,expect", [("object", "arguments as an object"), ("no_type", "no type")])
def test_deepseek_refuses_tool_calls_its_template_cannot_concatenate(change, expect, tmp_path):
    msgs = json.loads(json.dumps(OBJ_ARGS))
    if change == "no_type":
        msgs[1]["tool_calls"][0]["function"]["arguments"] = "{}"
        del msgs[1]["tool_calls"][0]["type"]
    with pytest.raises(Exception):
        jinja_render("deepseek-v3.jinja", msgs, None, None)
    mfile = tmp_path / "m.json"
    mfile.write_text(json.dumps(msgs))
    p = subprocess.run([str(BIN), "chat-template", "--template", "deepseek-v3", "--messages", str(mfile)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "messages[1].tool_calls[0]" in p.stderr and expect in p.stderr, p.stderr


def test_deepseek_prints_the_tool_call_type(tmp_path):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "code_interpreter", "function": {"name": "run", "arguments": "{}"}}]}]
    want = jinja_render("deepseek-v3.jinja", msgs, None, None)
    assert "code_interpreter<｜tool▁sep｜>" in want
    assert kdtree_render("deepseek-v3", msgs, None, None, tmp_path) == want
