"""The target of python/train_pair.py: HF transformers' DeepseekV3ForCausalLM configured as Kimi K2
ships it, trained from scratch, then saved as Kimi-K2-Thinking's INT4 checkpoint.

- Config: python/make_fixtures.py's text_config (the published Kimi form: model_type kimi_k2, legacy
  rope_scaling dict) with K2-Instruct's YaRN (factor 32, original 4096, beta 1/1, mscale 1/1, theta
  50000, max_position_embeddings 131072), MLA with q_lora_rank, sigmoid/noaux_tc router with
  e_score_correction_bias, n_group 1, a shared expert, layer 0 dense, routed_scaling 2.827,
  norm_topk_prob, rms_norm_eps 1e-6, tie_word_embeddings false.
- Router balance: transformers never updates e_score_correction_bias (a buffer), so RouterBalance
  does what DeepSeek-V3 §2.1.2 describes: after every optimizer step, for each MoE layer,
  bias_e += γ·sign(mean_load − load_e) with load_e the number of top-k picks of expert e in the
  step's forwards (counted by a forward hook on the router).
- Save: per-expert names as Kimi publishes them; routed experts INT4 symmetric group-32
  compressed-tensors pack-quantized (make_fixtures.quantize_int4: bf16 scale = absmax/8,
  q = clamp(round(w/scale), −8, 7), LSB-first nibbles of q+8 in int32); everything else bf16 except
  e_score_correction_bias (F32); quantization_config in config.json.
- The INT4 target (what the drafter is trained on and what check_pair.py compares with) is the HF
  model loaded from the saved files: bf16 tensors widened to fp32, experts dequantised exactly in
  fp32 as (u−8)·scale (make_fixtures.hf_state_from_ckpt).
"""
from __future__ import annotations

import copy
import json
import math
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

import make_fixtures as mf

GROUP = 32


def target_config(n_base: int, a) -> dict:
    """config.json (published Kimi K2 form) for a tokenizer with n_base ranks + 256 specials."""
    V = n_base + 256
    c = mf.text_config(
        vocab_size=V, bos_token_id=n_base, eos_token_id=n_base + 1, pad_token_id=n_base + 255,
        hidden_size=a.hidden, intermediate_size=a.dense_intermediate, moe_intermediate_size=a.moe_intermediate,
        num_hidden_layers=a.layers, first_k_dense_replace=1, n_routed_experts=a.experts,
        num_experts_per_tok=a.top_k, n_shared_experts=1, n_group=1, topk_group=1,
        num_attention_heads=a.heads, num_key_value_heads=a.heads, q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, routed_scaling_factor=2.827, rms_norm_eps=1e-6, rope_theta=50000.0,
        max_position_embeddings=131072, rope_scaling=mf.yarn(32, 1, 1, mscale=1.0, mscale_all_dim=1.0, orig=4096),
        quantization_config=copy.deepcopy(mf.QUANT_CONFIG), transformers_version="4.56.2",
    )
    for k in ("hidden_size", "moe_intermediate_size"):
        if c[k] % GROUP:
            raise SystemExit(f"{k} = {c[k]} must be a multiple of the INT4 group size {GROUP}")
    return c


def build_model(cfg_json: dict, device, attn: str = "sdpa", experts: str = "eager"):
    cfg = mf.hf_config_from_json(cfg_json)
    torch.manual_seed(0)
    model = mf.DeepseekV3ForCausalLM(cfg).float().to(device)
    model.set_attn_implementation(attn)
    model.set_experts_implementation(experts)
    return model


class RouterBalance:
    """Counts each MoE layer's top-k picks (forward hooks on DeepseekV3TopkRouter) and applies
    DeepSeek-V3's bias update. `window` holds the counts since the last report, for the log."""

    def __init__(self, model):
        self.routers = [(l, layer.mlp.gate) for l, layer in enumerate(model.model.layers)
                        if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias")]
        self.active = True
        E = self.routers[0][1].num_experts if self.routers else 0
        dev = next(model.parameters()).device
        self.step_counts = {l: torch.zeros(E, device=dev) for l, _ in self.routers}
        self.window = {l: torch.zeros(E, device=dev) for l, _ in self.routers}
        self.handles = [g.register_forward_hook(self._hook(l)) for l, g in self.routers]

    def _hook(self, l):
        def fn(mod, inp, out):
            if self.active:
                idx = out[2].detach().flatten()
                self.step_counts[l] += torch.bincount(idx, minlength=mod.num_experts).float()
        return fn

    @torch.no_grad()
    def update(self, gamma: float):
        for l, g in self.routers:
            load = self.step_counts[l]
            g.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
            self.window[l] += load
            load.zero_()

    def report(self) -> str:
        """max/mean and min/mean of the expert load per MoE layer since the last report."""
        parts = []
        for l, _ in self.routers:
            w = self.window[l]
            m = w.mean().clamp_min(1e-9)
            parts.append(f"L{l} {float(w.max() / m):.2f}/{float(w.min() / m):.2f}")
            w.zero_()
        return "max/min load vs mean " + " ".join(parts)

    def balance(self) -> dict:
        return {str(l): [round(float(x), 4) for x in g.e_score_correction_bias] for l, g in self.routers}

    def remove(self):
        for h in self.handles:
            h.remove()


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor·peak over frac ∈ [0, 1]."""
    w = min(1.0, (step + 1) / max(1, warmup))
    return peak * w * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def windows(tokens: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq - 1, (n,), generator=gen, device="cpu").to(tokens.device)
    return tokens[starts[:, None] + torch.arange(seq, device=tokens.device)].long()


@torch.no_grad()
def eval_loss(model, tokens: torch.Tensor, seq: int, n_windows: int, amp) -> float:
    """Mean next-token loss over n non-overlapping windows from the start of `tokens`."""
    model.eval()
    n = min(n_windows, (tokens.numel() - 1) // seq)
    if n < 1:
        return float("nan")
    x = tokens[: n * seq].view(n, seq).long()
    losses = []
    for i in range(0, n, 16):
        with amp():
            losses.append(float(model(input_ids=x[i:i + 16], labels=x[i:i + 16]).loss) * x[i:i + 16].shape[0])
    model.train()
    return sum(losses) / n


def train(model, tokens: torch.Tensor, eval_tokens: torch.Tensor, a, amp, log) -> dict:
    """AdamW, warmup + cosine, until a.target_steps (if > 0) or a.target_seconds have passed."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.target_lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=tokens.device.type == "cuda")
    bal = RouterBalance(model)
    gen = torch.Generator().manual_seed(a.seed)
    model.train()
    t0 = time.time()
    step, n_tok, loss_ema, hist = 0, 0, None, []
    while True:
        frac = step / a.target_steps if a.target_steps else (time.time() - t0) / a.target_seconds
        if frac >= 1.0:
            break
        lr = lr_at(frac, step, a.target_lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = windows(tokens, a.batch, a.seq, gen)
        with amp():
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bal.update(a.bias_gamma)
        n_tok += x.numel()
        step += 1
        if step % a.log_every == 0 or step == 1:
            lv = float(loss.detach())
            loss_ema = lv if loss_ema is None else 0.7 * loss_ema + 0.3 * lv
            dt = time.time() - t0
            hist.append({"step": step, "loss": round(lv, 4), "s": round(dt, 1)})
            log(f"target step {step:5d} loss {lv:.3f} lr {lr:.2e} {n_tok / dt:,.0f} tok/s "
                f"({dt:.0f} s) {bal.report()}")
    dt = time.time() - t0
    bal.active = False
    held = eval_loss(model, eval_tokens, a.seq, 64, amp)
    log(f"target: {step} steps, {n_tok:,} tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):,.0f} tok/s); "
        f"held-out loss {held:.3f} (fp32 master weights)")
    out = {"steps": step, "tokens": n_tok, "seconds": round(dt, 1), "tokens_per_s": round(n_tok / max(dt, 1e-9)),
           "final_train_loss": float(loss.detach()), "held_out_loss_master": held, "loss_log": hist,
           "e_score_correction_bias": bal.balance()}
    bal.remove()
    return out


def stored_checkpoint(model) -> tuple[OrderedDict, list]:
    """HF's in-memory state -> the published K2 INT4 layout. Returns (tensors, int4 items for the
    compressed-tensors cross-check: (name, fp32 weight, q, scale, packed))."""
    ck, items = OrderedDict(), []
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base = k[: k.rindex("experts.") + len("experts.")]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    inter = v.shape[1] // 2
                    mats = (("gate_proj", v[e, :inter]), ("up_proj", v[e, inter:]))
                else:
                    mats = (("down_proj", v[e]),)
                for proj, w in mats:
                    w = w.contiguous()
                    q, scale, packed, _, _ = mf.quantize_int4(w, GROUP)
                    name = f"{base}{e}.{proj}"
                    ck[name + ".weight_packed"] = packed
                    ck[name + ".weight_scale"] = scale
                    ck[name + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
                    items.append((name, w, q, scale, packed))
        elif k.endswith("e_score_correction_bias"):
            ck[k] = v.contiguous()
        else:
            ck[k] = v.to(torch.bfloat16).contiguous()
    return ck, items


MAX_SHARD_BYTES = 6_000_000


def save(out_dir: Path, cfg_json: dict, ck: OrderedDict):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    gen = {"_from_model_config": True, "bos_token_id": cfg_json["bos_token_id"],
           "eos_token_id": cfg_json["eos_token_id"], "pad_token_id": cfg_json["pad_token_id"],
           "do_sample": False, "transformers_version": cfg_json["transformers_version"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # ≤ 6 MB shards and an index (the published K2 layout), so no file of the committed pair exceeds 8 MB.
    mf.write_checkpoint_max(str(out_dir), ck, MAX_SHARD_BYTES)


def load_int4(out_dir: Path, device, attn: str = "sdpa", experts: str = "eager"):
    """The INT4 target as HF runs it: the saved tensors, experts dequantised exactly in fp32."""
    cfg_json = json.loads((Path(out_dir) / "config.json").read_text())
    ck = mf.read_checkpoint(str(out_dir))
    sd = mf.hf_state_from_ckpt(ck, cfg_json)
    model = build_model(cfg_json, "cpu", attn, experts)
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    return model.to(device).eval(), cfg_json, ck


def ct_check(items, max_items: int = 0) -> dict:
    """compressed-tensors' own pack/unpack and PackedQuantizationCompressor on our matrices
    (make_fixtures.ct_crosscheck); {'available': False} without the package."""
    if not mf.CT["available"]:
        return {"available": False, "error": mf.CT["error"]}
    res = mf.ct_crosscheck(items[:max_items] if max_items else items, GROUP)
    res["available"] = True
    return res


def sizes(d: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(Path(d).iterdir()) if p.is_file()}


def np_tokens(docs: list[list[int]], eos: int) -> np.ndarray:
    """Documents joined with [EOS] after each (the model learns where a file ends)."""
    n = sum(len(d) + 1 for d in docs)
    out = np.empty(n, dtype=np.int32)
    i = 0
    for d in docs:
        out[i:i + len(d)] = d
        out[i + len(d)] = eos
        i += len(d) + 1
    return out
