#!/usr/bin/env python3
"""dflash_package_golden.py -- goldens for kdtree's DFlash drafter from z-lab's `dflash` package itself.

WHAT IT IS: the second, independent reference of the drafter tests. python/dflash_reference.py is
our own PyTorch forward written from SPEC-DDTREE.md; this script runs the published one:
`dflash.model.DFlashDraftModel.from_pretrained(<fixture dir>)` (transformers' Qwen3 config, its
Qwen3RotaryEmbedding with transformers' YaRN rule, the package's attention and compute_logits),
driven the way the package's `dflash_generate` drives it: noise_embedding =
F.embedding(block, target embed) * input_embedding_scale, the model over
position_ids [cache_len, start + B) with a DynamicCache, the last B - 1 rows kept, the cache cropped
back to `start`, then model.compute_logits(hidden, target lm_head) (output_multiplier,
final_logit_softcapping). Nothing in it comes from kdtree's C++.

WHAT IT MAKES: for each fixture (dflash-rope, dflash-yarn under --fixtures, normally
tests/fixtures), package_golden.safetensors + package_golden.json. Each VARIANT is the fixture's
config.json with a patch (package_golden.json "variants": name -> {"set": {dotted.key: value},
"unset": [dotted.key]}) and the same model.safetensors; the inputs are the fixture's own
golden.safetensors taps1/block1/taps2/block2:
    <variant>.logits1 F32 [B-1, V]   after appending taps1, block1 at positions T1..
    <variant>.logits2 F32 [B-1, V]   after appending taps2, block2 at positions T1+T2..
    <variant>.attention_scaling F64 [1]   the package's rotary_emb.attention_scaling
The config variants cover the YaRN amplitude rule (attention_factor, the mscale ratio, an absent
mscale) and the dflash_config knobs the package reads (input_embedding_scale, output_multiplier,
final_logit_softcapping, given in dflash_config or at the top level, as _draft_value looks them up,
and an absent target_layer_ids, which the package derives from num_target_layers).

HOW TO RE-RUN (CPU, deterministic to ~1e-7; the venv of python/requirements-fixtures.txt plus
`pip install dflash==0.1.0`):

    python3 python/dflash_package_golden.py --fixtures tests/fixtures
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile

import safetensors
import torch
import transformers
from dflash.model import DFlashDraftModel, _crop_to, _draft_value, _make_cache, _raw_input_embeddings
from safetensors.torch import load_file, save_file

SCRIPT = "python/dflash_package_golden.py"
TARGET = "k2-bf16"
TORCH_THREADS = 4

YARN_VARIANTS = {
    "as_is": {},
    "attention_factor": {"set": {"rope_scaling.attention_factor": 1.25}},
    "mscale_ratio": {"set": {"rope_scaling.mscale": 2.0, "rope_scaling.mscale_all_dim": 0.5}},
    "mscale_absent": {"unset": ["rope_scaling.mscale"]},
    "input_embedding_scale": {"set": {"dflash_config.input_embedding_scale": 1.7}},
    "output_multiplier": {"set": {"dflash_config.output_multiplier": 0.6}},
    "final_logit_softcapping": {"set": {"dflash_config.final_logit_softcapping": 4.0}},
    "knobs_top_level": {"set": {"input_embedding_scale": 0.8, "output_multiplier": 1.3, "final_logit_softcapping": 9.0}},
}
VARIANTS = {
    "dflash-rope": {"as_is": {}, "target_layer_ids_absent": {"unset": ["dflash_config.target_layer_ids"]},
                    "output_multiplier": {"set": {"dflash_config.output_multiplier": 2.0}}},
    "dflash-yarn": YARN_VARIANTS,
}


def patched(cfg, patch):
    out = copy.deepcopy(cfg)
    for key, value in patch.get("set", {}).items():
        *path, last = key.split(".")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    for key in patch.get("unset", []):
        *path, last = key.split(".")
        node = out
        for p in path:
            node = node[p]
        del node[last]
    return out


def run_package(model_dir, embed, lm_head, rounds):
    """The package's drafter over `rounds` [(taps, block)], as dflash_generate calls it."""
    model = DFlashDraftModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
    head.weight.data = lm_head.clone()
    emb_module = torch.nn.Embedding(embed.shape[0], embed.shape[1])
    emb_module.weight.data = embed.clone()

    class Target(torch.nn.Module):  # the two things the package reads off the target
        def get_input_embeddings(self):
            return emb_module

    target = Target()
    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    cache = _make_cache(model.config)
    out, cache_len = [], 0
    with torch.inference_mode():
        for taps, block in rounds:
            start = cache_len + taps.shape[0]
            B = block.shape[0]
            noise = _raw_input_embeddings(target, block.long()[None], scale)
            pos = torch.arange(cache_len, start + B)[None]
            hidden = model(target_hidden=taps[None], noise_embedding=noise, position_ids=pos,
                           past_key_values=cache, use_cache=True)[:, 1 - B:, :]
            _crop_to(cache, start)
            cache_len = start
            out.append(model.compute_logits(hidden, head)[0].float().contiguous())
    return out, float(model.rotary_emb.attention_scaling), list(model.target_layer_ids)


def make(fixtures, name):
    fdir = os.path.join(fixtures, name)
    with open(os.path.join(fdir, "config.json")) as f:
        cfg = json.load(f)
    tw = load_file(os.path.join(fixtures, TARGET, "model.safetensors"))
    embed, lm_head = tw["model.embed_tokens.weight"].float(), tw["lm_head.weight"].float()
    g = load_file(os.path.join(fdir, "golden.safetensors"))
    rounds = [(g["taps1"], g["block1"]), (g["taps2"], g["block2"])]
    tensors, info = {}, {}
    for vname, patch in VARIANTS[name].items():
        tmp = tempfile.mkdtemp(prefix="dflash-pkg-")
        try:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(patched(cfg, patch), f, indent=2)
            shutil.copy(os.path.join(fdir, "model.safetensors"), tmp)
            (l1, l2), scaling, taps = run_package(tmp, embed, lm_head, rounds)
        finally:
            shutil.rmtree(tmp)
        tensors[f"{vname}.logits1"], tensors[f"{vname}.logits2"] = l1, l2
        tensors[f"{vname}.attention_scaling"] = torch.tensor([scaling], dtype=torch.float64)
        ref = load_file(os.path.join(fdir, "golden.safetensors"))
        vs_ours = float(max((l1.double() - ref["logits1"].double()).abs().max() / ref["logits1"].double().abs().max(),
                            (l2.double() - ref["logits2"].double()).abs().max() / ref["logits2"].double().abs().max()))
        info[vname] = {**{"set": {}, "unset": []}, **patch, "attention_scaling": scaling, "target_layer_ids": taps,
                       "rel_diff_vs_dflash_reference_py": vs_ours}
        print(f"{name}/{vname}: attention_scaling {scaling:.6f}, taps {taps}, vs dflash_reference.py {vs_ours:.2e}")
    out = os.path.join(fdir, "package_golden.safetensors")
    save_file(tensors, out, metadata={"format": "pt"})
    os.chmod(out, 0o644)
    meta = {
        "made_by": SCRIPT,
        "reference": "dflash.model.DFlashDraftModel (z-lab dflash on PyPI) loaded with from_pretrained from the "
                     "fixture's config.json (patched per variant) and model.safetensors, fp32",
        "inputs": f"tests/fixtures/{name}/golden.safetensors taps1, block1, taps2, block2; target tests/fixtures/{TARGET} "
                  "embed_tokens and lm_head (bf16 widened to fp32)",
        "versions": {"python": platform.python_version(), "dflash": importlib.metadata.version("dflash"),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__},
        "torch_threads": TORCH_THREADS,
        "variants": info,
        "note": "rel_diff_vs_dflash_reference_py compares each variant with dflash_reference.py's goldens of the "
                "unpatched config: ~1e-7 for as_is (the two references agree), large where the patch changes the drafter",
    }
    with open(os.path.join(fdir, "package_golden.json"), "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default="tests/fixtures")
    args = ap.parse_args()
    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(0)
    for name in VARIANTS:
        make(args.fixtures, name)


if __name__ == "__main__":
    main()
