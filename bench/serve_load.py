#!/usr/bin/env python3
"""Load generator for `kdtree serve`: throughput and TTFT / TPOT percentiles vs concurrency, and TTFT
with and without a prefix-cache hit on a long shared prefix.

  build/venv-test/bin/python bench/serve_load.py [--bin build/release/kdtree] [--preset small]
      [--concurrency 1,2,4,8,16,32,64] [--max-tokens 32] [--parallel 16] [--url http://host:port]
      [--draft [DIR]] [--budget N] [--no-prefix-test] [--device cpu|cuda]

--draft serves with DDTree speculation: DIR is a DFlash drafter checkpoint; without DIR one is made
for the model (`kdtree make-model --drafter-for MODEL --seed 0`: random weights, so its acceptance
is low; the mean accepted length from /metrics is printed with the tables).

Without --url it makes the model (`kdtree make-model --preset PRESET` with the fixture tokenizer),
starts `kdtree serve` on a free port and stops it at the end. Clients are threads speaking raw
HTTP/1.1 (stdlib http.client) with streaming on, so TTFT is the arrival of the first SSE event that
carries text, measured at the client; TPOT = (last token − first token) / (tokens − 1) per request.
Every request uses ignore_eos, so each generates exactly --max-tokens tokens. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("alpha beta gamma delta tree draft verify accept token cache batch stream latency throughput "
         "kernel memory expert router attention latent block prefix agent tool reason").split()


def text_of(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class Target:
    def __init__(self, url: str):
        m = re.match(r"http://([^:/]+):(\d+)", url)
        if not m:
            sys.exit(f"--url {url}: expected http://HOST:PORT")
        self.host, self.port = m.group(1), int(m.group(2))

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", "/metrics")
        out = {}
        for line in conn.getresponse().read().decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stream(self, body: dict) -> dict:
        """One streamed completion: client-side times of the first text and the end, token count."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        t_first, usage, buf = None, None, b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[len(b"data: "):]
                if data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("choices") and obj["choices"][0].get("text") and t_first is None:
                    t_first = time.perf_counter()
                if obj.get("usage"):
                    usage = obj["usage"]
        t_end = time.perf_counter()
        conn.close()
        n = usage["completion_tokens"] if usage else 0
        t_first = t_first or t_end
        return {"ttft": t_first - t0, "e2e": t_end - t0, "n": n,
                "tpot": (t_end - t_first) / (n - 1) if n > 1 else None,
                "cached": usage["prompt_tokens_details"]["cached_tokens"] if usage else 0}


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_level(t: Target, conc: int, n_req: int, max_tokens: int, prompt_words: int, seed: int):
    rng = random.Random(seed)
    prompts = [text_of(prompt_words, rng) for _ in range(n_req)]
    results, lock, idx = [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                if idx[0] >= n_req:
                    return
                i = idx[0]
                idx[0] += 1
            r = t.stream({"prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8,
                          "seed": i})
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    toks = sum(r["n"] for r in results)
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    return {"conc": conc, "requests": len(results), "tok_s": toks / wall, "req_s": len(results) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p90": pct(tpot, 90), "tpot_p99": pct(tpot, 99)}


def prefix_ttft(t: Target, prefix_words: int, reps: int):
    """TTFT of a request whose long prefix is new (miss) vs one whose prefix is cached (hit)."""
    rng = random.Random(1)
    miss, hit, cached = [], [], []
    for i in range(reps):
        prefix = text_of(prefix_words, rng)  # a fresh prefix: nothing cached
        body = {"prompt": prefix + f" question {i}", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
        miss.append(t.stream(body)["ttft"] * 1e3)
        r = t.stream({**body, "prompt": prefix + f" another question {i}"})  # same prefix, new tail
        hit.append(r["ttft"] * 1e3)
        cached.append(r["cached"])
    return statistics.median(miss), statistics.median(hit), statistics.median(cached)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(REPO / "build" / "release" / "kdtree"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--url", help="an already running server (then --bin/--preset/--parallel are not used)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--requests", type=int, default=0, help="per level (default: max(8, 2 × concurrency))")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="the server's --device (cpu or cuda)")
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--prefix-reps", type=int, default=3)
    ap.add_argument("--no-prefix-test", action="store_true", help="skip the prefix-cache TTFT measurement")
    ap.add_argument("--draft", nargs="?", const="make", help="DDTree with this DFlash drafter (no value: make one)")
    ap.add_argument("--budget", type=int, default=0, help="with --draft: DDTree nodes per round (default: the server's)")
    a = ap.parse_args()

    proc = None
    if a.url:
        t = Target(a.url)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="kdtree-serve-bench-"))
        model = tmp / a.preset
        # The preset's shape with the fixture tokenizer's vocabulary (4256 ids, Kimi specials from 4000),
        # so that text prompts work on presets whose own vocabulary is smaller.
        shape = tmp / "shape"
        subprocess.run([a.bin, "make-model", "-q", "--preset", a.preset, "--seed", "0", "-o", str(shape), "--force"],
                       check=True)
        cfg = json.loads((shape / "config.json").read_text())
        cfg.update(vocab_size=max(cfg["vocab_size"], 4256), bos_token_id=4000, eos_token_id=4001)
        (tmp / "config.json").write_text(json.dumps(cfg))
        subprocess.run([a.bin, "make-model", "-q", "--config", str(tmp / "config.json"), "--seed", "0", "-o", str(model),
                        "--force", "--tokenizer", str(REPO / "tests" / "fixtures" / "tokenizer-kimi-small")], check=True)
        spec = []
        if a.draft:
            draft = Path(a.draft)
            if a.draft == "make":
                draft = tmp / "dflash"
                subprocess.run([a.bin, "make-model", "-q", "--drafter-for", str(model), "--seed", "0", "-o", str(draft),
                                "--force"], check=True)
            spec = ["--draft", str(draft)] + (["--budget", str(a.budget)] if a.budget else [])
        log = tmp / "serve.log"
        proc = subprocess.Popen([a.bin, "serve", "-m", str(model), "--port", "0", "--parallel", str(a.parallel),
                                 "--max-queue", "1024", "-c", "8192", "--device", a.device, *spec], stderr=open(log, "w"))
        port = None
        for _ in range(600):
            m = re.search(r"listening on http://[^:]+:(\d+)", log.read_text())
            if m:
                port = int(m.group(1))
                break
            time.sleep(0.05)
        t = Target(f"http://127.0.0.1:{port}")
        for _ in range(1200):
            c = http.client.HTTPConnection("127.0.0.1", port)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
            time.sleep(0.1)
    try:
        decoding = f"DDTree ({a.draft}{f', budget {a.budget}' if a.budget else ''})" if a.draft else "AR"
        print(f"# kdtree serve load — preset {a.preset}, {a.max_tokens} new tokens/request, ~{a.prompt_words}-word "
              f"prompts, --parallel {a.parallel}, {decoding}, --device {a.device}, {os.cpu_count()} CPUs\n")
        print("| concurrency | requests | tok/s | req/s | TTFT p50 ms | p90 | p99 | TPOT p50 ms | p90 | p99 |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        t.stream({"prompt": "warm up", "max_tokens": 4, "ignore_eos": True})
        for conc in [int(x) for x in a.concurrency.split(",")]:
            r = run_level(t, conc, a.requests or max(8, 2 * conc), a.max_tokens, a.prompt_words, conc)
            print(f"| {r['conc']} | {r['requests']} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50']:.1f} | "
                  f"{r['ttft_p90']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.2f} | {r['tpot_p90']:.2f} | {r['tpot_p99']:.2f} |",
                  flush=True)
        spec_stats = t.metrics()
        if spec_stats.get("kdtree_spec_rounds_total"):
            print(f"\nSpeculation over the run: {spec_stats['kdtree_spec_rounds_total']:.0f} rounds, mean accepted length "
                  f"{spec_stats['kdtree_spec_mean_accepted_length']:.2f} tokens/round")
        if a.no_prefix_test:
            return
        miss, hit, cached = prefix_ttft(t, a.prefix_words, a.prefix_reps)
        print(f"\nTTFT on a ~{a.prefix_words}-word shared prefix (median of {a.prefix_reps}): "
              f"miss {miss:.1f} ms, hit {hit:.1f} ms ({cached:.0f} prompt tokens from the cache), {miss / hit:.2f}×")
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=60)
            shutil.rmtree(tmp, ignore_errors=True)  # the model (and drafter): tens of MB a run


if __name__ == "__main__":
    main()
