"""The DFlash drafter of python/train_pair.py, trained with z-lab's own DFlashDraftModel (the `dflash`
package) on the INT4 target's greedy continuations and tap features (SPEC-DDTREE.md §1 "Training").

Data: prompts of P corpus tokens, continued greedily by the INT4 target to T tokens (its own
continuations, as the published recipe trains on target responses); taps = the target's
hidden_states[id + 1] for id in target_layer_ids over the whole sequence (teacher-forced, which is
what the engine's prefill and verify produce).

One training example is a sequence with n_blocks anchors a drawn from [P − 1, T − B], so that every
label is a target-generated token. Block j is [x_a, mask × (B − 1)] at positions a … a+B−1; its
queries see the context features of positions < a (the bonus token's own features are not known at
inference) and the whole of its own block, nothing of other blocks — one boolean mask
[b, 1, n_blocks·B, T + n_blocks·B] handed to the package's attention. Position k of the block
predicts x_{a+k} through the frozen target lm_head; cross-entropy weighted exp(−(k−1)/γ).
The target's embedding and lm_head are frozen and not stored with the drafter.

The drafter's config.json is written in the published form (Kimi-K2.5-DFlash: model_type qwen3,
DFlashDraftModel, YaRN copied from the target with mscale = mscale_all_dim = 1, dflash_config with
mask_token_id and target_layer_ids) and the model is built from that file, so what was trained is
what DFlashDraftModel.from_pretrained loads.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def _dflash():
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError as e:
        raise SystemExit(
            f"train_pair.py needs z-lab's `dflash` package ({e}). Offline: pip download --no-deps dflash==0.1.0 "
            "-d .whl, then pip install --no-index --find-links .whl --no-deps --target /tmp/pydeps dflash and "
            "PYTHONPATH=/tmp/pydeps (see the docstring of python/train_pair.py)") from e
    return DFlashDraftModel, dflash_generate


def drafter_config(tcfg: dict, a) -> dict:
    """Published DFlashDraftModel config.json for target config `tcfg`."""
    L = tcfg["num_hidden_layers"]
    taps = [int(x) for x in a.taps.split(",")] if a.taps else list(range(max(0, L - 1)))
    if not taps or any(t < 0 or t >= L - 1 for t in taps):
        # HF's hidden_states[L] (the last layer) is the output AFTER the final norm, the engine's tap of
        # layer L-1 the residual stream before it: published drafters never tap the last layer.
        raise SystemExit(f"--taps {taps}: each tap must be a layer in [0, {L - 2}] (not the last layer)")
    rs = dict(tcfg["rope_scaling"])
    rs.pop("type", None)
    n_base = tcfg["bos_token_id"]
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": a.draft_intermediate,
        "num_hidden_layers": a.draft_layers,
        "num_attention_heads": a.draft_heads,
        "num_key_value_heads": a.draft_kv_heads,
        "head_dim": tcfg["hidden_size"] // a.draft_heads,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": tcfg["rope_theta"],
        "rope_scaling": {"rope_type": "yarn", **rs},
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "vocab_size": tcfg["vocab_size"],
        "layer_types": ["full_attention"] * a.draft_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "block_size": a.block_size,
        "num_target_layers": L,
        # [UNK] (Kimi's 163838 = the 255th special; Kimi-K2.5-DFlash's mask token): never produced by
        # the tokenizer, so its embedding row is free for the drafter to read as "unknown yet".
        "dflash_config": {"mask_token_id": n_base + 254, "target_layer_ids": taps},
    }


def build(cfg_json: dict, out_dir: Path, device):
    """Writes config.json and builds DFlashDraftModel from it (fp32 master weights)."""
    DFlashDraftModel, _ = _dflash()
    from transformers import Qwen3Config

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    cfg = Qwen3Config.from_pretrained(str(out_dir))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    return DFlashDraftModel(cfg).float().to(device)


@torch.no_grad()
def greedy(target, prompts: torch.Tensor, n_new: int, amp) -> torch.Tensor:
    """[n, P] -> [n, P + n_new]: the target's greedy continuation (argmax every step, no EOS stop)."""
    with amp():
        out = target(input_ids=prompts, use_cache=True, logits_to_keep=1)
    past, seq = out.past_key_values, [prompts]
    nxt = out.logits[:, -1].float().argmax(-1)
    for i in range(n_new):
        seq.append(nxt[:, None])
        if i == n_new - 1:
            break
        with amp():
            out = target(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].float().argmax(-1)
    return torch.cat(seq, 1)


@torch.no_grad()
def tap_features(target, seqs: torch.Tensor, taps: list[int], batch: int, amp) -> torch.Tensor:
    """[n, T] -> [n, T, len(taps)·H] bf16: hidden_states[id + 1], concatenated in taps order."""
    out = []
    for i in range(0, seqs.shape[0], batch):
        with amp():
            # the decoder stack only: the lm_head's [b, T, vocab] logits are not needed
            hs = target.model(input_ids=seqs[i:i + batch], output_hidden_states=True, use_cache=False).hidden_states
        out.append(torch.cat([hs[t + 1] for t in taps], -1).to(torch.bfloat16))
    return torch.cat(out)


def make_data(target, tokens: torch.Tensor, n_seq_max: int, P: int, T: int, gen_batch: int, tap_batch: int,
              seconds: float, taps: list[int], amp, gen: torch.Generator, log):
    """Prompts from `tokens` (random windows), greedy continuations until n_seq_max sequences or
    `seconds`; returns (seqs [n, T] int64, feats [n, T, n_taps·H] bf16)."""
    t0, seqs = time.time(), []
    while sum(s.shape[0] for s in seqs) < n_seq_max:
        starts = torch.randint(0, tokens.numel() - P - 1, (gen_batch,), generator=gen).to(tokens.device)
        prompts = tokens[starts[:, None] + torch.arange(P, device=tokens.device)].long()
        seqs.append(greedy(target, prompts, T - P, amp))
        n = sum(s.shape[0] for s in seqs)
        log(f"drafter data: {n} sequences of {T} tokens ({n * (T - P) / (time.time() - t0):,.0f} generated tok/s)")
        if time.time() - t0 > seconds:
            break
    seqs = torch.cat(seqs)[:n_seq_max]
    feats = tap_features(target, seqs, taps, tap_batch, amp)
    log(f"drafter data: {seqs.shape[0]} sequences, taps {tuple(feats.shape)} in {time.time() - t0:.0f} s")
    return seqs, feats


def batch_inputs(seqs, feats, idx, n_blocks: int, B: int, P: int, mask_id: int, embed: torch.Tensor,
                 gen: torch.Generator):
    """One training batch for sequences idx: (noise_embedding, target_hidden, position_ids, mask,
    labels [b, n_blocks, B−1])."""
    dev = seqs.device
    b, T = idx.numel(), seqs.shape[1]
    x = seqs[idx]
    hi = T - B  # last anchor: its block ends at T − 1
    n_choices = hi - (P - 1) + 1
    r = torch.rand(b, n_choices, generator=gen).argsort(-1)[:, :n_blocks].to(dev)
    anchors = (P - 1) + r  # [b, nb], distinct within a sequence
    offs = torch.arange(B, device=dev)
    pos_blk = anchors[..., None] + offs  # [b, nb, B]
    ids = torch.full((b, n_blocks, B), mask_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = x.gather(1, anchors)
    labels = x.gather(1, pos_blk[:, :, 1:].reshape(b, -1)).view(b, n_blocks, B - 1)
    noise = F.embedding(ids.view(b, -1), embed)
    position_ids = torch.cat([torch.arange(T, device=dev).expand(b, T), pos_blk.view(b, -1)], 1)
    ctx_vis = torch.arange(T, device=dev)[None, None, :] < anchors[..., None]  # [b, nb, T]
    ctx_vis = ctx_vis[:, :, None, :].expand(b, n_blocks, B, T).reshape(b, n_blocks * B, T)
    blk = torch.arange(n_blocks, device=dev).repeat_interleave(B)
    blk_vis = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], -1)[:, None]  # [b, 1, nb·B, T + nb·B] bool, True = attend
    return noise, feats[idx].float(), position_ids, mask, labels


def block_logits(draft, lm_head: torch.Tensor, noise, hidden, position_ids, mask, n_blocks: int, B: int):
    out = draft(target_hidden=hidden, noise_embedding=noise, position_ids=position_ids, attention_mask=mask)
    b = out.shape[0]
    h = out.view(b, n_blocks, B, -1)[:, :, 1:]
    return F.linear(h, lm_head)  # [b, nb, B−1, V]


def train(draft, seqs, feats, embed, lm_head, a, P: int, amp, log) -> dict:
    B, nb = a.block_size, a.n_blocks
    mask_id = draft.mask_token_id
    w = torch.exp(-torch.arange(B - 1, device=seqs.device, dtype=torch.float32) / a.loss_gamma)
    opt = torch.optim.AdamW(draft.parameters(), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=seqs.device.type == "cuda")
    gen = torch.Generator().manual_seed(a.seed + 7)
    t0, step, hist = time.time(), 0, []
    from pair_target import lr_at

    draft.train()
    while True:
        frac = step / a.draft_steps if a.draft_steps else (time.time() - t0) / a.draft_seconds
        if frac >= 1.0:
            break
        lr = lr_at(frac, step, a.draft_lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, seqs.shape[0], (a.draft_batch,), generator=gen).to(seqs.device)
        noise, hid, pos, mask, labels = batch_inputs(seqs, feats, idx, nb, B, P, mask_id, embed, gen)
        with amp():
            logits = block_logits(draft, lm_head, noise, hid, pos, mask, nb, B)
        ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
        loss = (ce * w).sum() / (w.sum() * labels.shape[0] * nb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            acc = (logits.argmax(-1) == labels).float().mean((0, 1))
            dt = time.time() - t0
            hist.append({"step": step, "loss": round(float(loss.detach()), 4), "s": round(dt, 1)})
            log(f"drafter step {step:5d} loss {float(loss.detach()):.3f} lr {lr:.2e} "
                f"{step * a.draft_batch * nb * (B - 1) / dt:,.0f} predictions/s top-1 k=1 {float(acc[0]):.2f} "
                f"k={B - 1} {float(acc[-1]):.2f} ({dt:.0f} s)")
    draft.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss": float(loss.detach()), "loss_log": hist}


@torch.no_grad()
def accuracy(draft, seqs, feats, embed, lm_head, a, P: int, amp) -> dict:
    """Per-position top-1 agreement with the target's greedy tokens on held-out sequences, at anchors
    every 3rd position of the generated part; chain_tau = 1 + mean number of leading positions
    right (what DFlash's chain accepts per round at such an anchor, counting the bonus token)."""
    B = a.block_size
    T = seqs.shape[1]
    anchors_all = torch.arange(P - 1, T - B + 1, 3)
    nb = min(a.n_blocks, anchors_all.numel())
    right, n = torch.zeros(B - 1), 0
    runs = []
    for s in range(seqs.shape[0]):
        for c in range(0, anchors_all.numel(), nb):
            an = anchors_all[c:c + nb].to(seqs.device)
            k = an.numel()
            x = seqs[s:s + 1]
            pos_blk = an[None, :, None] + torch.arange(B, device=seqs.device)
            ids = torch.full((1, k, B), draft.mask_token_id, dtype=torch.long, device=seqs.device)
            ids[:, :, 0] = x[:, an]
            labels = x.gather(1, pos_blk[:, :, 1:].reshape(1, -1)).view(1, k, B - 1)
            position_ids = torch.cat([torch.arange(T, device=seqs.device)[None], pos_blk.view(1, -1)], 1)
            ctx_vis = (torch.arange(T, device=seqs.device)[None, None, :] < an[None, :, None])
            ctx_vis = ctx_vis[:, :, None, :].expand(1, k, B, T).reshape(1, k * B, T)
            blk = torch.arange(k, device=seqs.device).repeat_interleave(B)
            mask = torch.cat([ctx_vis, (blk[:, None] == blk[None, :])[None]], -1)[:, None]
            with amp():
                logits = block_logits(draft, lm_head, F.embedding(ids.view(1, -1), embed), feats[s:s + 1].float(),
                                      position_ids, mask, k, B)
            ok = (logits.argmax(-1) == labels)[0].cpu()  # [k, B−1]
            right += ok.float().sum(0)
            n += k
            runs.append(ok.int().cumprod(-1).sum(-1))
    runs = torch.cat(runs).float()
    return {"per_position_top1": [round(float(v), 4) for v in right / max(n, 1)], "anchors": n,
            "chain_tau_estimate": round(1 + float(runs.mean()), 3)}


def save(draft, out_dir: Path) -> None:
    """model.safetensors in bf16, the published names (fc, hidden_norm, norm, layers.*)."""
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def reference_tau(draft_dir: Path, target, prompts: list[list[int]], n_new: int, device) -> dict:
    """z-lab's dflash_generate (greedy) with the saved drafter, loaded by DFlashDraftModel.from_pretrained,
    over the HF INT4 target: tokens per round on each prompt, and whether its output equals plain greedy."""
    DFlashDraftModel, dflash_generate = _dflash()
    import dflash.model as dm

    dm._cuda_time = time.perf_counter if device.type != "cuda" else dm._cuda_time  # CPU: no CUDA sync
    draft = DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).to(device).eval()
    taus, same = [], 0
    for p in prompts:
        ids = torch.tensor([p], device=device)
        r = dflash_generate(draft, target, ids, n_new, None, temperature=0.0, return_stats=True)
        out = r.output_ids[0, len(p):].tolist()
        ref = greedy(target, ids, len(out), contextlib.nullcontext)[0, len(p):].tolist()
        same += int(out == ref)
        taus.append(sum(r.acceptance_lengths) / max(1, len(r.acceptance_lengths)))
    return {"dflash_generate_tau_per_prompt": [round(t, 3) for t in taus],
            "dflash_generate_tau_mean": round(sum(taus) / max(1, len(taus)), 3),
            "equals_greedy": f"{same}/{len(prompts)}", "n_new": n_new}
