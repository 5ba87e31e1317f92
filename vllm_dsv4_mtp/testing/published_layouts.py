"""Tiny checkpoints in the layouts DeepSeek-V4 is published in (test fixtures, not the builder's defaults).

Each layout is one table, :data:`LAYOUTS`: for each kind of linear (main model / MTP layer), how it is stored.
The facts, and where they come from:

* ``official`` -- ``deepseek-ai/DeepSeek-V4-Pro`` / ``-Flash``: ``quantization_config`` =
  :data:`OFFICIAL_QUANTIZATION_CONFIG` and **no** ``expert_dtype`` field (vLLM then takes the experts as FP4);
  attention projections, the indexer's ``wq_b``, shared experts and ``e_proj`` / ``h_proj`` FP8 e4m3 with a
  128x128 ``.scale`` (F8_E8M0); routed experts packed E2M1 in I8 with a per-32 ``.scale`` (F8_E8M0), MTP
  layer included; everything else BF16 / F32 (the public tensor table: 145,116 tensors, 805.32 GiB, which
  ``vllm_dsv4_mtp.config.expected_tensors`` reproduces).
* ``amd`` -- ``amd/DeepSeek-V4-Pro-MXFP4``: a Quark ``quantization_config`` whose global scheme is OCP MXFP4
  W4A4; routed experts and the main layers' shared experts MXFP4 (U8 ``.weight`` + U8 ``.weight_scale``),
  the shared ones so they can fuse into the routed grouped GEMM (vllm-project/vllm#48044); projections kept
  block FP8 with a ``.weight_scale`` (vllm#48044: "checkpoint uses .weight_scale"); in the MTP layer the
  routed experts MXFP4 and the shared expert block FP8 (sglang-project/sglang#31054; vLLM's own test fixture
  ``get_deepseek_v4_quark_config`` keys them ``re:mtp\\.0\\.ffn\\.experts\\.\\d+\\.w1`` / ``...shared_experts
  \\.w1``). ``layer_quant_config`` keys are ``re:`` patterns, ``exclude`` entries native names.
* ``amd-mtp-original`` -- the same export with its MTP layer excluded and kept "in its original checkpoint
  format" (Quark's file-to-file flow keeps excluded layers as the source stores them): the MTP tensors exactly
  as in ``official``, under the Quark config. ``mtp_exclude`` says how the exclusion is written (exact names or
  a pattern), both seen in Quark exports.

The values are the BF16 weights of ``tools.tiny.build_tiny_checkpoint(seed=...)``, so every layout of one seed
stores the same model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader, CheckpointWriter
from vllm_dsv4_mtp.formats.fp8 import quantize_block_fp8
from vllm_dsv4_mtp.formats.quark_config import fp8_block_layer_config, mxfp4_experts_config, mxfp4_layer_config

OFFICIAL_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# storage per (where, kind): "fp8.scale" / "fp8.weight_scale" (FP8 block), "fp4.scale" (I8 + F8_E8M0 .scale),
# "mxfp4" (U8 + U8 .weight_scale), "bf16"
_OFFICIAL = {
    "attention": "fp8.scale",
    "indexer": "fp8.scale",
    "shared_experts": "fp8.scale",
    "mtp_proj": "fp8.scale",
    "routed_experts": "fp4.scale",
}
_AMD_MAIN = {
    "attention": "fp8.weight_scale",
    "indexer": "fp8.weight_scale",
    "shared_experts": "mxfp4",
    "routed_experts": "mxfp4",
}
_AMD_MTP = {
    "attention": "fp8.weight_scale",
    "mtp_proj": "fp8.weight_scale",
    "shared_experts": "fp8.weight_scale",
    "routed_experts": "mxfp4",
}
LAYOUTS = {
    "official": (_OFFICIAL, _OFFICIAL),
    "amd": (_AMD_MAIN, _AMD_MTP),
    "amd-mtp-original": (_AMD_MAIN, _OFFICIAL),
}

_FP8_PROJ = r"(wq_a|wq_b|wkv|wo_a|wo_b)"


def amd_quark_config(spec: DeepseekV4Spec, mtp: str = "amd", mtp_exclude: str = "pattern") -> dict[str, Any]:
    """The Quark ``quantization_config`` of the AMD export for ``spec`` (see the module docstring).

    ``mtp``: "amd" (the MTP layer declared in ``layer_quant_config``) or "original" (excluded);
    ``mtp_exclude``: "pattern" (``re:mtp\\..*``) or "exact" (every MTP module name) when excluded.
    """
    fp8 = fp8_block_layer_config()
    layers = {rf"re:layers\.\d+\.attn\.{_FP8_PROJ}$": fp8, r"re:layers\.\d+\.attn\.indexer\.wq_b$": fp8}
    exclude = ["embed", "head", r"re:.*\.ffn\.gate$", r"re:.*\.compressor\..*", r"re:.*\.indexer\.weights_proj$"]
    if mtp == "amd":
        layers.update(
            {
                rf"re:mtp\.\d+\.attn\.{_FP8_PROJ}$": fp8,
                r"re:mtp\.\d+\.[eh]_proj$": fp8,
                r"re:mtp\.\d+\.ffn\.experts\.\d+\.w[123]$": mxfp4_layer_config(),
                r"re:mtp\.\d+\.ffn\.shared_experts\.w[123]$": fp8,
            }
        )
    elif mtp_exclude == "pattern":
        exclude.append(r"re:mtp\..*")
    else:
        exclude += sorted({s.module for s in weight_slots(spec).values() if s.is_mtp and s.quantizable})
    return mxfp4_experts_config(exclude, layer_quant_config=layers)


def _encode(name: str, w: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    base = name[: -len(".weight")]
    if storage == "bf16":
        return {name: w}
    if storage.startswith("fp8."):
        q, s = quantize_block_fp8(w.float(), scale_format="e8m0")
        return {name: q, f"{base}.{storage[4:]}": s.view(torch.float8_e8m0fnu)}
    packed, scales = mxfp4.quantize(w.float())
    if storage == "fp4.scale":
        return {name: packed.view(torch.int8), f"{base}.scale": scales.view(torch.float8_e8m0fnu)}
    return {name: packed, f"{base}.weight_scale": scales}


def build_published(
    out: str | Path, layout: str, *, seed: int = 0, config: dict[str, Any] | None = None, mtp_exclude: str = "pattern"
) -> Path:
    """Write a tiny checkpoint in ``layout`` (a key of :data:`LAYOUTS`) to ``out``; returns ``Path(out)``."""
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    out = Path(out)
    cfg = copy.deepcopy(config) if config is not None else tiny_config()
    cfg.pop("expert_dtype", None)  # the published configs carry none
    cfg.pop("quantization_config", None)
    src = build_tiny_checkpoint(out.with_name(out.name + ".bf16-src"), cfg, seed=seed)
    spec = DeepseekV4Spec.from_dict(cfg)
    main, mtp = LAYOUTS[layout]
    if layout == "official":
        cfg["quantization_config"] = copy.deepcopy(OFFICIAL_QUANTIZATION_CONFIG)
    else:
        cfg["quantization_config"] = amd_quark_config(spec, "amd" if layout == "amd" else "original", mtp_exclude)
    reader = CheckpointReader(src)
    with CheckpointWriter(out, max_shard_bytes=2**20, overwrite=True) as w:
        for name, slot in weight_slots(spec).items():
            storage = (mtp if slot.is_mtp else main).get(slot.kind, "bf16") if slot.quantizable else "bf16"
            for n, t in _encode(name, reader.get(name), storage).items():
                w.add(n, t)
        w.write_config(cfg)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    return out


def stored_dtypes(path: str | Path) -> dict[str, str]:
    """``{tensor name: safetensors dtype}`` of a checkpoint (for asserting a layout)."""
    return {n: i.dtype for n, i in CheckpointReader(path).tensors.items()}


def config_of(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())
