#!/usr/bin/env python3
"""Train the small DeepSeek-style tokenizer.json fixture (tests/fixtures/tokenizer-deepseek-small/).

A byte-level BPE trained with HF `tokenizers` on text found on this machine (/usr/share/common-licenses,
/usr/share/doc) plus CJK / emoji / combining-mark samples, with DeepSeek-V3's pre_tokenizer layout
(Sequence of three Split(Regex, Isolated) + ByteLevel(add_prefix_space=false, use_regex=false)), no
normalizer, a ByteLevel decoder, and DeepSeek's special and added tokens. tokenizer_config.json carries
DeepSeek-V3's chat template (tests/fixtures/chat-templates/deepseek-v3.jinja).

    build/venv-test/bin/python python/make_hf_tokenizer.py [--vocab-size 6000] [--out DIR]
"""
import argparse
import glob
import gzip
import json
import os
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DeepSeek-V3's three Split patterns as its tokenizer.json writes them (the third holds literal CR and
# LF characters inside its classes).
DEEPSEEK_V3_SPLITS = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]

# Specials first (ids 0..2 as in DeepSeek-V3), the chat and tool markers added after training.
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
ADDED_SPECIAL = ["<｜User｜>", "<｜Assistant｜>", "<|EOT|>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>"]
ADDED_PLAIN = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>", "<think>", "</think>",
]

SAMPLES = [
    "数字と漢字のテスト、そして한국어 문장도 있어요。中文分词测试：深度求索的分词器。",
    "我们今天去北京大学看看，天气很好！東京タワーは高いです。ひらがなカタカナ",
    "Emoji 🙂🌊🦓👩‍👩‍👧‍👦 and flags 🇯🇵🇫🇷, symbols €£¥ © ® ™ ∑ ∫ √ ≤ ≥ ≠ ∞",
    "Combining marks: e\u0301 a\u0308 n\u0303 — Zalgo: Z\u0351\u0358a\u0346l\u0352g\u035bo",
    "Привет, мир! Ελληνικά κείμενα. עברית ועוד. العربية ١٢٣ हिन्दी भाषा ไทย",
    "def main():\n    return {'key': [1, 2, 3]}  # code\r\n\r\n\tprint(main())\n",
    "Numbers 1234567890 3.14159 1,000,000 0x1F600 2024-12-26T10:00:00Z",
]


def corpus(max_bytes):
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob("/usr/share/doc/*/copyright"))[:400]
    files += sorted(glob.glob("/usr/share/doc/*/changelog*.gz"))[:80]
    total = 0
    for path in files:
        if not os.path.isfile(path):
            continue
        try:
            raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
        except OSError:
            continue
        text = raw.decode("utf-8", errors="replace")
        total += len(text)
        yield text
        if total > max_bytes:
            break
    for _ in range(20):
        yield from SAMPLES


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=6000)
    ap.add_argument("--max-corpus-bytes", type=int, default=6_000_000)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/tokenizer-deepseek-small"))
    args = ap.parse_args()

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_V3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(s, normalized=True, special=True) for s in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(args.max_corpus_bytes), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, normalized=True, special=True) for s in ADDED_SPECIAL])
    tok.add_tokens([AddedToken(s, normalized=True, special=False) for s in ADDED_PLAIN])

    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"), pretty=False)
    with open(os.path.join(ROOT, "tests/fixtures/chat-templates/deepseek-v3.jinja"), encoding="utf-8") as f:
        template = f.read()
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[2],
        "model_max_length": 16384,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": template,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    size = os.path.getsize(os.path.join(args.out, "tokenizer.json"))
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, tokenizer.json {size} bytes, "
          f"tokenizers {tokenizers.__version__}, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
