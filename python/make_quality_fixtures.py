#!/usr/bin/env python3
"""Golden values for `kdtree quantize` and `kdtree ppl` (issue 19), from independent references.

  quantize: compressed-tensors' own compressor on tests/fixtures/k2-bf16. For every Linear module that
            Kimi's ignore list leaves (the routed experts): min/max per group on the bf16 weight,
            `calculate_qparams` (compressed_tensors.quantization.utils.helpers) for scale and zero point,
            then `PackedQuantizationCompressor.compress`; every other tensor as is; the state dict written
            by `safetensors.torch.save_file(..., metadata={"format": "pt"})` as transformers'
            save_pretrained does. Recorded: sha256 of the whole file and of every tensor's bytes, and the
            quantization_config compressed-tensors' QuantizationConfig dumps.
  ppl:      HF transformers logits (fp32, eager) of a tiny random DeepseekV3 with the small Kimi tokenizer
            over a committed text, scored with llama.cpp's perplexity convention (tools/perplexity/
            perplexity.cpp, re-implemented here in numpy from its description, not from kdtree).

  /tmp/venv-fx/bin/python python/make_quality_fixtures.py --out tests/fixtures/quality
Versions used are written into each JSON file (torch, transformers, compressed-tensors, safetensors).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def versions():
    import compressed_tensors
    import safetensors
    import transformers
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__, "safetensors": safetensors.__version__,
            "numpy": np.__version__}


def is_linear(name: str, shape) -> bool:
    """Linear modules of HF DeepseekV3 as stored: *_proj, kv_a_proj_with_mqa, lm_head (not mlp.gate, embeddings, norms)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    mod = name[: -len(".weight")]
    leaf = mod.rsplit(".", 1)[-1]
    return mod == "lm_head" or leaf.endswith("_proj") or leaf == "kv_a_proj_with_mqa"


def ct_quantize_state_dict(sd: dict, group: int, ignore: list[str]):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.utils.match import match_name

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out, n_q = {}, 0
    for name, t in sd.items():
        mod = name[: -len(".weight")] if name.endswith(".weight") else name
        if not is_linear(name, t.shape) or any(match_name(mod, p) for p in ignore):
            out[name] = t
            continue
        assert t.dtype == torch.bfloat16
        n, k = t.shape
        g = t.view(n, k // group, group)
        # what a minmax observer computes on the bf16 weight (per group, in the weight's dtype)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        c = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        for key, v in c.items():
            out[f"{mod}.{key}"] = v
        n_q += 1
    return out, n_q


def quant_config(group: int, ignore: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group, observer="minmax")
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                            format="pack-quantized", ignore=ignore, quantization_status=QuantizationStatus.COMPRESSED)
    return qc.model_dump(mode="json")


def kimi_config(group: int, ignore: list[str]):
    """The quantization_config block as Kimi K2-Thinking's config.json has it (tests/fixtures/k2-int4)."""
    qc = json.loads((FIX / "k2-int4" / "config.json").read_text())["quantization_config"]
    qc["config_groups"]["group_0"]["weights"]["group_size"] = group
    qc["ignore"] = list(ignore)
    return qc


def make_quantize(out: Path):
    from safetensors.torch import load_file, save_file
    src = FIX / "k2-bf16" / "model.safetensors"
    sd = load_file(str(src))
    res = {"script": "python/make_quality_fixtures.py", "versions": versions(), "input": "tests/fixtures/k2-bf16",
           "cases": {}}
    for label, group, ignore in [("g32-kimi", 32, KIMI_IGNORE),
                                 ("g32-shared-too", 32, ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|down)_proj.*"])]:
        q, n_q = ct_quantize_state_dict(sd, group, ignore)
        tmp = out / f"_{label}.safetensors"
        save_file(q, str(tmp), metadata={"format": "pt"})
        data = tmp.read_bytes()
        tmp.unlink()
        res["cases"][label] = {
            "group": group, "ignore": ignore, "quantized_modules": n_q, "tensors": len(q),
            "file_sha256": hashlib.sha256(data).hexdigest(), "file_bytes": len(data),
            "tensor_sha256": {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                              for k, v in sorted(q.items())},
            "weight_shape_dtype": str(next(v.dtype for k, v in q.items() if k.endswith("weight_shape"))),
            "quantization_config_ct_dump": quant_config(group, ignore),
            "quantization_config": kimi_config(group, ignore),
        }
        from compressed_tensors.quantization import QuantizationConfig
        # Kimi's block (older compressed-tensors keys) must parse to the same config as 0.20.1's own dump.
        same = (QuantizationConfig.model_validate(kimi_config(group, ignore)).model_dump(mode="json")
                == QuantizationConfig.model_validate(quant_config(group, ignore)).model_dump(mode="json"))
        assert same
        res["cases"][label]["kimi_block_parses_equal_to_ct_dump"] = same
        print(f"quantize {label}: {n_q} modules, {len(q)} tensors, sha256 {res['cases'][label]['file_sha256'][:16]}")
    # Unit-test vectors (tests/unit/test_quantize.cpp): rows that hit the rules' corners — a zero group
    # (scale = bf16 eps), exact .5 ties after the bf16 quotient, a group whose fp32 quotient and bf16
    # quotient round to different integers, negative absmax, random normal rows — at groups 32 and 128.
    from safetensors.torch import save_file as save_vec
    g = torch.Generator().manual_seed(19)
    w = (torch.randn(12, 256, generator=g) * 0.05).to(torch.bfloat16)
    w[0, :32] = 0
    w[1, :32] = torch.tensor([7.5, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5] + [0.25] * 25)  # scale 1: ties
    w[2, :32] = torch.linspace(-1, 0.3, 32)  # absmax on the negative side
    w[3, :32] = torch.tensor([7.5 * 0.01] + [0.01 * 3.49] * 31)  # w/s = 3.49 in fp32, 3.5 in bf16
    w[4, :] = w[4, :] * 1e-30  # tiny: scale underflows in bf16? (kept finite)
    vec = {"weight": w.contiguous()}
    n_diff = 0
    for group in (32, 128):
        q, _ = ct_quantize_state_dict({"x.experts.0.down_proj.weight": w}, group, [])
        vec[f"packed_g{group}"] = q["x.experts.0.down_proj.weight_packed"].contiguous()
        vec[f"scale_g{group}"] = q["x.experts.0.down_proj.weight_scale"].contiguous()
        # the plain rule (fp32 quotient, absmax/8) differs: show the test would catch it
        s32 = (w.float().view(12, -1, group).abs().amax(-1) / 7.5).to(torch.bfloat16).float()
        alt = torch.clamp(torch.round(w.float().view(12, -1, group) / s32.clamp_min(2**-7).unsqueeze(-1)), -8, 7)
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        ref = unpack_from_int32(vec[f"packed_g{group}"], 4, torch.Size([12, 256])).view(12, -1, group).float()
        n_diff += int((alt != ref).sum())
    save_vec(vec, str(out / "ct_vectors.safetensors"), metadata={"format": "pt"})
    res["ct_vectors"] = {"file": "ct_vectors.safetensors", "rows": 12, "cols": 256, "groups": [32, 128],
                         "values_where_an_fp32_quotient_would_differ": n_diff}
    print(f"ct_vectors: fp32-quotient variant differs in {n_diff} values")
    (out / "quantize_golden.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=FIX / "quality")
    ap.add_argument("--only", choices=["quantize", "ppl"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    if a.only in (None, "quantize"):
        make_quantize(a.out)
    if a.only in (None, "ppl"):
        make_ppl(a.out)


def llama_ppl(tokens, ctx, stride, bos_id, logits_fn):
    """llama.cpp tools/perplexity/perplexity.cpp, re-implemented: returns per-prediction
    (target, nll) plus the full log-softmax rows, and ppl ± its standard error."""
    n = len(tokens)
    assert n >= 2 * ctx
    rows = []
    if stride == 0:
        first = ctx // 2
        wins = [(i * ctx, first, ctx - 1 - first, bos_id is not None) for i in range(n // ctx)]
    else:
        wins = [(i * stride, ctx - stride - 1, stride, False) for i in range((n - ctx + stride - 1) // stride)]
    for start, first, cnt, bos in wins:
        ids = list(tokens[start:start + ctx])
        if bos:
            ids[0] = bos_id
        lsm = torch.log_softmax(logits_fn(ids).double(), -1)
        for j in range(first, first + cnt):
            t = tokens[start + j + 1]
            rows.append((t, float(-lsm[j, t]), lsm[j]))
    nll = np.array([r[1] for r in rows])
    m, m2 = nll.mean(), (nll ** 2).mean()
    ppl = float(np.exp(m))
    return rows, ppl, float(ppl * np.sqrt((m2 - m * m) / (len(nll) - 1))), len(wins)


def make_ppl(out: Path):
    """A tiny random DeepseekV3 with the small Kimi tokenizer (tests/fixtures/quality/ppl-tiny), its
    compressed-tensors INT4 g32 twin dequantised, HF logits of both over ppl.txt."""
    import shutil
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_fixtures as mf
    import train_quality_model as tq
    from safetensors.torch import save_file

    torch.manual_seed(7)
    V = 4256
    cfg_json = mf.text_config(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                              num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                              routed_scaling_factor=2.5, pad_token_id=V - 1, initializer_range=0.15)
    cfg_json.pop("rope_scaling")
    hf_cfg = mf.hf_config_from_json(dict(cfg_json, rope_scaling={"type": "default"}))
    model = mf.DeepseekV3ForCausalLM(hf_cfg).float().eval()
    sd = tq.stored_state(model)
    d = out / "ppl-tiny"
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(FIX / "tokenizer-kimi-small" / f, d / f)

    def hf_model(stored):
        m = mf.make_model(hf_cfg, mf.hf_state_from_ckpt(stored, cfg_json))
        return lambda ids: m(input_ids=torch.tensor([ids])).logits[0].float()

    with torch.no_grad():
        f_bf16 = hf_model(sd)
        q, _ = ct_quantize_state_dict(sd, 32, KIMI_IGNORE)
        f_int4 = hf_model(q)  # hf_state_from_ckpt dequantises (u-8)*scale exactly
        text = (out / "ppl.txt").read_text()
        tokens = tq.encoding().encode_ordinary(text)
        res = {"script": "python/make_quality_fixtures.py", "versions": versions(), "model": "ppl-tiny",
               "text": "ppl.txt", "n_tokens_no_bos": len(tokens), "tokens_sha256":
               hashlib.sha256(np.array(tokens, dtype="<i4").tobytes()).hexdigest(), "cases": {}}
        bos = cfg_json["bos_token_id"]
        for label, ctx, stride, use_bos in [("c64", 64, 0, False), ("c64-bos", 64, 0, True), ("c64-s16", 64, 16, False)]:
            toks = ([bos] + tokens) if use_bos else tokens
            rows, ppl, err, nw = llama_ppl(toks, ctx, stride, bos if use_bos else None, f_bf16)
            res["cases"][label] = {"ctx": ctx, "stride": stride, "bos": use_bos, "ppl": ppl, "ppl_stderr": err,
                                   "n_scored": len(rows), "n_chunks": nw,
                                   "nll_first8": [r[1] for r in rows[:8]]}
            print(f"ppl {label}: {ppl:.4f} ± {err:.4f} over {len(rows)}")
        # KL(bf16 || int4) per llama.cpp's kl_divergence, exact (full vocabulary) and with the
        # reference cut to its top-k + one tail bucket (kdtree's stored form).
        rows_b, ppl_b, _, _ = llama_ppl(tokens, 64, 0, None, f_bf16)
        rows_q, ppl_q, err_q, _ = llama_ppl(tokens, 64, 0, None, f_int4)
        kl_full, kl_top8, same = [], [], 0
        for (t, nb, lb), (_, nq, lq) in zip(rows_b, rows_q):
            pb = lb.exp()
            kl_full.append(float((pb * (lb - lq)).sum()))
            top = torch.topk(lb, 8).indices
            sp, sq = float(pb[top].sum()), float(lq[top].exp().sum())
            k8 = float((pb[top] * (lb[top] - lq[top])).sum())
            tp = max(0.0, 1 - sp)
            if tp > 1e-5:
                k8 += tp * (np.log(tp) - np.log(max(1e-300, 1 - sq)))
            kl_top8.append(k8)
            same += int(torch.argmax(lq) == torch.argmax(lb))
        res["kl_int4_g32"] = {"ctx": 64, "ppl_base": ppl_b, "ppl": ppl_q, "ppl_stderr": err_q, "delta_ppl": ppl_q - ppl_b,
                              "kl_mean_full": float(np.mean(kl_full)), "kl_mean_top8_tail": float(np.mean(kl_top8)),
                              "kl_median_full": float(np.median(kl_full)), "kl_max_full": float(np.max(kl_full)),
                              "top1_agreement": same / len(rows_b), "n_scored": len(rows_b)}
        print("kl:", res["kl_int4_g32"])
    (out / "ppl_golden.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
