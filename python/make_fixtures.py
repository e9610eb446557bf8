#!/usr/bin/env python3
"""make_fixtures.py -- tiny DeepSeek-V3 / Kimi-K2 reference fixtures for kdtree.

WHAT IT MAKES (under --out, normally tests/fixtures/):

  k2-bf16/       Kimi-K2(-Instruct) style: model_type kimi_k2, n_group 1, sigmoid/noaux_tc
                 router, routed_scaling 2.827, YaRN factor 64 beta 32/1, bf16 experts.
  dsv3-group/    DeepSeek-V3 style group-limited routing: model_type deepseek_v3,
                 n_group 4 / topk_group 2, 16 experts top-4, first_k_dense_replace 2,
                 YaRN factor 40 beta 1/1, rope_theta 10000, rms_norm_eps 1e-6.
  k2-int4/       Kimi-K2-Thinking style: routed experts INT4 compressed-tensors
                 "pack-quantized" (weight_packed / weight_scale / weight_shape), YaRN beta 1/1.
  k25-sharded/   Kimi-K2.5/K2.6 wrapper: KimiK25ForConditionalGeneration, text model under
                 text_config, tensors prefixed language_model.*, dummy vision_tower.* and
                 mm_projector.* tensors, INT4 experts, 3 shards + model.safetensors.index.json.
  int4_vectors.safetensors (+ int4_vectors.json, how it was made)
                 unpacker test vectors (group size 32 and 16), packed by compressed-tensors'
                 own pack_to_int32.

  Every model directory holds config.json (published Kimi/DeepSeek form, with the legacy
  `rope_scaling` dict), the checkpoint, golden.safetensors and golden.json.

  golden.safetensors:
    prompt_ids     I32 [P]
    logits         F32 [P, vocab]   teacher-forced logits, one forward over the prompt
    greedy_ids     I32 [G=48]       greedy continuation (manual argmax loop with the KV cache,
                                    no EOS handling at all, so it never stops early)
    greedy_logits  F32 [G, vocab]   the logits row that produced each greedy token
    greedy_margin  F32 [G]          top1 - top2 of each greedy_logits row
    full_logits    F32 [P+G, vocab] (extra) teacher-forced logits of prompt+greedy_ids in one
                                    forward without cache: a long-prefill reference

  The goldens are HF transformers DeepseekV3ForCausalLM in float32 on the CPU, with
  attn_implementation="eager" and experts_implementation="eager"; every parameter of the fp32
  model is exactly the stored value (bf16 tensors widened, INT4 experts dequantised exactly in
  fp32 as (u-8)*scale, e_score_correction_bias stored as F32).

HOW TO RE-RUN (needs torch, transformers 5.17, safetensors, numpy; compressed-tensors for the
cross-checks and for int4_vectors' packed_ct -- see python/requirements-fixtures.txt):

    python3 python/make_fixtures.py --out tests/fixtures

  It is deterministic (fixed seeds; CPU; fixed thread count).  --check DIR regenerates into a
  temporary directory and compares with DIR.

VERSIONS USED for the committed fixtures (also in each golden.json "versions"): Python 3.12.3,
torch 2.11.0, transformers 5.17.0, huggingface_hub 1.33.0, safetensors 0.8.0, numpy 2.5.2,
compressed-tensors 0.20.1 (Intel Xeon CPU).  A rerun with Python 3.11.7 / numpy 2.4.6 on an AMD EPYC
gave byte-identical configs, checkpoints and int4_vectors, identical prompts/greedy ids, and golden
logits within 1.4e-5 (CPU kernel rounding).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
from collections import OrderedDict

import numpy as np
import torch
import safetensors
from safetensors.torch import load_file, save_file

import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SCRIPT = "python/make_fixtures.py"
G_NEW = 48  # greedy tokens
N_PROMPT_TRIES = 32  # prompts tried per fixture (see choose_prompt)
ROUTER_GAP_WEIGHT = 100.0
TORCH_THREADS = 4

# --------------------------------------------------------------------------------------------
# compressed-tensors (optional import; the cross-checks are recorded in golden.json)
# --------------------------------------------------------------------------------------------
CT = {"available": False, "version": None, "error": None}
try:  # 0.20.x layout: compressors/pack_quantized/helpers.py
    import compressed_tensors as _ct

    CT["version"] = getattr(_ct, "__version__", None)
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32 as ct_unpack

        CT["module"] = "compressed_tensors.compressors.pack_quantized.helpers"
    except ImportError:  # older layout: compressors/quantized_compressors/pack_quantized.py
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32 as ct_pack
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import unpack_from_int32 as ct_unpack

        CT["module"] = "compressed_tensors.compressors.quantized_compressors.pack_quantized"
    CT["available"] = True
except Exception as e:  # noqa: BLE001
    CT["error"] = f"{type(e).__name__}: {e}"


def versions():
    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "compressed_tensors": CT["version"] if CT["available"] else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    try:
        import huggingface_hub

        v["huggingface_hub"] = huggingface_hub.__version__
    except Exception:  # noqa: BLE001
        pass
    return v


# --------------------------------------------------------------------------------------------
# Facts read from transformers 5.17 models/deepseek_v3/modeling_deepseek_v3.py (code reading;
# the numeric ones are re-verified per fixture under golden.json "hf").
# --------------------------------------------------------------------------------------------
FACTS = {
    "a_latent_norm_eps": (
        "q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank) and kv_a_layernorm = "
        "DeepseekV3RMSNorm(config.kv_lora_rank) are built WITHOUT eps, so they use the class default "
        "eps=1e-6 whatever config.rms_norm_eps says. input_layernorm, post_attention_layernorm and the "
        "final model.norm use config.rms_norm_eps. RMSNorm: x.float(); x*rsqrt(mean(x^2)+eps); cast back "
        "to the input dtype; THEN multiply by weight (weight * x.to(input_dtype))."
    ),
    "b_router": (
        "DeepseekV3TopkRouter.forward: router_logits = F.linear(h.float(), W.float()) (fp32 GEMM on "
        "upcast input and weight); scores = sigmoid(logits); scores_for_choice = scores + "
        "e_score_correction_bias (fp32 buffer, _keep_in_fp32_modules_strict); group score = sum of the "
        "top-2 of each group (.topk(2)); kept groups = torch.topk(group_scores, topk_group, sorted=False); "
        "other groups' experts masked with -inf (masked_fill); topk_indices = torch.topk(scores_for_choice, "
        "top_k, sorted=False).indices; there is NO explicit tie rule: ties are whatever torch.topk "
        "returns (unspecified; on random continuous data no tie occurs). Weights = UNBIASED scores "
        "gathered at topk_indices; if norm_topk_prob: w /= (w.sum(-1, keepdim=True) + 1e-20); then "
        "ALWAYS w = w * routed_scaling_factor (applied to the weights, not to the MoE output, and also "
        "when norm_topk_prob is false). scoring_func/topk_method config keys are not read: sigmoid + "
        "noaux_tc is hard-coded."
    ),
    "c_yarn_scaling": (
        "Softmax scale: self.scaling = yarn_apply_mscale(rope_parameters, qk_head_dim**-0.5): if "
        "rope_type != 'default' and mscale_all_dim is truthy, scaling *= m*m with m = 0.1*mscale_all_dim*"
        "ln(factor)+1 (only when factor > 1); if mscale_all_dim is absent/0 the softmax scale is plain "
        "qk_head_dim**-0.5. cos/sin: _compute_yarn_parameters returns attention_factor = rope_parameters"
        "['attention_factor'] if given, else get_mscale(factor, mscale)/get_mscale(factor, mscale_all_dim) "
        "when BOTH mscale and mscale_all_dim are truthy, else get_mscale(factor) = 0.1*ln(factor)+1; the "
        "rotary forward multiplies cos and sin by it (fp32, autocast off) and casts them to the activation "
        "dtype. For Kimi/DeepSeek (mscale == mscale_all_dim == 1) attention_factor is exactly 1.0. "
        "inv_freq: dim = qk_rope_head_dim, pos_freqs = theta**(arange(0,dim,2)/dim), extrapolation 1/pos, "
        "interpolation 1/(factor*pos); low/high = find_correction_dim(beta_fast / beta_slow, dim, theta, "
        "original_max_position_embeddings), floor(low)/ceil(high) (truncate defaults True), clamped to "
        "[0, dim-1]; ramp = clamp((i-low)/(high-low), 0, 1) over i in [0, dim/2) (high += 0.001 if "
        "low == high); inv_freq = interp*ramp + extrap*(1-ramp). beta_fast/beta_slow use `or` defaults "
        "(32/1), so a 0 value falls back to the default. No dynamic update for yarn."
    ),
    "d_rope_layout": (
        "config.rope_interleave defaults to True (published Kimi/DeepSeek configs do not carry the key). "
        "With it, apply_rotary_pos_emb_interleave takes x1 = x[..., 0::2], x2 = x[..., 1::2] and returns "
        "cat([x1*cos - x2*sin, x2*cos + x1*sin], -1) with cos/sin = first half of cat(freqs, freqs), i.e. "
        "pair i = (x[2i], x[2i+1]) is rotated by pos*inv_freq[i] (GPT-J / interleaved pairs) and the "
        "OUTPUT is de-interleaved (all rotated evens, then all rotated odds). Applied to q_pe (per head, "
        "the last qk_rope_head_dim of each head's qk_head_dim rows of q_b_proj) and to the single shared "
        "k_pe (the last qk_rope_head_dim outputs of kv_a_proj_with_mqa, NOT normalised). q and k get the "
        "same permutation, so scores equal the GPT-J interleaved formulation; HF caches k_rot in the "
        "permuted layout. query = cat(q_nope, q_rot); key = cat(k_nope_h, k_rot) per head."
    ),
    "e_rope_config_keys": (
        "transformers 5.17 DeepseekV3Config has the field rope_parameters (dict: rope_type, rope_theta, "
        "factor, beta_fast, beta_slow, mscale, mscale_all_dim, original_max_position_embeddings, optional "
        "attention_factor, truncate) and no rope_theta/rope_scaling fields; legacy kwargs rope_scaling "
        "(+ rope_theta) are converted by convert_rope_params_to_dict (rope_parameters = rope_scaling; "
        "rope_type taken from 'type'; rope_theta inserted), and config.rope_scaling is a property alias of "
        "rope_parameters. The checkpoints here keep Kimi's published form ('rope_scaling': {'type': 'yarn', "
        "...}, 'rope_theta': ...); make_fixtures.py builds rope_parameters = {'rope_type': 'yarn', "
        "'rope_theta': rope_theta, **rope_scaling minus 'type'} explicitly. model_type 'kimi_k2' is not "
        "registered in 5.17, so the config object is DeepseekV3Config(**text_config)."
    ),
    "f_moe_sum": (
        "DeepseekV3MoE.forward: out = experts(h, topk_indices, topk_weights) + shared_experts(h) (shared "
        "added last, once). The eager DeepseekV3Experts loop: final = zeros_like(h) (the ACTIVATION dtype); "
        "for each hit expert in ASCENDING expert id (one_hot -> nonzero), gate, up = linear(x, "
        "gate_up_proj[e]).chunk(2) (gate = first I rows), y = down(silu(gate)*up), y = y * topk_weight "
        "(fp32 weight, promotes), final.index_add_(0, token_idx, y.to(final.dtype)). So the routed sum is "
        "in expert-id order (not selection rank) and, in a bf16 model, each weighted expert output is "
        "rounded to bf16 and accumulated in bf16; in the fp32 goldens everything is fp32. Default "
        "experts_implementation in 5.17 is grouped_mm; goldens use 'eager'. Attention softmax is "
        "computed in fp32 (softmax(..., dtype=float32)) then cast to the query dtype."
    ),
}

# --------------------------------------------------------------------------------------------
# Published-style config.json builders
# --------------------------------------------------------------------------------------------
QUANT_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

DS_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def yarn(factor, beta_fast, beta_slow, mscale=1.0, mscale_all_dim=1.0, orig=4096):
    return {
        "beta_fast": float(beta_fast),
        "beta_slow": float(beta_slow),
        "factor": float(factor),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
        "original_max_position_embeddings": orig,
        "type": "yarn",
    }


def text_config(**kw):
    """A DeepSeek-V3 / Kimi-K2 text config.json in the published (remote-code era) form."""
    V = kw["vocab_size"]
    c = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": dict(DS_AUTO_MAP),
        "aux_loss_alpha": 0.001,
        "bos_token_id": V - 256,
        "eos_token_id": V - 255,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 262144,
        "model_type": "kimi_k2",
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "rms_norm_eps": 1e-05,
        "rope_scaling": yarn(64, 32, 1),
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": V,
    }
    c.update(kw)
    return c


def k25_wrapper(text_cfg):
    V = text_cfg["vocab_size"]
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": text_cfg["bos_token_id"],
        "dtype": "bfloat16",
        "eos_token_id": text_cfg["eos_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": V - 256 + 21,  # 163605 - 163584 = 21
        "model_type": "kimi_k25",
        "pad_token_id": text_cfg.get("pad_token_id", V - 1),
        "quantization_config": copy.deepcopy(QUANT_CONFIG),
        "text_config": text_cfg,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": {
            "init_pos_emb_height": 4,
            "init_pos_emb_time": 4,
            "init_pos_emb_width": 4,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mm_hidden_size": 32,
            "mm_projector_type": "patchmerger",
            "patch_size": 2,
            "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05,
            "text_hidden_size": text_cfg["hidden_size"],
            "video_attn_type": "spatial_temporal",
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
        },
    }


def fixtures():
    fx = []
    # 1. Kimi-K2(-Instruct) style, bf16 experts.
    tc = text_config(vocab_size=512, rope_scaling=yarn(64, 32, 1))
    fx.append(dict(
        name="k2-bf16", seed=20250101, prompt_len=16, int4=False, shards=1, wrapper=None, text=tc,
        purpose="Kimi-K2 style (model_type kimi_k2, DeepseekV3ForCausalLM): n_group 1, sigmoid/noaux_tc "
                "router with non-zero F32 e_score_correction_bias, routed_scaling 2.827, 16 experts top-4, "
                "1 shared expert, first_k_dense_replace 1, YaRN factor 64 beta_fast 32 / beta_slow 1, "
                "rms_norm_eps 1e-5, bf16 routed experts, single model.safetensors.",
    ))
    # 2. DeepSeek-V3 style group-limited routing.
    V = 384
    tc = text_config(
        vocab_size=V, model_type="deepseek_v3", bos_token_id=0, eos_token_id=1,
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        first_k_dense_replace=2, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32,
        rms_norm_eps=1e-06, rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling=yarn(40, 1, 1), transformers_version="4.33.1",
    )
    fx.append(dict(
        name="dsv3-group", seed=20250202, prompt_len=20, int4=False, shards=1, wrapper=None, text=tc,
        purpose="DeepSeek-V3 style (model_type deepseek_v3): group-limited routing n_group 4 / topk_group 2 "
                "over 16 experts top-4 (group score = sum of top-2 biased scores), routed_scaling 2.5, "
                "first_k_dense_replace 2 of 4 layers, qk_nope 48 != v_head 32, YaRN factor 40 beta 1/1, "
                "rope_theta 10000, rms_norm_eps 1e-6, bos 0 / eos 1, bf16 experts.",
    ))
    # 3. Kimi-K2-Thinking style: INT4 routed experts.
    V = 512
    tc = text_config(
        vocab_size=V, moe_intermediate_size=96, eos_token_id=V - 254, pad_token_id=V - 1,
        rope_scaling=yarn(64, 1, 1), quantization_config=copy.deepcopy(QUANT_CONFIG),
        transformers_version="4.56.2",
    )
    fx.append(dict(
        name="k2-int4", seed=20250303, prompt_len=13, int4=True, shards=1, wrapper=None, text=tc,
        purpose="Kimi-K2-Thinking style: routed experts INT4 compressed-tensors pack-quantized "
                "(weight_packed I32 [N,K/8], weight_scale BF16 [N,K/32], weight_shape I32 [2]), group 32, "
                "hidden 64 (2 groups per gate/up row), moe_intermediate 96 (3 groups per down row), "
                "YaRN factor 64 beta 1/1, eos = vocab-254, pad = vocab-1. Golden uses the exact fp32 "
                "dequantisation (u-8)*scale.",
    ))
    # 4. Kimi-K2.5 / K2.6 wrapper, sharded, INT4.
    V = 512
    tc = text_config(
        vocab_size=V, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
        pad_token_id=V - 1, rope_scaling=yarn(64, 32, 1), quantization_config=copy.deepcopy(QUANT_CONFIG),
        transformers_version="4.56.2", dtype="bfloat16",
    )
    del tc["torch_dtype"]
    fx.append(dict(
        name="k25-sharded", seed=20250404, prompt_len=24, int4=True, shards=3, wrapper="k25", text=tc,
        purpose="Kimi-K2.5/K2.6 wrapper: top-level KimiK25ForConditionalGeneration / model_type kimi_k25 "
                "with the text model in text_config (model_type kimi_k2), quantization_config at both "
                "levels, tensors prefixed language_model.model. / language_model.lm_head.weight, dummy "
                "vision_tower.* and mm_projector.* tensors to ignore, INT4 experts (8 experts top-2), "
                "3 shards split mid-layer + model.safetensors.index.json, YaRN factor 64 beta 32/1.",
    ))
    return fx


# --------------------------------------------------------------------------------------------
# INT4 pack-quantized helpers (SPEC-MODEL.md section 3)
# --------------------------------------------------------------------------------------------
def quantize_int4(w: torch.Tensor, gs: int):
    """w fp32 [N, K]. Returns q int8 [N,K], scale bf16 [N,K/gs], packed int32 [N,K/8], dequant fp32,
    number of exact .5 ties met by round()."""
    N, K = w.shape
    assert K % gs == 0 and K % 8 == 0
    absmax = w.view(N, K // gs, gs).abs().amax(-1)
    scale = (absmax / 8.0).to(torch.bfloat16)  # rounded to bf16 FIRST
    s32 = scale.float().repeat_interleave(gs, dim=1)
    safe = torch.where(s32 == 0, torch.ones_like(s32), s32)
    x = torch.where(s32 == 0, torch.zeros_like(w), w / safe)
    ties = int(((x - torch.floor(x)) == 0.5).sum())
    q = torch.clamp(torch.round(x), -8, 7).to(torch.int8)  # torch.round = half to even
    packed = pack_int4(q)
    deq = q.float() * s32  # exact in fp32 (4-bit x 8-bit significands)
    return q, scale, packed, deq, ties


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """LSB-first nibble packing along K: word j of row n holds k = 8j+i in bits 4i..4i+3, u = q+8."""
    u = (q.numpy().astype(np.int64) + 8).astype(np.uint64)
    N, K = u.shape
    u = u.reshape(N, K // 8, 8)
    word = np.zeros((N, K // 8), dtype=np.uint64)
    for i in range(8):
        word |= u[:, :, i] << np.uint64(4 * i)
    return torch.from_numpy(word.astype(np.uint32).view(np.int32).copy())


def unpack_int4(packed: torch.Tensor, K: int) -> torch.Tensor:
    p = packed.numpy().view(np.uint32).astype(np.uint64)
    N = p.shape[0]
    u = np.zeros((N, p.shape[1], 8), dtype=np.int64)
    for i in range(8):
        u[:, :, i] = ((p >> np.uint64(4 * i)) & np.uint64(0xF)).astype(np.int64)
    return torch.from_numpy((u.reshape(N, -1)[:, :K] - 8).astype(np.int8))


def dequant_int4(packed, scale, shape):
    N, K = int(shape[0]), int(shape[1])
    assert packed.shape[0] == N and scale.shape[0] == N
    gs = K // scale.shape[1]
    q = unpack_int4(packed, K)
    return q.float() * scale.float().repeat_interleave(gs, dim=1)


def ct_crosscheck(items, gs=32):
    """items: list of (name, w_fp32, q, scale_bf16, packed). Compares with compressed-tensors."""
    res = {"compressed_tensors_version": CT["version"], "module": CT.get("module"), "matrices": len(items)}
    if not CT["available"]:
        res["error"] = CT["error"]
        return res
    n_unpack_ok = n_pack_ok = 0
    for name, w, q, scale, packed in items:
        un = ct_unpack(packed, 4, torch.Size(q.shape))
        n_unpack_ok += int(torch.equal(un.to(torch.int8), q))
        pk = ct_pack(q, 4)
        n_pack_ok += int(pk.dtype == torch.int32 and torch.equal(pk, packed))
    res["unpack_from_int32_equals_q"] = f"{n_unpack_ok}/{len(items)}"
    res["pack_to_int32_bytes_equal"] = f"{n_pack_ok}/{len(items)}"
    res["all_equal"] = n_unpack_ok == len(items) and n_pack_ok == len(items)
    # Full compressor round trip (quantize + pack, decompress) through the library's own classes.
    try:
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=gs),
        )
        n_c = n_shape = n_dq_exact = n_dq_bf16 = 0
        shape_dtypes = set()
        dq_dtypes = set()
        for name, w, q, scale, packed in items:
            out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
            n_c += int(torch.equal(out["weight_packed"], packed))
            shape_dtypes.add(str(out["weight_shape"].dtype))
            n_shape += int(out["weight_shape"].tolist() == list(q.shape))
            dec = PackedQuantizationCompressor.decompress(
                {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(list(q.shape))},
                scheme)
            dq = dec["weight"]
            dq_dtypes.add(str(dq.dtype))
            exact = q.float() * scale.float().repeat_interleave(gs, dim=1)
            n_dq_exact += int(torch.equal(dq.float(), exact))
            n_dq_bf16 += int(torch.equal(dq, exact.to(dq.dtype)))
        res["PackedQuantizationCompressor.compress(fp32 weight, bf16 scale) packed equal"] = f"{n_c}/{len(items)}"
        res["compress weight_shape values equal"] = f"{n_shape}/{len(items)}"
        res["compress weight_shape dtype"] = sorted(shape_dtypes)
        res["decompress dtype"] = sorted(dq_dtypes)
        res["decompress equals exact fp32 (u-8)*scale"] = f"{n_dq_exact}/{len(items)}"
        res["decompress equals exact fp32 (u-8)*scale rounded to the decompress dtype"] = f"{n_dq_bf16}/{len(items)}"
        res["compressor_all_equal"] = n_c == len(items) and n_shape == len(items)
    except Exception as e:  # noqa: BLE001
        res["compressor_error"] = f"{type(e).__name__}: {e}"
    return res


def ct_config_checks(qc, module_names):
    """Parse quantization_config with compressed-tensors and classify module names with its matcher."""
    res = {}
    if not CT["available"]:
        return {"error": CT["error"]}
    try:
        from compressed_tensors.quantization import QuantizationConfig

        parsed = QuantizationConfig.model_validate(qc)
        w = parsed.config_groups["group_0"].weights
        res["QuantizationConfig.model_validate"] = "ok"
        res["parsed"] = {
            "format": parsed.format, "quant_method": parsed.quant_method,
            "quantization_status": str(getattr(parsed.quantization_status, "value", parsed.quantization_status)),
            "num_bits": w.num_bits, "type": str(getattr(w.type, "value", w.type)),
            "strategy": str(getattr(w.strategy, "value", w.strategy)), "group_size": w.group_size,
            "symmetric": w.symmetric,
        }
    except Exception as e:  # noqa: BLE001
        res["QuantizationConfig.model_validate"] = f"{type(e).__name__}: {e}"
    try:
        from compressed_tensors.utils.match import match_name

        ignored, not_ignored = [], []
        for m in module_names:
            (ignored if any(match_name(m, t) for t in qc["ignore"]) else not_ignored).append(m)
        res["ignore_list_matches (compressed_tensors.utils.match.match_name)"] = {
            "ignored": len(ignored),
            "not_ignored": len(not_ignored),
            "not_ignored_non_expert": [m for m in not_ignored if ".mlp.experts." not in m],
            "ignored_experts": [m for m in ignored if ".mlp.experts." in m],
        }
    except Exception as e:  # noqa: BLE001
        res["match_name"] = f"{type(e).__name__}: {e}"
    return res


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def bf16(t):
    return t.to(torch.bfloat16)


def build_checkpoint(fx):
    """Returns (ckpt OrderedDict name->tensor in stored dtype, int4 items for cross-checks, stats)."""
    tc = fx["text"]
    H, V, L = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    nh = tc["num_attention_heads"]
    qr, kvr = tc["q_lora_rank"], tc["kv_lora_rank"]
    dn, dr, dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    E, I, Id = tc["n_routed_experts"], tc["moe_intermediate_size"], tc["intermediate_size"]
    Is = I * tc["n_shared_experts"]
    g = torch.Generator().manual_seed(fx["seed"])

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def lin(out, inn, gain=1.0):
        return bf16(normal((out, inn), gain / math.sqrt(inn)))

    def norm(n):
        return bf16(1.0 + normal((n,), 0.1))

    ck = OrderedDict()
    int4_items = []
    stats = {"q_min_count": 0, "q_max_count": 0, "round_half_ties": 0}
    ck["model.embed_tokens.weight"] = bf16(normal((V, H), 1.0))
    for l in range(L):
        p = f"model.layers.{l}."
        ck[p + "input_layernorm.weight"] = norm(H)
        ck[p + "self_attn.q_a_proj.weight"] = lin(qr, H)
        ck[p + "self_attn.q_a_layernorm.weight"] = norm(qr)
        ck[p + "self_attn.q_b_proj.weight"] = lin(nh * (dn + dr), qr)
        ck[p + "self_attn.kv_a_proj_with_mqa.weight"] = lin(kvr + dr, H)
        ck[p + "self_attn.kv_a_layernorm.weight"] = norm(kvr)
        ck[p + "self_attn.kv_b_proj.weight"] = lin(nh * (dn + dv), kvr)
        ck[p + "self_attn.o_proj.weight"] = lin(H, nh * dv)
        ck[p + "post_attention_layernorm.weight"] = norm(H)
        if l < tc["first_k_dense_replace"]:
            ck[p + "mlp.gate_proj.weight"] = lin(Id, H)
            ck[p + "mlp.up_proj.weight"] = lin(Id, H)
            ck[p + "mlp.down_proj.weight"] = lin(H, Id)
            continue
        ck[p + "mlp.gate.weight"] = lin(E, H)
        ck[p + "mlp.gate.e_score_correction_bias"] = normal((E,), 0.1)  # F32, not rounded
        for e in range(E):
            for proj, (n_out, n_in) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                name = f"{p}mlp.experts.{e}.{proj}"
                if not fx["int4"]:
                    ck[name + ".weight"] = lin(n_out, n_in)
                    continue
                # fp32 master weight (not bf16-rounded): w/scale never lands exactly on a .5 tie, so q
                # does not depend on the rounding rule (asserted below)
                wf = normal((n_out, n_in), 1.0 / math.sqrt(n_in))
                q, scale, packed, deq, ties = quantize_int4(wf, 32)
                stats["q_min_count"] += int((q == -8).sum())
                stats["q_max_count"] += int((q == 7).sum())
                stats["round_half_ties"] += ties
                ck[name + ".weight_packed"] = packed
                ck[name + ".weight_scale"] = scale
                ck[name + ".weight_shape"] = torch.tensor([n_out, n_in], dtype=torch.int32)
                int4_items.append((name, wf, q, scale, packed))
        ck[p + "mlp.shared_experts.gate_proj.weight"] = lin(Is, H)
        ck[p + "mlp.shared_experts.up_proj.weight"] = lin(Is, H)
        ck[p + "mlp.shared_experts.down_proj.weight"] = lin(H, Is)
    ck["model.norm.weight"] = norm(H)
    ck["lm_head.weight"] = lin(V, H, gain=4.0)  # logits std ~4: well-spread greedy margins
    if fx["int4"]:
        assert stats["q_min_count"] > 0 and stats["q_max_count"] > 0, stats
        assert stats["round_half_ties"] == 0, stats
    if fx["wrapper"] == "k25":
        wrapped = OrderedDict()
        # dummy multimodal tensors the engine must ignore (first shard gets the vision tower)
        vt = OrderedDict()
        vt["vision_tower.patch_embed.proj.weight"] = bf16(normal((32, 3, 2, 2), 0.1))
        vt["vision_tower.patch_embed.proj.bias"] = bf16(normal((32,), 0.1))
        vt["vision_tower.patch_embed.pos_emb.weight"] = bf16(normal((4, 4, 32), 0.1))
        vt["vision_tower.encoder.blocks.0.norm0.weight"] = norm(32)
        vt["vision_tower.encoder.blocks.0.wqkv.weight"] = bf16(normal((96, 32), 0.1))
        vt["vision_tower.encoder.blocks.0.wqkv.bias"] = bf16(normal((96,), 0.1))
        vt["vision_tower.encoder.blocks.0.wo.weight"] = bf16(normal((32, 32), 0.1))
        vt["vision_tower.encoder.final_layernorm.weight"] = norm(32)
        mm = OrderedDict()
        mm["mm_projector.pre_norm.weight"] = norm(32)
        mm["mm_projector.pre_norm.bias"] = bf16(normal((32,), 0.1))
        mm["mm_projector.proj.0.weight"] = bf16(normal((128, 128), 0.05))
        mm["mm_projector.proj.0.bias"] = bf16(normal((128,), 0.05))
        mm["mm_projector.proj.2.weight"] = bf16(normal((H, 128), 0.05))
        mm["mm_projector.proj.2.bias"] = bf16(normal((H,), 0.05))
        wrapped.update(vt)
        for k, v in ck.items():
            wrapped["language_model." + k] = v
        wrapped.update(mm)
        ck = wrapped
    return ck, int4_items, stats


def text_prefix(fx):
    return "language_model." if fx["wrapper"] == "k25" else ""


def hf_state_from_ckpt(ck, tc, prefix=""):
    """Map stored checkpoint tensors (per-expert names, INT4 triplets) to the HF 5.17 in-memory fp32
    state dict (fused experts.gate_up_proj [E, 2I, H] gate first, experts.down_proj [E, H, I])."""
    sd = {}
    experts = {}
    int4 = {}
    pat = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale|weight_shape)$")
    for name, t in ck.items():
        if prefix:
            if not name.startswith(prefix):
                continue  # vision_tower.*, mm_projector.*
            name = name[len(prefix):]
        m = pat.match(name)
        if m:
            l, e, proj, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            if kind == "weight":
                experts[(l, e, proj)] = t.float()
            else:
                int4.setdefault((l, e, proj), {})[kind] = t
            continue
        sd[name] = t.float() if t.dtype == torch.bfloat16 else t.clone()
    for key, d in int4.items():
        assert set(d) == {"weight_packed", "weight_scale", "weight_shape"}, (key, d.keys())
        experts[key] = dequant_int4(d["weight_packed"], d["weight_scale"], d["weight_shape"].tolist())
    E = tc["n_routed_experts"]
    layers = sorted({k[0] for k in experts})
    for l in layers:
        gu = torch.stack([torch.cat([experts[(l, e, "gate_proj")], experts[(l, e, "up_proj")]], 0) for e in range(E)])
        dn = torch.stack([experts[(l, e, "down_proj")] for e in range(E)])
        sd[f"model.layers.{l}.mlp.experts.gate_up_proj"] = gu
        sd[f"model.layers.{l}.mlp.experts.down_proj"] = dn
    return sd


# --------------------------------------------------------------------------------------------
# HF model
# --------------------------------------------------------------------------------------------
HF_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
    "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp", "tie_word_embeddings",
    "rope_interleave", "attention_bias", "attention_dropout",
]


def hf_config_from_json(cfg_json):
    """config.json (published form, possibly the K2.5 wrapper) -> DeepseekV3Config for the golden run."""
    tc = cfg_json.get("text_config", cfg_json)
    kw = {k: tc[k] for k in HF_KEYS if k in tc}
    rs = dict(tc["rope_scaling"])
    rtype = rs.pop("type", None) or rs.pop("rope_type")
    kw["rope_parameters"] = {"rope_type": rtype, "rope_theta": float(tc["rope_theta"]), **rs}
    return DeepseekV3Config(**kw, attn_implementation="eager", experts_implementation="eager")


def make_model(hf_cfg, sd):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_cfg).to(torch.float32).eval()
    if model.config._attn_implementation != "eager":
        model.set_attn_implementation("eager")
    if model.config._experts_implementation != "eager":
        model.set_experts_implementation("eager")
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    return model


def hf_derived(model, hf_cfg, tc):
    att = model.model.layers[0].self_attn
    rot = model.model.rotary_emb
    rs = tc["rope_scaling"]
    # SPEC-MODEL.md YaRN formula, independently
    dim, theta = tc["qk_rope_head_dim"], float(tc["rope_theta"])
    orig, factor = rs["original_max_position_embeddings"], rs["factor"]

    def corr(r):
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), dim - 1)
    hi = high + 0.001 if low == high else high
    spec = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (hi - low), 0.0), 1.0)
        spec.append(base * (1 - ramp) + base / factor * ramp)
    inv = rot.inv_freq.double().tolist()
    m = 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1.0
    qk = tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]
    return {
        "rope_parameters": dict(hf_cfg.rope_parameters),
        "rope_interleave": hf_cfg.rope_interleave,
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation,
        "softmax_scale": att.scaling,
        "softmax_scale_spec_formula": qk ** -0.5 * m * m,
        "rope_attention_scaling": rot.attention_scaling,
        "yarn_low_high": [low, high],
        "inv_freq": inv,
        "inv_freq_spec_formula_max_rel_diff": max(abs(a - b) / b for a, b in zip(inv, spec)),
        "latent_norm_eps": {
            "q_a_layernorm": att.q_a_layernorm.variance_epsilon,
            "kv_a_layernorm": att.kv_a_layernorm.variance_epsilon,
        },
        "input_layernorm_eps": model.model.layers[0].input_layernorm.variance_epsilon,
        "final_norm_eps": model.model.norm.variance_epsilon,
        "config_rms_norm_eps": tc["rms_norm_eps"],
    }


class RouterWatch:
    """Forward hooks on every DeepseekV3TopkRouter: min gap between the k-th and (k+1)-th biased
    expert score (after group masking), min gap at the group cut, experts hit per layer."""

    def __init__(self, model):
        self.handles = []
        self.min_expert_gap = math.inf
        self.min_group_gap = math.inf
        self.hits = {}
        for l, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "e_score_correction_bias"):
                continue
            self.hits[l] = set()
            self.handles.append(gate.register_forward_hook(self._hook(l)))

    def _hook(self, l):
        def fn(mod, inp, out):
            logits, _, idx = out
            s = logits.float().sigmoid() + mod.e_score_correction_bias.float()
            T, E = s.shape
            G, kg, k = mod.num_group, mod.topk_group, mod.top_k
            gsc = s.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1)
            if G > kg:
                gs = gsc.sort(-1, descending=True).values
                self.min_group_gap = min(self.min_group_gap, float((gs[:, kg - 1] - gs[:, kg]).min()))
            keep = torch.zeros_like(gsc, dtype=torch.bool)
            keep.scatter_(1, gsc.topk(kg, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
            v = s.masked_fill(~keep, -math.inf).sort(-1, descending=True).values
            gap = v[:, k - 1] - v[:, k]
            gap = gap[torch.isfinite(gap)]
            if gap.numel():
                self.min_expert_gap = min(self.min_expert_gap, float(gap.min()))
            self.hits[l].update(idx.flatten().tolist())
        return fn

    def report(self):
        for h in self.handles:
            h.remove()
        return {
            "min_topk_gap_biased_scores": self.min_expert_gap,
            "min_group_cut_gap": None if self.min_group_gap == math.inf else self.min_group_gap,
            "distinct_experts_hit_per_moe_layer": {str(l): len(s) for l, s in self.hits.items()},
        }


@torch.no_grad()
def greedy(model, prompt, G=G_NEW):
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    step = out.logits[0, -1].float()
    toks, rows, margins = [], [], []
    for i in range(G):
        top2 = torch.topk(step, 2).values
        tok = int(torch.argmax(step))
        toks.append(tok)
        rows.append(step.clone())
        margins.append(float(top2[0] - top2[1]))
        if i == G - 1:
            break
        out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), past_key_values=past, use_cache=True)
        past = out.past_key_values
        step = out.logits[0, -1].float()
    return toks, torch.stack(rows), torch.tensor(margins, dtype=torch.float32)


def choose_prompt(model, fx):
    tc = fx["text"]
    V = tc["vocab_size"]
    lo, hi = (2, V) if tc["bos_token_id"] < 2 else (0, tc["bos_token_id"])  # ordinary (non-special) ids
    best = None
    for j in range(N_PROMPT_TRIES):
        rng = np.random.default_rng(fx["seed"] * 1000 + j)
        prompt = rng.integers(lo, hi, size=fx["prompt_len"]).tolist()
        watch = RouterWatch(model)
        toks, _, margins = greedy(model, prompt)
        rgap = watch.report()["min_topk_gap_biased_scores"]
        distinct = len(set(toks))
        # primary: a non-degenerate continuation; then the smaller of the greedy margin and
        # ROUTER_GAP_WEIGHT x the closest expert-selection call (a router near-tie is what an engine
        # computing in bf16 would flip first)
        score = (distinct >= 8, min(float(margins.min()), ROUTER_GAP_WEIGHT * rgap))
        if best is None or score > best[0]:
            best = (score, j, prompt)
    return best[1], best[2]


# --------------------------------------------------------------------------------------------
# I/O
# --------------------------------------------------------------------------------------------
def write_checkpoint(d, ck, nshards):
    meta = {"format": "pt"}
    ck = OrderedDict((k, v.contiguous()) for k, v in ck.items())
    if nshards == 1:
        save_file(dict(ck), os.path.join(d, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = list(ck)
    sizes = [ck[n].numel() * ck[n].element_size() for n in names]
    total = sum(sizes)
    shards, cur, acc = [], [], 0
    for n, s in zip(names, sizes):
        cur.append(n)
        acc += s
        if len(shards) < nshards - 1 and acc >= total * (len(shards) + 1) / nshards:
            shards.append(cur)
            cur = []
    shards.append(cur)
    assert len(shards) == nshards
    weight_map, files = {}, []
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{nshards:05d}.safetensors"
        save_file({n: ck[n] for n in sh}, os.path.join(d, fn), metadata=meta)
        files.append(fn)
        for n in sh:
            weight_map[n] = fn
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files + ["model.safetensors.index.json"]


def _header_bytes(ck, names, meta):
    """The safetensors header of a file holding `names` of ck: 8 length bytes + the JSON, padded to 8."""
    h = {"__metadata__": meta} if meta else {}
    off = 0
    for n in names:
        b = ck[n].numel() * ck[n].element_size()
        h[n] = {"dtype": str(ck[n].dtype).replace("torch.", "").upper(), "shape": list(ck[n].shape),
                "data_offsets": [off, off + b]}
        off += b
    j = json.dumps(h, separators=(",", ":"))
    return 8 + (len(j) + 7) // 8 * 8 + 32  # (+32: dtype spellings differ, e.g. BF16 vs BFLOAT16)


def write_checkpoint_max(d, ck, max_shard_bytes):
    """Shards of at most max_shard_bytes each (whole files, headers included) + model.safetensors.index.json,
    as the published K2 checkpoint is laid out: tensors in name order, a new shard when the next tensor would
    not fit (a tensor larger than the limit alone in its shard: refused, a file over the limit would be
    committed). One file that fits is still written as a single shard with its index. Returns the file names."""
    meta = {"format": "pt"}
    ck = OrderedDict((k, ck[k].contiguous()) for k in sorted(ck))
    shards, cur = [], []
    for n in ck:
        if cur and _header_bytes(ck, cur + [n], meta) + sum(ck[m].numel() * ck[m].element_size() for m in cur + [n]) > max_shard_bytes:
            shards.append(cur)
            cur = []
        cur.append(n)
        if _header_bytes(ck, cur, meta) + sum(ck[m].numel() * ck[m].element_size() for m in cur) > max_shard_bytes:
            raise ValueError(f"{n}: {ck[n].numel() * ck[n].element_size()} bytes do not fit a shard of {max_shard_bytes}")
    if cur:
        shards.append(cur)
    total = sum(v.numel() * v.element_size() for v in ck.values())
    weight_map, files = {}, []
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(d, fn)
        save_file({n: ck[n] for n in sh}, path, metadata=meta)
        assert os.path.getsize(path) <= max_shard_bytes, (fn, os.path.getsize(path), max_shard_bytes)
        files.append(fn)
        for n in sh:
            weight_map[n] = fn
    stale = os.path.join(d, "model.safetensors")
    if os.path.exists(stale):  # an earlier single-file save: two copies would disagree on which is read
        os.remove(stale)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files + ["model.safetensors.index.json"]


def read_checkpoint(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(idx):
        return OrderedDict(load_file(os.path.join(d, "model.safetensors")))
    with open(idx) as f:
        index = json.load(f)
    out = OrderedDict()
    for fn in sorted(set(index["weight_map"].values())):
        for k, v in load_file(os.path.join(d, fn)).items():
            assert index["weight_map"][k] == fn, (k, fn)
            out[k] = v
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in out.values())
    return out


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def file_table(d):
    t = {}
    for fn in sorted(os.listdir(d)):
        p = os.path.join(d, fn)
        if fn == "golden.json" or not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            t[fn] = {"bytes": os.path.getsize(p), "sha256": hashlib.sha256(f.read()).hexdigest()}
    return t


# --------------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------------
def make_fixture(fx, out_root, log):
    name = fx["name"]
    d = os.path.join(out_root, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tc = fx["text"]
    cfg_json = k25_wrapper(tc) if fx["wrapper"] == "k25" else tc
    write_json(os.path.join(d, "config.json"), json.loads(json.dumps(cfg_json, sort_keys=True)))

    ck, int4_items, qstats = build_checkpoint(fx)
    prefix = text_prefix(fx)
    hf_cfg = hf_config_from_json(cfg_json)
    model = make_model(hf_cfg, hf_state_from_ckpt(ck, tc, prefix))
    # every fp32 parameter equals the stored value
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32, k

    j, prompt = choose_prompt(model, fx)
    watch = RouterWatch(model)
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        toks, glog, margins = greedy(model, prompt)
        full_ids = torch.tensor([prompt + toks], dtype=torch.long)
        full = model(input_ids=full_ids, use_cache=False).logits[0].float()
    router = watch.report()
    P = len(prompt)
    checks = {
        "teacher_forced_last_row_vs_first_greedy_row_max_abs_diff": float((logits[-1] - glog[0]).abs().max()),
        "full_logits_vs_greedy_logits_max_abs_diff (prefill vs KV-cache decode, HF fp32)":
            float((full[P - 1:P - 1 + G_NEW] - glog).abs().max()),
        "full_logits_argmax_equals_greedy_ids": bool(torch.equal(full[P - 1:P - 1 + G_NEW].argmax(-1), torch.tensor(toks))),
    }
    # float64 reference (eager experts; the router GEMM stays fp32 by HF's own cast)
    try:
        m64 = copy.deepcopy(model).double()
        with torch.no_grad():
            f64 = m64(input_ids=full_ids, use_cache=False).logits[0]
        checks["fp64_model_vs_fp32_full_logits_max_abs_diff"] = float((f64 - full.double()).abs().max())
        checks["fp64_argmax_equals_greedy_ids"] = bool(torch.equal(f64[P - 1:P - 1 + G_NEW].argmax(-1), torch.tensor(toks)))
        del m64
    except Exception as e:  # noqa: BLE001
        checks["fp64_error"] = f"{type(e).__name__}: {e}"
    # HF generate() cross-check (greedy, no EOS)
    try:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = tc.get("pad_token_id", 0) or 0
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=G_NEW, do_sample=False)
        checks["hf_generate_equals_manual_greedy"] = gen[0, P:].tolist() == toks
    except Exception as e:  # noqa: BLE001
        checks["hf_generate_error"] = f"{type(e).__name__}: {e}"

    files = write_checkpoint(d, ck, fx["shards"])
    golden = OrderedDict()
    golden["prompt_ids"] = torch.tensor(prompt, dtype=torch.int32)
    golden["logits"] = logits.contiguous()
    golden["greedy_ids"] = torch.tensor(toks, dtype=torch.int32)
    golden["greedy_logits"] = glog.contiguous()
    golden["greedy_margin"] = margins
    golden["full_logits"] = full.contiguous()
    save_file(dict(golden), os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})

    # Reload the written checkpoint + config.json into a fresh model: logits must be identical.
    with open(os.path.join(d, "config.json")) as f:
        cfg_back = json.load(f)
    ck_back = read_checkpoint(d)
    assert set(ck_back) == set(ck)
    for k in ck:
        assert ck_back[k].dtype == ck[k].dtype and torch.equal(ck_back[k], ck[k]), k
    tc_back = cfg_back.get("text_config", cfg_back)
    model2 = make_model(hf_config_from_json(cfg_back), hf_state_from_ckpt(ck_back, tc_back, prefix))
    with torch.no_grad():
        l2 = model2(input_ids=ids, use_cache=False).logits[0].float()
        f2 = model2(input_ids=full_ids, use_cache=False).logits[0].float()
    checks["reload_from_written_files_logits_identical"] = bool(torch.equal(l2, logits) and torch.equal(f2, full))
    assert checks["reload_from_written_files_logits_identical"], name
    del model2
    if not fx["int4"] and not prefix:
        # transformers' own loader on the per-expert checkpoint names (conversion mapping fuses them)
        try:
            m3 = DeepseekV3ForCausalLM.from_pretrained(
                d, config=hf_config_from_json(cfg_back), dtype=torch.float32,
                attn_implementation="eager", experts_implementation="eager").eval()
            with torch.no_grad():
                l3 = m3(input_ids=ids, use_cache=False).logits[0].float()
            checks["hf_from_pretrained_logits_identical"] = bool(torch.equal(l3, logits))
            del m3
        except Exception as e:  # noqa: BLE001
            checks["hf_from_pretrained_error"] = f"{type(e).__name__}: {e}"

    int4 = None
    if fx["int4"]:
        mods = sorted({re.sub(r"\.(weight|weight_packed|weight_scale|weight_shape)$", "", k) for k in ck
                       if re.search(r"\.(weight|weight_packed)$", k) and k.startswith(prefix)
                       and not re.search(r"(layernorm|norm|embed_tokens|mlp\.gate)\.weight$", k)})
        int4 = {
            "group_size": 32,
            "quantiser": "per group of 32 along K: scale = bf16(absmax/8) (rounded to bf16 first); "
                         "q = clamp(round_half_even(w_fp32/scale), -8, 7); u = q+8 LSB-first nibbles, "
                         "8 per int32 along K; dequant = (u-8)*scale exact in fp32",
            "count_q_eq_-8": qstats["q_min_count"],
            "count_q_eq_7": qstats["q_max_count"],
            "round_half_ties_met": qstats["round_half_ties"],
            "compressed_tensors_crosscheck": ct_crosscheck(int4_items),
            "compressed_tensors_config_checks": ct_config_checks(tc["quantization_config"], mods),
        }
        log(f"  int4 cross-check: {json.dumps(int4['compressed_tensors_crosscheck'])}")

    gj = OrderedDict()
    gj["fixture"] = name
    gj["purpose"] = fx["purpose"]
    gj["script"] = SCRIPT
    gj["command"] = f"python3 {SCRIPT} --out tests/fixtures"
    gj["versions"] = versions()
    gj["device"] = "cpu"
    gj["torch_threads"] = torch.get_num_threads()
    gj["dtype"] = "float32 model; attn_implementation=eager; experts_implementation=eager"
    gj["weight_seed"] = fx["seed"]
    gj["prompt_seed"] = fx["seed"] * 1000 + j
    gj["prompt_choice"] = (f"best of {N_PROMPT_TRIES} random prompts of ordinary ids: >= 8 distinct greedy tokens, then "
                           f"max of min(min greedy margin, {ROUTER_GAP_WEIGHT:g} x min router top-k gap)")
    gj["prompt"] = prompt
    gj["greedy_new_tokens"] = G_NEW
    gj["greedy_ids"] = toks
    gj["greedy_generation"] = "manual argmax loop over DeepseekV3ForCausalLM with the DynamicCache, no EOS stop"
    gj["min_greedy_margin"] = float(margins.min())
    gj["min_greedy_margin_step"] = int(margins.argmin())
    gj["distinct_greedy_tokens"] = len(set(toks))
    gj["golden_tensors"] = {
        "prompt_ids": f"I32 [{P}]",
        "logits": f"F32 [{P}, {tc['vocab_size']}] teacher-forced, one forward over the prompt, no cache",
        "greedy_ids": f"I32 [{G_NEW}]",
        "greedy_logits": f"F32 [{G_NEW}, {tc['vocab_size']}] row i produced greedy_ids[i] (row 0 = prefill last position)",
        "greedy_margin": f"F32 [{G_NEW}] top1 - top2 of each greedy_logits row",
        "full_logits": f"F32 [{P + G_NEW}, {tc['vocab_size']}] teacher-forced over prompt+greedy_ids, one forward, no cache",
    }
    gj["checkpoint_files"] = files
    gj["tensor_prefix"] = prefix or None
    gj["ignored_tensors"] = [k for k in ck if prefix and not k.startswith(prefix)]
    gj["hf"] = hf_derived(model, hf_cfg, tc)
    gj["router"] = router
    gj["checks"] = checks
    if int4:
        gj["int4"] = int4
    gj["facts"] = FACTS
    gj["files"] = file_table(d)
    write_json(os.path.join(d, "golden.json"), gj)
    log(f"{name}: prompt_seed={gj['prompt_seed']} P={P} min_margin={gj['min_greedy_margin']:.4f} "
        f"distinct={gj['distinct_greedy_tokens']} router={json.dumps(router)} checks={json.dumps(checks)}")
    return gj


# --------------------------------------------------------------------------------------------
# INT4 unpacker vectors
# --------------------------------------------------------------------------------------------
def make_int4_vectors(out_root, log):
    if not CT["available"]:
        raise SystemExit(f"compressed-tensors is needed for int4_vectors (packed_ct): {CT['error']}")
    g = torch.Generator().manual_seed(4242)
    N, K = 48, 96
    w = torch.randn((N, K), generator=g) * 0.05  # fp32: no exact .5 ties in w/scale (asserted)
    t = OrderedDict()
    t["weight"] = w
    info = {}
    for gs, sfx in ((32, ""), (16, "_g16")):
        q, scale, packed, deq, ties = quantize_int4(w, gs)
        assert int((q == -8).sum()) > 0 and int((q == 7).sum()) > 0 and ties == 0
        ct_p = ct_pack(q, 4)
        assert ct_p.dtype == torch.int32 and torch.equal(ct_p, packed), "compressed-tensors packing differs"
        assert torch.equal(ct_unpack(ct_p, 4, torch.Size((N, K))).to(torch.int8), q)
        assert torch.equal(dequant_int4(ct_p, scale, (N, K)), deq)
        t["q" + sfx] = q
        t["scale" + sfx] = scale
        t["packed_ct" if gs == 32 else "packed_g16"] = ct_p
        t["dequant" + sfx] = deq
        info[gs] = {"q_eq_-8": int((q == -8).sum()), "q_eq_7": int((q == 7).sum()), "round_half_ties": ties}
    path = os.path.join(out_root, "int4_vectors.safetensors")
    # metadata kept to {"format": "pt"}: several keys are written in a random order (not byte-stable)
    save_file(dict(t), path, metadata={"format": "pt"})
    side = OrderedDict()
    side["file"] = "int4_vectors.safetensors"
    side["script"] = SCRIPT
    side["versions"] = versions()
    side["seed"] = 4242
    side["description"] = (
        "INT4 pack-quantized unpacker vectors, N=48 rows, K=96. weight F32 [48,96] random N(0, 0.05). "
        "q I8 [48,96] in -8..7 (both extremes present); scale BF16 [48,3] = bf16(absmax/8) per group of 32 "
        "along K (rounded to bf16 before dividing); q = clamp(round(w/scale), -8, 7) (no exact .5 ties). "
        "packed_ct I32 [48,12] = compressed_tensors pack_to_int32(q, num_bits=4) (u = q+8; word j of row n "
        "holds k = 8j+i in bits 4i..4i+3, LSB first; read words as uint32). dequant F32 [48,96] = q*scale "
        "(exact). *_g16: the same with group size 16 (scale_g16 BF16 [48,6]; packed_g16 = pack_to_int32(q_g16, 4)); "
        "the packing does not depend on the group size, only the scale indexing k/gs does.")
    side["tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in t.items()}
    side["stats"] = {str(k): v for k, v in info.items()}
    side["crosscheck"] = ("packed_ct/packed_g16 are compressed-tensors' own bytes; asserted equal to this "
                          "script's packer; unpack_from_int32 of them asserted equal to q; dequant asserted equal "
                          "to the fp32 dequantisation of the packed words")
    with open(path, "rb") as f:
        side["sha256"] = hashlib.sha256(f.read()).hexdigest()
    write_json(os.path.join(out_root, "int4_vectors.json"), side)
    log(f"int4_vectors: {json.dumps(info)}")
    return info


# --------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default tests/fixtures, or a temp dir with --check)")
    ap.add_argument("--only", nargs="*", help="fixture names to make (default: all + int4_vectors)")
    ap.add_argument("--check", metavar="DIR", help="after generating, compare every file but golden.json with DIR")
    args = ap.parse_args()
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)

    def log(s):
        print(s, flush=True)

    log(f"versions: {json.dumps(versions())}")
    log(f"compressed-tensors: {json.dumps(CT)}")
    out = args.out
    if out is None:
        out = tempfile.mkdtemp(prefix="kdtree-fixtures-") if args.check else "tests/fixtures"
    os.makedirs(out, exist_ok=True)
    summary = {}
    for fx in fixtures():
        if args.only and fx["name"] not in args.only:
            continue
        gj = make_fixture(fx, out, log)
        summary[fx["name"]] = gj["min_greedy_margin"]
    if not args.only or "int4_vectors" in args.only:
        make_int4_vectors(out, log)
    log(f"min greedy margins: {json.dumps(summary)}")
    if args.check:
        bad = close = 0
        for root, _, fns in os.walk(out):
            for fn in fns:
                if fn in ("golden.json", "int4_vectors.json"):
                    continue
                a = os.path.join(root, fn)
                b = os.path.join(args.check, os.path.relpath(a, out))
                same = os.path.exists(b) and open(a, "rb").read() == open(b, "rb").read()
                if same:
                    continue
                if fn == "golden.safetensors" and os.path.exists(b):
                    ta, tb = load_file(a), load_file(b)
                    ok = set(ta) == set(tb) and all(ta[k].shape == tb[k].shape for k in ta)
                    diffs = {k: float((ta[k].double() - tb[k].double()).abs().max()) for k in ta if k in tb} if ok else {}
                    # another CPU / BLAS build: ids identical, logits within fp32 rounding noise
                    if ok and diffs["prompt_ids"] == 0 and diffs["greedy_ids"] == 0 and max(diffs.values()) <= 1e-4:
                        close += 1
                        log(f"CLOSE {os.path.relpath(a, out)}: same ids, max_abs={diffs}")
                        continue
                    log(f"DIFF {os.path.relpath(a, out)}: keys_equal={set(ta) == set(tb)} max_abs={diffs}")
                else:
                    log(f"DIFF {os.path.relpath(a, out)}")
                bad += 1
        log(f"check: {bad} files differ, {close} goldens equal within 1e-4 with identical ids, "
            f"the rest byte-identical ({out} vs {args.check})")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
