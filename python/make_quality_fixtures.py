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


def make_ppl(out: Path):
    pass  # filled below


if __name__ == "__main__":
    main()
