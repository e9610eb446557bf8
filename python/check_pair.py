#!/usr/bin/env python3
"""Parity of kdtree with independent references on a pair made by python/train_pair.py.

  python/check_pair.py OUT [--kdtree build/release/kdtree] [--device cpu|cuda] [--prompts 4] [-n 48]

For each held-out prompt of OUT/eval_prompts.json:
- logits: `kdtree run --prompt-ids P --ignore-eos -n N --dump-logits` against HF transformers'
  DeepseekV3ForCausalLM on the INT4 target as saved (fp32, eager attention and experts, experts
  dequantised exactly), teacher-forced on the prompt + kdtree's tokens in one forward: max |Δ| and
  max |Δ| / max |HF|, and greedy agreement (HF's argmax of each row vs kdtree's token). Fails when
  the relative difference exceeds --tol (default 1e-2, bf16 level) or a row whose HF top-1/top-2
  margin exceeds 2·max |Δ| of that row picks another token.
- speculation: `--spec ddtree --budget 8` and `--spec dflash` must print the ids of plain AR;
  kdtree's chain round_tau is listed next to z-lab's dflash_generate acceptance lengths (greedy, the
  drafter loaded with DFlashDraftModel.from_pretrained, the HF INT4 target) on the same prompt —
  equal round for round where both produced the same tokens (informational, not a failure).
- tokenizer: `kdtree tokenize` ids equal tiktoken's on the prompt texts.
- checkpoint: compressed-tensors' PackedQuantizationCompressor.decompress of every expert: as stored
  it returns bf16, which must equal the exact fp32 (u−8)·scale that train_pair.py and the HF reference
  use, rounded to bf16; with the scale widened to fp32 it must equal that value exactly (skipped, and
  said so, without the package).
Exit status 1 on any failure. Needs torch, transformers, safetensors, tiktoken; dflash for the
reference rounds (skipped without it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import make_fixtures as mf  # noqa: E402
import pair_target  # noqa: E402
import pair_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def kd(binary, *args) -> dict:
    p = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"kdtree {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--kdtree", type=Path, default=REPO / "build" / "release" / "kdtree")
    ap.add_argument("--device", default="cpu", help="kdtree's --device")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--tol", type=float, default=1e-2, help="max |Δ| / max |HF| allowed")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tdir, ddir = a.out / "target", a.out / "drafter"
    prompts = json.loads((a.out / "eval_prompts.json").read_text())[: a.prompts]
    fails = []
    model, cfg, ck = pair_target.load_int4(tdir, "cpu", "eager", "eager")
    base = ["-t", a.threads, "run", "-m", tdir, "--ignore-eos", "-n", a.n, "--json", "--device", a.device]

    # Tokenizer.
    enc = pair_tokenizer.encoding(tdir)
    tok_ok = 0
    for p in prompts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(p["text"])
        ids = kd(a.kdtree, "tokenize", "-m", tdir, "--file", f.name, "--json")["ids"]
        tok_ok += int(ids == enc.encode_ordinary(p["text"]))
    print(f"tokenizer: kdtree tokenize == tiktoken on {tok_ok}/{len(prompts)} prompt texts")
    if tok_ok != len(prompts):
        fails.append("tokenizer")

    # Logits and speculation.
    worst_rel, agree, total, unsafe = 0.0, 0, 0, 0
    ref = None
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
        import dflash.model as dm

        dm._cuda_time = __import__("time").perf_counter  # CPU: the package's stats timer syncs CUDA
        ref = DFlashDraftModel.from_pretrained(str(ddir), dtype=torch.float32).eval()
    except ImportError as e:
        print(f"dflash package not importable ({e}): reference rounds skipped")
    for i, p in enumerate(prompts):
        ids = p["ids"]
        with tempfile.TemporaryDirectory() as td:
            dump = Path(td) / "logits.safetensors"
            ar = kd(a.kdtree, *base, "--prompt-ids", ",".join(map(str, ids)), "--dump-logits", dump)
            kl = torch.from_numpy(load_file(str(dump))["logits"])
        out = ar["output_ids"]
        with torch.no_grad():
            hf = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, len(ids) - 1:-1].float()
        diff = (kl - hf).abs()
        rel = float(diff.max() / hf.abs().max())
        top2 = hf.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        hf_tok = hf.argmax(-1)
        ok = hf_tok == torch.tensor(out)
        bad = (~ok) & (margin > 2 * diff.max(-1).values)
        worst_rel = max(worst_rel, rel)
        agree += int(ok.sum())
        total += len(out)
        unsafe += int(bad.sum())
        spec = {}
        for mode, extra in (("ddtree", ["--budget", 8]), ("dflash", [])):
            r = kd(a.kdtree, *base, "--prompt-ids", ",".join(map(str, ids)), "--spec", mode, "--draft", ddir, *extra)
            spec[mode] = r
            if r["output_ids"] != out:
                fails.append(f"prompt {i}: --spec {mode} output differs from AR")
        line = (f"prompt {i} ({p['file']}): max |Δ| {float(diff.max()):.3g}, rel {rel:.3g}, greedy agreement "
                f"{int(ok.sum())}/{len(out)}; τ ddtree(8) {spec['ddtree']['spec']['mean_accepted_length']:.2f}, "
                f"chain {spec['dflash']['spec']['mean_accepted_length']:.2f}")
        print(line)
        if ref is not None:
            with torch.no_grad():
                r = dflash_generate(ref, model, torch.tensor([ids]), a.n, None, temperature=0.0, return_stats=True)
            same_tokens = r.output_ids[0, len(ids):].tolist() == out
            rounds_k = spec["dflash"]["spec"].get("round_tau")
            print(f"  rounds: kdtree chain {rounds_k}\n          dflash_generate {r.acceptance_lengths}"
                  f"  (same tokens: {same_tokens}, same rounds: {rounds_k == r.acceptance_lengths})")
    print(f"logits: worst max |Δ| / max |HF| = {worst_rel:.3g} (tol {a.tol}); greedy agreement {agree}/{total}; "
          f"margin-safe disagreements {unsafe}")
    if worst_rel > a.tol:
        fails.append(f"logits differ by {worst_rel:.3g} relative (> {a.tol})")
    if unsafe:
        fails.append(f"{unsafe} greedy tokens differ where HF's margin exceeds 2·|Δ|")

    # compressed-tensors decompression of the saved experts.
    if mf.CT["available"]:
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
        names = sorted(k[: -len(".weight_packed")] for k in ck if k.endswith(".weight_packed"))
        n_bf16 = n_fp32 = 0
        for n in names:
            d = {s: ck[f"{n}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
            ours = mf.dequant_int4(d["weight_packed"], d["weight_scale"], d["weight_shape"].tolist())
            # As stored (bf16 scale), compressed-tensors returns bf16: our exact values rounded to bf16.
            dec = PackedQuantizationCompressor.decompress(d, scheme)["weight"]
            n_bf16 += int(dec.dtype == torch.bfloat16 and torch.equal(dec, ours.to(torch.bfloat16)))
            # With the scale widened to fp32 it computes (u−8)·scale in fp32: exactly our values.
            dec32 = PackedQuantizationCompressor.decompress(d | {"weight_scale": d["weight_scale"].float()}, scheme)["weight"]
            n_fp32 += int(torch.equal(dec32, ours))
        print(f"compressed-tensors {mf.CT['version']}: decompress of the {len(names)} expert matrices as stored equals ours "
              f"rounded to bf16 on {n_bf16}/{len(names)}; with the scale widened to fp32 equals ours exactly on "
              f"{n_fp32}/{len(names)}")
        if n_bf16 != len(names) or n_fp32 != len(names):
            fails.append("compressed-tensors decompression differs")
    else:
        print(f"compressed-tensors not installed ({mf.CT['error']}): decompression check skipped")

    print("FAIL: " + "; ".join(fails) if fails else "PASS")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
