"""`kdtree tokenize` against tiktoken (PyPI, Rust core) as the reference, on the project's small
Kimi-format tokenizer (tests/fixtures/tokenizer-kimi-small, made by python/make_tokenizer.py).

The reference is built exactly as tokenization_kimi.py builds Kimi's: tiktoken.Encoding with Kimi's
pat_str, the file's ranks, and 256 special slots after them named from added_tokens_decoder, the rest
`<|reserved_token_ID|>`. Ids must be equal on a large varied corpus and on hypothesis-generated text.

Known difference, not tested: code points first assigned after Unicode 14 (PCRE2 10.42's tables; the
Rust regex crate under tiktoken has newer ones) can be classed differently by the pre-tokenizer.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, kdtree

tiktoken = pytest.importorskip("tiktoken")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

sys.path.insert(0, str(REPO / "python"))
from make_tokenizer import PAT_STR  # noqa: E402  (Kimi's pat_str, as tokenization_kimi.py has it)

TOK = FIXTURES / "tokenizer-kimi-small"


@pytest.fixture(scope="module")
def enc():
    ranks = load_tiktoken_bpe(str(TOK / "tiktoken.model"))
    n = len(ranks)
    named = json.loads((TOK / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {named.get(str(i), {}).get("content", f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("kimi-small", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def encode_many(texts: list[str], tmp_path: Path, *extra) -> list[list[int]]:
    """One kdtree process for many strings (--jsonl), so hypothesis can afford hundreds."""
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    r = kdtree("tokenize", "-m", TOK, "--file", f, "--jsonl", *extra, ok=True)
    lines = r.stdout.split("\n")[:-1]  # not splitlines(): U+2028 and U+0085 can sit inside the JSON
    assert len(lines) == len(texts), str(r)
    return [json.loads(line)["ids"] for line in lines]


def decode_many(ids: list[list[int]], tmp_path: Path) -> list[str]:
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps(i) + "\n" for i in ids))
    r = kdtree("tokenize", "-m", TOK, "--file", f, "--jsonl", "--decode", ok=True)
    return [json.loads(line)["text"] for line in r.stdout.split("\n")[:-1]]


def first_difference(enc, want: list[int], got: list[int]) -> str:
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"first difference at token {k}: tiktoken {want[k:k + 6]} vs kdtree {got[k:k + 6]}, "
            f"near {enc.decode(want[max(0, k - 8):k + 8])!r}")


# Cases aimed at the pre-tokenizer's corners: Han vs CJK punctuation (Script, not Script_Extensions),
# contractions (and U+017F, which folds to s), White_Space (U+180E is not; U+00A0 and U+3000 are),
# marks, letters of every case, digit runs, CR/LF runs, long whitespace.
CORNERS = [
    "", " ", "a", "\n", "\r\n", "  \n", " \r\n\r\n  x", "x  ", "x \t ", "\t\t\tx", "a\u00a0b", "a\u3000b",
    "a\u180eb", "\u180e ", "\u2028\u2029", "\x85x", "\x0b\x0c", "don't I'M we'Ve THEY'LL it'ſ o'D 'S",
    "中文、日本語。「引用」〆々〇〻ー", "漢字かなカナ한글", "\u3001\u3002", "\U00020000\U0002A700", "⺀⼀",
    "e\u0301\u0301 \u0301\u0301 A\u0301b ǅungla ǅ ʰʰ ʰa Ⅻⅻ", "\u0301", "1 12 123 1234 12345678901234567890 ١٢٣٤ ⅷ ²³",
    "x" * 3000, "ab" * 2000, " " * 5000 + "x", "\n" * 300 + " ", "😀" * 500, "1" * 1000,
    "<|im_end|> [BOS]<think></think>", "<|reserved_token_4010|>", "a'sb", "'s", "''''", "!!!\n\n\n!!!",
    "Ωμέγα ΣΊΣΥΦΟΣ σίσυφος", "İıŞşĞğ", "ﬁ ﬂ ẞß", "\U0001F1EB\U0001F1F7 👨‍👩‍👧‍👦 👍🏽",
]


def machine_corpus() -> str:
    """A few hundred KB of what this machine has: docs (plain and gzipped), the project's source."""
    parts, total = [], 0
    files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/README*"))[:40]
    files += sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz"))[:40]
    files += sorted(glob.glob(str(REPO / "src" / "*" / "*.cpp")))[:30] + sorted(glob.glob(str(REPO / "python" / "*.py")))
    for f in files:
        if total > 600_000:
            break
        try:
            raw = gzip.open(f).read() if f.endswith(".gz") else open(f, "rb").read()
            t = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        parts.append(t)
        total += len(raw)
    return "\n".join(parts)


def test_corner_cases_match_tiktoken(enc, tmp_path):
    got = encode_many(CORNERS, tmp_path)
    for text, ids in zip(CORNERS, got):
        want = enc.encode_ordinary(text)
        assert ids == want, f"{text[:60]!r}: " + first_difference(enc, want, ids)


def test_large_corpus_matches_tiktoken(enc, tmp_path):
    from make_tokenizer import SAMPLES
    text = machine_corpus() + "\n".join(SAMPLES * 3) + "\r\n".join(CORNERS)
    f = tmp_path / "corpus.txt"
    f.write_bytes(text.encode("utf-8"))
    got = kdtree("tokenize", "-m", TOK, "--file", f, "--json", ok=True).json()
    want = enc.encode_ordinary(text)
    assert len(text) > 300_000
    assert got["n_tokens"] == len(want)
    assert got["ids"] == want, first_difference(enc, want, got["ids"])


def test_roundtrip_decode_encode(tmp_path):
    texts = CORNERS + ["héllo wörld 😀 中文", "tab\tnew\nline\r\n"]
    ids = encode_many(texts, tmp_path)
    assert decode_many(ids, tmp_path) == texts


# Hypothesis: arbitrary assigned code points (Python 3.11's Unicode 14, as PCRE2 10.42), and text
# drawn from the characters where the pre-tokenizer's alternatives meet.
ASSIGNED = st.characters(exclude_categories=("Cs", "Cn"))
TRICKY = st.sampled_from(list(" \t\r\n\x0b\x0c\x85\xa0\u180e\u2028\u3000'sStTdDlLvVrReEmMſ0123456789٣Ⅻ"
                              "aZǅʰ中、。日々〇😀👍🏽\u0301\u0308!?.,-_<>|[]()#\"") + ["\r\n", "'s", "'LL", "<|im_end|>"])
TEXT = st.one_of(st.text(ASSIGNED, max_size=60), st.lists(TRICKY, max_size=40).map("".join),
                 st.lists(st.one_of(TRICKY, ASSIGNED), max_size=60).map("".join))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXT, min_size=1, max_size=40))
def test_hypothesis_strings_match_tiktoken(enc, tmp_path, texts):
    got = encode_many(texts, tmp_path)
    for text, ids in zip(texts, got):
        assert ids == enc.encode_ordinary(text), f"{text!r}: " + first_difference(enc, enc.encode_ordinary(text), ids)
    assert decode_many(got, tmp_path) == texts


def test_special_tokens_only_with_parse_special(enc, tmp_path):
    text = "<|im_user|>user<|im_middle|>hi [BOS]<think>x</think><|im_end|>  <|reserved_token_4100|>[PAD]"
    plain, special = encode_many([text], tmp_path)[0], encode_many([text], tmp_path, "--parse-special")[0]
    assert plain == enc.encode(text, disallowed_special=())
    assert special == enc.encode(text, allowed_special="all")
    n = enc.n_vocab - 256
    assert special[0] == n + 3 and n + 17 in special and n + 2 in special and 4100 in special and special[-1] == n + 255
    assert max(plain) < n


def test_special_and_reserved_names_decode():
    n = len(load_tiktoken_bpe(str(TOK / "tiktoken.model")))
    r = kdtree("tokenize", "-m", TOK, "--decode", "--text", f"{n},{n + 2},{n + 5},{n + 255}", "--json", ok=True)
    assert r.json()["text"] == f"[BOS]<|im_end|><|reserved_token_{n + 5}|>[PAD]"


def test_cli_errors_are_clean(tmp_path):
    kdtree("tokenize", "-m", TOK, "--decode", "--text", "1,99999999", ok=False)
    kdtree("tokenize", "-m", TOK, "--decode", "--text", "1,x", ok=False)
    kdtree("tokenize", "-m", tmp_path, "--text", "x", ok=False)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe here")
    r = kdtree("tokenize", "-m", TOK, "--file", bad, ok=False)
    assert "byte offset 3" in r.stderr
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tiktoken.model").write_text("QQ== 0\n!!notbase64 1\n")
    r = kdtree("tokenize", "-m", d, "--text", "x", ok=False)
    assert "tiktoken.model:2" in r.stderr and "base64" in r.stderr


def test_text_and_json_outputs_agree(enc):
    text = "Hello, world! 你好世界 😀"
    plain = kdtree("tokenize", "-m", TOK, "--text", text, ok=True).stdout.strip()
    js = kdtree("tokenize", "-m", TOK, "--text", text, "--json", ok=True).json()
    assert [int(x) for x in plain.split(",")] == js["ids"] == enc.encode_ordinary(text)
    assert js["n_tokens"] == len(js["ids"])
    back = kdtree("tokenize", "-m", TOK, "--decode", "--text", plain, ok=True).stdout
    assert back == text + "\n"
