"""A Kimi-format byte-level BPE (tiktoken.model + tokenizer_config.json) trained on the pair corpus.

Pre-tokenisation is Kimi's pat_str (make_tokenizer.PAT_STR) run by the `regex` module, as tiktoken
runs it at encode time. The merges are learnt by HF `tokenizers`' BpeTrainer (Rust, seconds for tens of
MB) on those pre-tokens: each pre-token is written in GPT-2's byte-to-unicode alphabet, which has no
ASCII space, so pre-tokens joined by spaces and split again by a whitespace pre-tokenizer reach the
trainer exactly as they were. Ranks: the 256 single bytes in byte order, then one rank per new token
in merge order (a merge that makes an existing token again is skipped). tiktoken then encodes by
merging the lowest-ranked adjacent pair, which is the same merge order. Specials follow Kimi's
offsets from the end of the base ranks (make_tokenizer.KIMI_SPECIALS: [BOS] = N, [EOS] = N+1, …,
[UNK] = N+254, [PAD] = N+255).
"""
from __future__ import annotations

import base64
import collections
import json
import os
from pathlib import Path

import regex

from make_tokenizer import KIMI_SPECIALS, PAT_STR


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (printable Latin-1 bytes map to themselves,
    the rest to U+0100.. in byte order); none of its characters is whitespace."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _count(texts: list[str]) -> collections.Counter:
    pat = regex.compile(PAT_STR, flags=regex.V1)
    counts: collections.Counter = collections.Counter()
    for t in texts:
        counts.update(pat.findall(t))
    return counts


def train_ranks(texts: list[str], n_ranks: int, log=print) -> list[bytes]:
    """Returns the token byte strings in rank order (len <= n_ranks; the first 256 are the bytes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    n_proc = max(1, min(16, (os.cpu_count() or 1) - 1))
    if n_proc > 2 and len(texts) > 64:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(n_proc) as pool:
            parts = pool.map(_count, [texts[i::n_proc] for i in range(n_proc)])
        counts = parts[0]
        for p in parts[1:]:
            counts.update(p)
    else:
        counts = _count(texts)
    to_uni = _byte_alphabet()
    from_uni = {v: k for k, v in to_uni.items()}
    assert not any(c.isspace() for c in to_uni.values())

    def chunks():
        buf, size = [], 0
        for w, c in counts.items():
            m = "".join(to_uni[b] for b in w.encode("utf-8")) + " "
            while c > 0:
                k = min(c, max(1, 1_000_000 // len(m)))
                buf.append(m * k)
                size += len(m) * k
                c -= k
                if size > 4_000_000:
                    yield buf
                    buf, size = [], 0
        if buf:
            yield buf

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, min_frequency=2, show_progress=False,
                                  initial_alphabet=list(to_uni.values()), special_tokens=[])
    tok.train_from_iterator(chunks(), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    ranks = [bytes([b]) for b in range(256)]
    have = set(ranks)
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        t = bytes(from_uni[ch] for ch in a + b)
        if t not in have:
            have.add(t)
            ranks.append(t)
        if len(ranks) >= n_ranks:
            break
    log(f"tokenizer: {len(counts)} distinct pre-tokens, {len(merges)} merges -> {len(ranks)} ranks")
    return ranks


def write(out_dir: Path, ranks: list[bytes]) -> int:
    """Writes tiktoken.model and tokenizer_config.json; returns the first special id N."""
    n = len(ranks)
    os.makedirs(out_dir, exist_ok=True)
    with open(out_dir / "tiktoken.model", "w") as f:
        for r, t in enumerate(ranks):
            f.write(f"{base64.b64encode(t).decode()} {r}\n")
    added = {str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for off, name in sorted(KIMI_SPECIALS.items())}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "unk_token": "[UNK]", "model_max_length": 131072, "tokenizer_class": "TikTokenTokenizer"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return n


def encoding(tok_dir: Path):
    """tiktoken.Encoding over DIR/tiktoken.model with Kimi's pat_str (no specials: the corpus never
    contains them as text; the training code inserts [EOS] ids itself)."""
    import tiktoken

    ranks = {}
    for line in (Path(tok_dir) / "tiktoken.model").read_text().splitlines():
        if line.strip():
            b, r = line.split()
            ranks[base64.b64decode(b)] = int(r)
    return tiktoken.Encoding("kdtree-pair", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
