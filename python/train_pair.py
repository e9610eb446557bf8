#!/usr/bin/env python3
"""Trains a small, real Kimi-K2-architecture target and its DFlash drafter (issue 16 §1), offline.

One command builds, under --out:
  target/    config.json (Kimi K2 form, quantization_config), generation_config.json, shards of ≤ 6 MB
             model-0000i-of-0000n.safetensors + model.safetensors.index.json (routed experts INT4
             compressed-tensors pack-quantized g32, the rest bf16, router bias F32), tiktoken.model + tokenizer_config.json (a BPE trained here, Kimi's pat_str and
             specials), NOTICE (corpus packages, versions, licences, file-list hash), training.json
  drafter/   config.json (DFlashDraftModel, published form), model.safetensors (bf16), NOTICE
  eval_prompts.json   held-out prompts (ids + text) for check_pair.py and τ measurements
  summary.json        everything printed in the final summary
Steps: corpus (pair_corpus.py) → tokenizer (pair_tokenizer.py) → target training with the
DeepSeek-V3 router-bias update and INT4 save (pair_target.py) → greedy continuations and taps of the
INT4 target → drafter training with z-lab's DFlashDraftModel (pair_drafter.py) → held-out loss,
per-position top-1 accuracy and τ of z-lab's dflash_generate. Not bit-reproducible (GPU kernels,
time-bounded schedules); seeds are fixed.

On the GPU machine (torch, transformers 5.17, tokenizers, tiktoken, safetensors, numpy there; z-lab's
`dflash` is not, so carry its wheel in .whl/, made here with
  pip download --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps dflash==0.1.0 -d .whl):
  /opt/torch/.venv/bin/python3 -m pip install -q --no-index --find-links .whl --no-deps --target /tmp/pydeps dflash && \\
  PYTHONPATH=/tmp/pydeps /opt/torch/.venv/bin/python3 python/train_pair.py --out models/pair
  (--time-budget S scales the three timed phases, default 380 s of ~7 min wall; --target-steps,
  --draft-steps fix step counts instead)
On this CPU, end to end in about 2 minutes:
  /work/venv-torch/bin/python python/train_pair.py --tiny --out /tmp/pair-tiny
Then: python/check_pair.py OUT (kdtree vs HF parity, DDTree == AR). compressed-tensors is optional:
where installed, its pack/unpack and compressor are checked against ours (training.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import pair_corpus  # noqa: E402
import pair_drafter  # noqa: E402
import pair_target  # noqa: E402
import pair_tokenizer  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU proof run: small corpus, model and step counts")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 2 on CPU, 8 with CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=380.0,
                    help="seconds for the timed phases: 46%% target, 16%% greedy data, 24%% drafter (rest: overhead)")
    g = ap.add_argument_group("corpus and tokenizer")
    g.add_argument("--corpus-mb", type=float, default=0, help="cap the corpus (a sha256-ordered sample); 0 = all")
    g.add_argument("--holdout-mod", type=int, default=64, help="hold out files whose sha256 ≡ 0 mod this")
    g.add_argument("--ranks", type=int, default=6000, help="BPE base ranks (256 bytes + merges); vocab = ranks + 256")
    g.add_argument("--tok-sample-mb", type=float, default=24.0, help="text the BPE is trained on")
    g = ap.add_argument_group("target")
    for k, v in dict(hidden=256, layers=4, heads=4, experts=16, top_k=4, moe_intermediate=256, dense_intermediate=768,
                     q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64).items():
        g.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    g.add_argument("--seq", type=int, default=512)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--target-lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--bias-gamma", type=float, default=1e-3, help="router bias update speed (DeepSeek-V3's γ)")
    g.add_argument("--target-steps", type=int, default=0, help="fixed step count instead of the time budget")
    g.add_argument("--target-seconds", type=float, default=None)
    g.add_argument("--experts-impl", default=None, help="transformers experts_implementation for training "
                   "(default: the first of grouped_mm, eager that runs)")
    g = ap.add_argument_group("drafter")
    g.add_argument("--draft-layers", type=int, default=2)
    g.add_argument("--draft-heads", type=int, default=4)
    g.add_argument("--draft-kv-heads", type=int, default=2)
    g.add_argument("--draft-intermediate", type=int, default=768)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--taps", default=None, help="target layers tapped, e.g. 0,1,2 (default: all but the last)")
    g.add_argument("--loss-gamma", type=float, default=7.0, help="position weight exp(−(k−1)/γ) (7 for B = 16)")
    g.add_argument("--prompt-len", type=int, default=64, help="corpus tokens before the target's continuation")
    g.add_argument("--draft-seq", type=int, default=512, help="prompt + greedy continuation length")
    g.add_argument("--gen-batch", type=int, default=2048, help="prompts continued together (the loop is launch-bound)")
    g.add_argument("--tap-batch", type=int, default=256)
    g.add_argument("--gen-seqs", type=int, default=32768, help="at most this many training sequences "
                   "(their taps stay on the device: n·T·taps·hidden bf16, 25 GB at the defaults)")
    g.add_argument("--gen-seconds", type=float, default=None)
    g.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences for the accuracy table")
    g.add_argument("--n-blocks", type=int, default=32, help="anchors (blocks) per sequence and step")
    g.add_argument("--draft-batch", type=int, default=64)
    g.add_argument("--draft-lr", type=float, default=1e-3)
    g.add_argument("--draft-steps", type=int, default=0)
    g.add_argument("--draft-seconds", type=float, default=None)
    g.add_argument("--ref-prompts", type=int, default=4, help="prompts for dflash_generate's τ (0 = skip)")
    g.add_argument("--ref-tokens", type=int, default=128, help="tokens dflash_generate makes per prompt")
    g.add_argument("--log-every", type=int, default=50)
    a = ap.parse_args()
    if a.tiny:
        # A CPU proof of every step at toy scale (the engine checks need real shapes: group 32).
        tiny = dict(corpus_mb=6, ranks=1000, tok_sample_mb=2, hidden=64, layers=3, heads=4, experts=8, top_k=2,
                    moe_intermediate=64, dense_intermediate=128, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, seq=64, batch=8, target_steps=80, warmup=10,
                    draft_intermediate=128, block_size=8, loss_gamma=4.0, prompt_len=16, draft_seq=48,
                    gen_batch=16, tap_batch=16, gen_seqs=48, ref_tokens=32, eval_seqs=4, n_blocks=4, draft_batch=8, draft_steps=80,
                    ref_prompts=2, log_every=20, holdout_mod=16, bias_gamma=1e-2)
        for k, v in tiny.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    a.target_seconds = a.target_seconds or 0.46 * a.time_budget
    a.gen_seconds = a.gen_seconds or 0.16 * a.time_budget
    a.draft_seconds = a.draft_seconds or 0.24 * a.time_budget
    return a


def pick_experts_impl(model, a, device, amp) -> str:
    """The first transformers experts implementation that runs forward + backward here."""
    if a.experts_impl:
        model.set_experts_implementation(a.experts_impl)
        return a.experts_impl
    x = torch.randint(0, 100, (2, 32), device=device)
    # (not batched_mm: it gathers one weight matrix per token·k pair, tens of GB at a training batch)
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            with amp():
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            if torch.isfinite(loss):
                return impl
        except Exception as e:  # noqa: BLE001
            log(f"experts_implementation {impl} does not run here: {type(e).__name__}: {str(e)[:200]}")
    raise SystemExit("no experts implementation runs")


def versions() -> dict:
    import safetensors
    import tokenizers
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__, "numpy": np.__version__}
    for mod in ("tiktoken", "dflash", "compressed_tensors"):
        try:
            import importlib.metadata as md

            v[mod] = md.version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001
            v[mod] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def main():
    a = parse()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(a.threads or (8 if device.type == "cuda" else 2))
    torch.manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    else:
        amp = contextlib.nullcontext
    fp32 = contextlib.nullcontext  # the frozen INT4 target runs in fp32 (its greedy tokens are the labels)
    out = a.out
    tdir, ddir = out / "target", out / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    timing = {}

    # 1. Corpus.
    t = time.time()
    corpus = pair_corpus.collect(a.holdout_mod, int(a.corpus_mb * 1e6), log=log)
    if len(corpus.held_out) < 2:
        raise SystemExit("fewer than 2 held-out files: lower --holdout-mod")
    timing["corpus_s"] = time.time() - t

    # 2. Tokenizer.
    t = time.time()
    sample, nbytes = [], 0
    for f in sorted(corpus.train, key=lambda f: f.sha256):
        if nbytes > a.tok_sample_mb * 1e6:
            break
        sample.append(f.text)
        nbytes += len(f.text)
    ranks = pair_tokenizer.train_ranks(sample, a.ranks, log=log)
    n_base = pair_tokenizer.write(tdir, ranks)
    enc = pair_tokenizer.encoding(tdir)
    held_text = "".join(f.text for f in corpus.held_out)
    held_ids = enc.encode_ordinary(held_text)
    assert enc.decode(held_ids) == held_text, "tokenizer round trip failed on the held-out text"
    docs = enc.encode_ordinary_batch([f.text for f in corpus.train], num_threads=max(1, (os.cpu_count() or 2)))
    tokens = torch.from_numpy(pair_target.np_tokens(docs, n_base + 1)).to(device)
    held_docs = [enc.encode_ordinary(f.text) for f in corpus.held_out]
    held_tokens = torch.from_numpy(pair_target.np_tokens(held_docs, n_base + 1)).to(device)
    log(f"tokenizer: {n_base} ranks + 256 specials; train {tokens.numel():,} tokens "
        f"({corpus.n_bytes() / tokens.numel():.2f} bytes/token), held-out {held_tokens.numel():,}")
    timing["tokenizer_s"] = time.time() - t

    # 3. Target.
    t = time.time()
    tcfg = pair_target.target_config(n_base, a)
    model = pair_target.build_model(tcfg, device, "sdpa", "eager")
    impl = pick_experts_impl(model, a, device, amp)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters, experts_implementation {impl}, {device}")
    tstats = pair_target.train(model, tokens, held_tokens, a, amp, log)
    ck, items = pair_target.stored_checkpoint(model)
    del model
    pair_target.save(tdir, tcfg, ck)
    ct = pair_target.ct_check(items, 0 if a.tiny else 48)
    timing["target_s"] = time.time() - t

    # The INT4 target, as saved.
    target, _, _ = pair_target.load_int4(tdir, device, "sdpa", impl)
    for p in target.parameters():
        p.requires_grad_(False)
    held_int4 = pair_target.eval_loss(target, held_tokens, a.seq, 64, fp32)
    log(f"INT4 target: held-out loss {held_int4:.3f} (master weights {tstats['held_out_loss_master']:.3f}); "
        f"compressed-tensors cross-check: {ct.get('all_equal', ct.get('error'))}")

    # 4. Drafter.
    t = time.time()
    dcfg = pair_drafter.drafter_config(tcfg, a)
    taps = dcfg["dflash_config"]["target_layer_ids"]
    draft = pair_drafter.build(dcfg, ddir, device)
    gen = torch.Generator().manual_seed(a.seed + 1)
    P, T = a.prompt_len, a.draft_seq
    seqs, feats = pair_drafter.make_data(target, tokens, a.gen_seqs, P, T, a.gen_batch, a.tap_batch, a.gen_seconds,
                                         taps, fp32, gen, log)
    timing["drafter_data_s"] = time.time() - t
    # Held-out sequences: the start of each held-out file as the prompt.
    hp = [d[:P] for d in held_docs if len(d) >= P][: a.eval_seqs]
    held_prompts = torch.tensor(hp, device=device)
    held_seqs = pair_drafter.greedy(target, held_prompts, T - P, fp32)
    held_feats = pair_drafter.tap_features(target, held_seqs, taps, a.tap_batch, fp32)
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    t = time.time()
    dstats = pair_drafter.train(draft, seqs, feats, embed, lm_head, a, P, amp, log)
    pair_drafter.save(draft, ddir)
    timing["drafter_train_s"] = time.time() - t
    draft_bf16 = pair_drafter.build(dcfg, ddir, device)
    from safetensors.torch import load_file

    draft_bf16.load_state_dict({k: v.float() for k, v in load_file(str(ddir / "model.safetensors")).items()}, strict=True)
    draft_bf16.eval()
    acc = pair_drafter.accuracy(draft_bf16, held_seqs, held_feats, embed, lm_head, a, P, fp32)
    log(f"drafter (bf16 as saved) on {held_seqs.shape[0]} held-out sequences: per-position top-1 "
        f"{acc['per_position_top1']}, chain τ estimate {acc['chain_tau_estimate']}")

    # z-lab's own loader and generate loop on the saved files.
    ref = {}
    if a.ref_prompts:
        t = time.time()
        ref = pair_drafter.reference_tau(ddir, target, hp[: a.ref_prompts], a.ref_tokens, device)
        log(f"dflash_generate (DFlashDraftModel.from_pretrained) τ {ref['dflash_generate_tau_per_prompt']}, "
            f"output equals greedy {ref['equals_greedy']} ({time.time() - t:.0f} s)")

    # 5. Files next to the models, summary.
    eval_prompts = [{"file": f.path, "ids": d[:32], "text": enc.decode(d[:32])}
                    for f, d in zip(corpus.held_out, held_docs) if len(d) >= 32][:16]
    (out / "eval_prompts.json").write_text(json.dumps(eval_prompts, indent=1, ensure_ascii=False) + "\n")
    note = ("Made by kdtree python/train_pair.py " + " ".join(sys.argv[1:]) + f"\nversions: {json.dumps(versions())}")
    for d in (tdir, ddir):
        (d / "NOTICE").write_text(pair_corpus.notice(corpus, note))
    sz_t, sz_d = pair_target.sizes(tdir), pair_target.sizes(ddir)
    summary = {
        "versions": versions(), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "corpus": {"files": len(corpus.train) + len(corpus.held_out), "held_out_files": len(corpus.held_out),
                   "train_bytes": corpus.n_bytes(), "file_list_sha256": corpus.file_list_sha256,
                   "train_tokens": int(tokens.numel()), "held_out_tokens": int(held_tokens.numel())},
        "tokenizer": {"base_ranks": n_base, "vocab_size": tcfg["vocab_size"]},
        "target": {"parameters": n_params, "experts_implementation": impl, **tstats,
                   "held_out_loss_int4": held_int4, "compressed_tensors_check": ct},
        "drafter": {"config": {k: dcfg[k] for k in ("num_hidden_layers", "block_size", "dflash_config")},
                    "train_sequences": int(seqs.shape[0]), **dstats, "held_out": acc, "reference": ref},
        "bytes": {"target": sz_t, "drafter": sz_d, "total": sum(sz_t.values()) + sum(sz_d.values())},
        "timing_s": {k: round(v, 1) for k, v in timing.items()} | {"total": round(time.time() - T0, 1)},
    }
    (tdir / "training.json").write_text(json.dumps(summary["target"] | {"versions": summary["versions"],
                                                                        "corpus": summary["corpus"]}, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    mb = summary["bytes"]["total"] / 1e6
    print("\n== summary ==")
    print(f"corpus     {summary['corpus']['files']} files ({len(corpus.held_out)} held out), "
          f"{tokens.numel():,} train tokens, file-list sha256 {corpus.file_list_sha256[:16]}…")
    print(f"tokenizer  {n_base} ranks + 256 specials")
    print(f"target     {n_params / 1e6:.2f} M params, {tstats['steps']} steps, {tstats['tokens_per_s']:,} tok/s, "
          f"held-out loss {tstats['held_out_loss_master']:.3f} (fp32) / {held_int4:.3f} (INT4 as saved)")
    print(f"drafter    {dstats['steps']} steps on {seqs.shape[0]} sequences, final loss {dstats['final_loss']:.3f}")
    print(f"           per-position top-1 vs target greedy {acc['per_position_top1']}")
    print(f"           chain τ estimate {acc['chain_tau_estimate']}" +
          (f", dflash_generate τ {ref['dflash_generate_tau_mean']}" if ref else ""))
    print(f"size       target {sum(sz_t.values()) / 1e6:.2f} MB + drafter {sum(sz_d.values()) / 1e6:.2f} MB = {mb:.2f} MB"
          + ("" if mb <= 20 else "  (over the 20 MB aim)"))
    print(f"time       {summary['timing_s']}")
    print(f"wrote      {tdir} {ddir}")


if __name__ == "__main__":
    main()
