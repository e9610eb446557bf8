"""kdtree run with text: -p encodes with the checkpoint's tokenizer, --chat renders the chat
template first; the references are tiktoken (ids, decode) and jinja2 on Kimi's published template."""
import sys

import pytest
from conftest import FIXTURES, REPO, kdtree

tiktoken = pytest.importorskip("tiktoken")

sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "cli"))
from test_chat_template import jinja_render  # noqa: E402
from test_tokenizer_tiktoken import enc  # noqa: E402,F401  (the tiktoken reference, a pytest fixture)

TOK = FIXTURES / "tokenizer-kimi-small"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("text") / "tiny"
    kdtree("make-model", "--preset", "tiny", "--seed", "1", "-o", d, "--tokenizer", TOK, ok=True)
    return d


def test_prompt_text_is_encoded_like_tiktoken_and_output_decoded(model, enc):
    text = "Speculative decoding, token for token: 42 × 7 = 294 — 你好, 世界! 🙂\r\n"
    j = kdtree("run", "-m", model, "-p", text, "-n", "24", "--ignore-eos", "--json", ok=True).json()
    assert j["prompt_ids"] == enc.encode(text, disallowed_special=())
    assert j["text"] == enc.decode(j["output_ids"], errors="replace")
    plain = kdtree("run", "-m", model, "-p", text, "-n", "24", "--ignore-eos", "-q", ok=True)
    assert plain.stdout.rstrip("\n") == j["text"]  # streamed text equals the whole decode


def test_special_names_in_prompt_are_text_unless_asked(model, enc):
    text = "a <|im_end|> b"
    j = kdtree("run", "-m", model, "-p", text, "-n", "1", "--json", ok=True).json()
    assert j["prompt_ids"] == enc.encode(text, disallowed_special=())
    j = kdtree("run", "-m", model, "-p", text, "-n", "1", "--json", "--parse-special", ok=True).json()
    assert j["prompt_ids"] == enc.encode(text, allowed_special="all")


@pytest.mark.parametrize("system,thinking", [(None, None), ("Be brief.", None), (None, "off"), (None, "on")])
def test_chat_prompt_is_the_rendered_template(model, enc, system, thinking):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi there"}]
    want = enc.encode(jinja_render("kimi-k2.jinja", msgs, None, None if thinking is None else thinking == "on"),
                      allowed_special="all")
    args = ["run", "-m", model, "--chat", "Hi there", "-n", "2", "--json"]
    if system:
        args += ["--system", system]
    if thinking:
        args += ["--thinking", thinking]
    assert kdtree(*args, ok=True).json()["prompt_ids"] == want


def test_text_needs_a_tokenizer():
    r = kdtree("run", "-m", FIXTURES / "k2-int4", "-p", "hello", "-n", "2", ok=False)
    assert "no tokenizer" in r.stderr and "--prompt-ids" in r.stderr


def test_ddtree_prints_the_same_text(model):
    base = ["run", "-m", model, "-p", "Once upon a time", "-n", "32", "--ignore-eos", "--json"]
    ar = kdtree(*base, ok=True).json()
    sp = kdtree(*base, "--spec", "ddtree", "--draft", "synthetic:0.7,0.2", "--budget", "6", ok=True).json()
    assert sp["text"] == ar["text"] and sp["output_ids"] == ar["output_ids"]


def test_chat_uses_the_checkpoints_template_unless_told(tmp_path, enc):
    d = tmp_path / "tiny-k2t"
    kdtree("make-model", "--preset", "tiny", "--seed", "1", "-o", d, "--tokenizer", TOK, ok=True)
    (d / "chat_template.jinja").write_text(
        (FIXTURES / "chat-templates" / "moonshotai-Kimi-K2-Thinking.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    msgs = [{"role": "user", "content": "Hi there"}]
    r = kdtree("run", "-m", d, "--chat", "Hi there", "-n", "1", "--json", ok=True)
    assert r.json()["prompt_ids"] == enc.encode(jinja_render("moonshotai-Kimi-K2-Thinking.jinja", msgs, None, None),
                                                allowed_special="all")
    assert "warning" not in r.stderr  # known byte for byte
    r = kdtree("run", "-m", d, "--chat", "Hi there", "--template", "kimi-k25", "-n", "1", "--json", ok=True)
    assert r.json()["prompt_ids"] == enc.encode(jinja_render("kimi-k25.jinja", msgs, None, None), allowed_special="all")
    r = kdtree("run", "-m", d, "--chat", "Hi there", "--thinking", "off", "-n", "1", ok=False)
    assert "no thinking switch" in r.stderr  # K2-Thinking's template has no such variable
    r = kdtree("run", "-m", d, "-p", "Hi", "--template", "kimi", "-n", "1", ok=False)
    assert "only apply to --chat" in r.stderr
