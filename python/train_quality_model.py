#!/usr/bin/env python3
"""A small DeepSeek-V3 trained for the quality report (docs/perf.md "Quantization quality"; issue 19).

No trained model ships with kdtree, so this fits one for the purpose: a 3-layer DeepseekV3 (MLA,
8 routed experts top-2 + 1 shared, hidden 128, moe_intermediate 128 so that groups 32 and 128 both
divide every expert matrix) with tests/fixtures/tokenizer-kimi-small (4000 BPE ranks + Kimi's 256
specials), trained with HF transformers on the CPU for a fixed number of steps on Python 3.11's
standard library sources (/usr/lib/python3.11/*.py, sorted), the held-out files excluded. Written in the published
per-expert bf16 layout with a Kimi-style config.json, so `kdtree quantize` / `kdtree ppl` read it as
they read Kimi.

  /tmp/venv-fx/bin/python python/train_quality_model.py --out models/quality-bf16 --eval-text models/quality-eval.txt
"""
from __future__ import annotations

import argparse
import base64
import glob
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import tiktoken
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
from make_tokenizer import PAT_STR  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOK = REPO / "tests" / "fixtures" / "tokenizer-kimi-small"
HELD_OUT = ["calendar.py", "fractions.py", "statistics.py"]


def encoding():
    ranks = {}
    for line in (TOK / "tiktoken.model").read_text().splitlines():
        if line.strip():
            b, r = line.split()
            ranks[base64.b64decode(b)] = int(r)
    return tiktoken.Encoding("kimi-small", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})


def stored_state(model):
    """HF's in-memory state (fused experts) -> the published layout: per-expert names, bf16, the
    router's correction bias F32, as Kimi publishes it."""
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                sd[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                sd[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            sd[k] = v
    return {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous() for k, v in sd.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eval-text", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    enc = encoding()
    files = sorted(glob.glob("/usr/lib/python3.11/*.py"))
    train = [f for f in files if Path(f).name not in HELD_OUT]
    text = "".join(Path(f).read_text(errors="replace") for f in train)
    ids = np.array(enc.encode_ordinary(text), dtype=np.int64)
    a.eval_text.write_text("".join(Path("/usr/lib/python3.11/" + n).read_text() for n in HELD_OUT))
    print(f"train: {len(train)} files, {len(text)/1e6:.2f} MB, {len(ids)} tokens; eval: {HELD_OUT}", flush=True)

    V = 4256
    cfg_json = mf.text_config(vocab_size=V, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                              num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=64,
                              kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                              routed_scaling_factor=2.5, pad_token_id=V - 1,
                              rope_scaling=mf.yarn(1, 32, 1, orig=4096))
    cfg_json["rope_scaling"] = None
    cfg_json.pop("rope_scaling")
    hf_cfg_json = dict(cfg_json, rope_scaling={"type": "default"})
    hf_cfg = mf.hf_config_from_json(hf_cfg_json)
    model = mf.DeepseekV3ForCausalLM(hf_cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps, pct_start=0.05)
    rng = np.random.default_rng(0)
    t0 = time.time()
    for step in range(a.steps):
        starts = rng.integers(0, len(ids) - a.seq - 1, a.batch)
        x = torch.from_numpy(np.stack([ids[s:s + a.seq] for s in starts]))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time()-t0:.0f} s)", flush=True)

    sd = stored_state(model)
    a.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    save_file(sd, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    cfg_json["rope_theta"] = 50000.0
    (a.out / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(TOK / f, a.out / f)
    (a.out / "training.json").write_text(json.dumps({
        "script": "python/train_quality_model.py", "versions": mf.versions() if hasattr(mf, "versions") else {},
        "steps": a.steps, "seq": a.seq, "batch": a.batch, "train_files": len(train), "train_tokens": int(len(ids)),
        "held_out": HELD_OUT, "final_loss": float(loss.item()), "seconds": time.time() - t0}, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
