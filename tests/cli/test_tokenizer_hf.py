"""tokenizer.json (DeepSeek-V3 style byte-level BPE): `kdtree tokenize` gives the ids HF `tokenizers` gives.

Reference: Tokenizer.from_file(...).encode(s, add_special_tokens=False).ids, with
encode_special_tokens=True when kdtree runs without --parse-special (special added tokens are then
text; non-special added tokens such as <think> are matched either way, as tokenizers does).
Fixture: tests/fixtures/tokenizer-deepseek-small (python/make_hf_tokenizer.py).
"""
from __future__ import annotations

import glob
import gzip
import json
import random
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import BIN, FIXTURES, REPO  # noqa: E402

FIXTURE = FIXTURES / "tokenizer-deepseek-small"

SAMPLES = [
    "", " ", "\n", "Hello world", "  leading and trailing  ", "a\r\nb\rc\n\n\nd", "\t\tindented\n    code",
    "数字と漢字のテスト、そして한국어 문장도 있어요。", "中文分词测试：深度求索", "ひらがなカタカナ漢字ｶﾀｶﾅ",
    "🙂🌊🦓👩‍👩‍👧‍👦🇯🇵 emoji", "e\u0301 a\u0308 n\u0303 Z\u0351\u0358a\u0346l\u0352g\u035bo",
    "Привет, мир! Ελληνικά. עברית. العربية ١٢٣ हिन्दी ไทย",
    "1234567890" * 7, " " * 200_000 + "x", "\n \t" * 30_000, "3.14159 1,000,000 0x1F600 2024-12-26T10:00:00Z", " " * 300, "\n" * 50 + "x", "\t \u00a0\u2009\u3000 x",
    "x\u0085y\u2028z\u180e\u200b\ufeff", "'s 're I'M DON'T can't", "!!!abc ...Hello ?!?World", "a" * 2000,
    "<think>reasoning</think>answer", "<｜User｜>hi<｜Assistant｜>", "<｜begin▁of▁sentence｜><｜end▁of▁sentence｜>",
    "<｜User｜<｜User｜>>", "<think><think>", "\u00ff\u0100\u0120 Ġ Ċ",
]


def corpus() -> list[str]:
    texts = list(SAMPLES)
    # Documentation not used for training (the script reads the first 400 copyright files).
    for path in sorted(glob.glob("/usr/share/doc/*/copyright"))[400:520]:
        texts.append(open(path, "rb").read().decode("utf-8", errors="replace"))
    for path in sorted(glob.glob("/usr/share/doc/*/changelog*.gz"))[80:90]:
        texts.append(gzip.open(path).read().decode("utf-8", errors="replace")[:100_000])
    for path in sorted(glob.glob("/usr/include/c++/*/bits/*.h"))[:20] + sorted(glob.glob("/usr/lib/python3*/json/*.py"))[:5]:
        texts.append(open(path, "rb").read().decode("utf-8", errors="replace"))
    rnd = random.Random(1234)
    pool = "".join(texts[: len(SAMPLES)])
    for _ in range(300):  # shuffled slices of the samples mix scripts, marks and whitespace
        a = rnd.randrange(len(pool))
        texts.append(pool[a:a + rnd.randrange(1, 60)])
    return texts


CORPUS = corpus()


def kdtree_encode(model_dir, texts, parse_special=False, tmp_path=None) -> list[list[int]]:
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    args = [str(BIN), "tokenize", "-m", str(model_dir), "--file", str(f), "--jsonl"]
    if parse_special:
        args.append("--parse-special")
    p = subprocess.run(args, capture_output=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    lines = p.stdout.decode("utf-8").split("\n")[:-1]  # not splitlines(): U+2028 and U+0085 stay raw in JSON
    # --jsonl skips empty input lines only; every text here is a non-empty JSON line
    assert len(lines) == len(texts)
    return [json.loads(line)["ids"] for line in lines]


def kdtree_decode(model_dir, ids_list, tmp_path) -> list[str]:
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps(ids) + "\n" for ids in ids_list))
    p = subprocess.run([str(BIN), "tokenize", "-m", str(model_dir), "--file", str(f), "--jsonl", "--decode"],
                       capture_output=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return [json.loads(line)["text"] for line in p.stdout.decode("utf-8").split("\n")[:-1]]


def hf_encode(model_dir, texts, parse_special=False) -> list[list[int]]:
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.encode_special_tokens = not parse_special
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def assert_same(texts, got, want):
    bad = [i for i in range(len(texts)) if got[i] != want[i]]
    if bad:
        i = bad[0]
        k = next(j for j in range(len(got[i]) + 1) if j >= min(len(got[i]), len(want[i])) or got[i][j] != want[i][j])
        pytest.fail(f"{len(bad)}/{len(texts)} texts differ; first {texts[i][:120]!r}: at token {k} kdtree "
                    f"{got[i][max(0, k - 3):k + 5]} vs tokenizers {want[i][max(0, k - 3):k + 5]}")


@pytest.mark.parametrize("parse_special", [False, True], ids=["text", "parse_special"])
def test_ids_match_tokenizers_on_corpus(parse_special, tmp_path):
    assert sum(len(t) for t in CORPUS) > 1_000_000
    assert_same(CORPUS, kdtree_encode(FIXTURE, CORPUS, parse_special, tmp_path), hf_encode(FIXTURE, CORPUS, parse_special))


def test_decode_of_encode_is_identity(tmp_path):
    ids = kdtree_encode(FIXTURE, CORPUS, False, tmp_path)
    assert kdtree_decode(FIXTURE, ids, tmp_path) == CORPUS


def variant(tmp_path, name, edit):
    j = json.loads((FIXTURE / "tokenizer.json").read_text(encoding="utf-8"))
    edit(j)
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    return d


def _string_merges(j):
    j["model"]["merges"] = [f"{a} {b}" for a, b in j["model"]["merges"]]


def _gpt2_byte_level(j):
    j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _ignore_merges(j):
    j["model"]["ignore_merges"] = True


@pytest.mark.parametrize("edit", [_string_merges, _gpt2_byte_level, _ignore_merges],
                         ids=["string_merges", "bytelevel_use_regex", "ignore_merges"])
def test_variants_match_tokenizers(edit, tmp_path):
    d = variant(tmp_path, edit.__name__, edit)
    texts = CORPUS[:60] + CORPUS[-300:]
    assert_same(texts, kdtree_encode(d, texts, False, tmp_path), hf_encode(d, texts, False))


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
WORDY = st.lists(st.sampled_from(["the", " the", "数字", "🙂", "\r\n", "  ", "123", "4567", "'s", "!!", "é", "\u0301",
                                  "<think>", "<｜User｜>", "\t", "Ab", "ÅB", "_x", "\u3000"]), min_size=1, max_size=30).map("".join)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.one_of(TEXT, WORDY), min_size=40, max_size=40), parse_special=st.booleans())
def test_ids_match_tokenizers_on_random_strings(texts, parse_special, tmp_path):
    got = kdtree_encode(FIXTURE, texts, parse_special, tmp_path)
    assert_same(texts, got, hf_encode(FIXTURE, texts, parse_special))
    assert kdtree_decode(FIXTURE, got, tmp_path) == texts
