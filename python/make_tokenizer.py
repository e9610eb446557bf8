#!/usr/bin/env python3
"""Trains a small byte-level BPE in Kimi's tiktoken format, for tests and the demo model.

Writes DIR/tiktoken.model (`base64(bytes) rank` lines, ranks 0..N-1: the 256 single bytes first, then
one rank per merge) and DIR/tokenizer_config.json whose added_tokens_decoder carries Kimi's special
tokens (SPEC-MODEL.md §4) at Kimi's offsets from the end of the base ranks: [BOS] = N, [EOS] = N+1,
<|im_end|> = N+2, ... [PAD] = N+255. tiktoken.load.load_tiktoken_bpe reads the model file.

The pre-tokenizer is Kimi's pat_str run by the `regex` module (V1 mode, which has `&&`); the training
text is what this machine has (/usr/share/common-licenses, /usr/share/doc copyright files, Python's
standard library sources) plus the multilingual samples below, capped at --max-bytes.

  build/venv-test/bin/python python/make_tokenizer.py --ranks 4000 tests/fixtures/tokenizer-kimi-small
"""
from __future__ import annotations

import argparse
import base64
import collections
import glob
import json
import os

import regex

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi's special tokens as offsets from the first special id (163584 in Kimi K2), SPEC-MODEL.md §4.
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

SAMPLES = [
    "自然语言处理是人工智能的一个重要领域。我们今天讨论大模型的推理效率，以及投机解码如何加速生成。",
    "北京是中国的首都。上海是一个国际化的大都市，人口超过两千万。中文、日本語、한국어。",
    "東京は日本の首都です。ひらがなとカタカナ、そして漢字を使います。コンピューターの速度。",
    "서울은 대한민국의 수도입니다. 한국어는 한글로 씁니다. 감사합니다!",
    "Москва — столица России. Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Ελληνικά γράμματα.",
    "مرحبا بالعالم. اللغة العربية تكتب من اليمين إلى اليسار.",
    "नमस्ते दुनिया। हिंदी देवनागरी लिपि में लिखी जाती है।",
    "Ça va? Déjà vu, naïve café, façade, Ångström, Zürich, São Paulo, Łódź, İstanbul.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 ❤️ ✨🚀🔥 🎉 and ✅ done.",
    "Combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 Z\u0351\u0352\u0353 ḁ̷͉",
    "Numbers 1234567890 3.14159 2,718,281 0x1F600 1e-9 -42 +7 100% 2024-05-09 12:34:56",
    "Windows line\r\nendings\r\n\r\nand tabs\t\tand   spaces    here",
    "def main(argv):\n    for i in range(10):\n        print(f'{i:>4}')  # comment\n    return 0\n",
    "int main(int argc, char** argv) { std::vector<int> v{1, 2, 3}; return v.size() > 2 ? 0 : 1; }",
    "I'm sure you're right; they've said it's what we'd do, and he'll know. DON'T SHOUT, IT'S LOUD.",
]


def corpus(max_bytes: int) -> str:
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob("/usr/share/doc/*/copyright"))[:200]
    files += sorted(glob.glob("/usr/lib/python3*/json/*.py")) + sorted(glob.glob("/usr/lib/python3*/textwrap.py"))
    parts = [s for s in SAMPLES for _ in range(20)]
    total = sum(len(p.encode()) for p in parts)
    for f in files:
        if total >= max_bytes or not os.path.isfile(f):
            continue
        try:
            t = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        t = t[: max(0, max_bytes - total)]
        parts.append(t)
        total += len(t.encode())
    return "\n".join(parts)


def train(text: str, n_ranks: int) -> list[bytes]:
    pat = regex.compile(PAT_STR, flags=regex.V1)
    counts = collections.Counter(m.group(0).encode() for m in pat.finditer(text))
    words = [[[bytes([x]) for x in w], c] for w, c in counts.items()]
    vocab = [bytes([b]) for b in range(256)]
    have = set(vocab)
    pair_count: collections.Counter = collections.Counter()
    where: dict = collections.defaultdict(set)
    for i, (syms, c) in enumerate(words):
        for a, b in zip(syms, syms[1:]):
            pair_count[(a, b)] += c
            where[(a, b)].add(i)
    while len(vocab) < n_ranks and pair_count:
        best = max(pair_count.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if pair_count[best] <= 0:
            break
        merged = best[0] + best[1]
        if merged not in have:
            vocab.append(merged)
            have.add(merged)
        for i in list(where[best]):
            syms, c = words[i]
            for a, b in zip(syms, syms[1:]):
                pair_count[(a, b)] -= c
                if pair_count[(a, b)] <= 0:
                    del pair_count[(a, b)]
            out, k = [], 0
            while k < len(syms):
                if k + 1 < len(syms) and (syms[k], syms[k + 1]) == best:
                    out.append(merged)
                    k += 2
                else:
                    out.append(syms[k])
                    k += 1
            words[i][0] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += c
                where[(a, b)].add(i)
        where.pop(best, None)
        pair_count.pop(best, None)
    return vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=4000, help="base ranks (256 bytes + merges)")
    ap.add_argument("--max-bytes", type=int, default=1_500_000, help="training text cap")
    a = ap.parse_args()
    vocab = train(corpus(a.max_bytes), a.ranks)
    n = len(vocab)
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "tiktoken.model"), "w") as f:
        for rank, tok in enumerate(vocab):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    added = {str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for off, name in sorted(KIMI_SPECIALS.items())}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "unk_token": "[UNK]", "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(a.out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"{a.out_dir}: {n} base ranks, specials {n}..{n + 255}")


if __name__ == "__main__":
    main()
