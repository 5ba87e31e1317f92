"""A tiny DeepSeek-V4 checkpoint for tests: every architectural feature, a couple of million parameters.

:func:`tiny_config` gives the ``config.json`` dict (native HF-style field names, the same keys as the released
configs); :func:`build_tiny_checkpoint` writes random weights in the native DeepSeek release naming
(``embed.weight``, ``layers.N.attn.*``, ``mtp.0.*``, ...) plus a tokenizer that vLLM and transformers load
from the directory.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

# The default tiny model. Widths are small for CPU speed; the STRUCTURE is the real one: 4 residual streams
# (hc_mult 4), a 64-dim interleaved rope part at the end of each head, grouped low-rank output projection
# with 2 groups, one SWA / C4 / C128 / C4 main layer each, one hash-routed layer, one SWA MTP layer, and an
# index_topk small enough that the lightning indexer really selects once a sequence passes 4*8 = 32 tokens.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "num_hash_layers": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The tiny config.json dict with ``overrides`` applied (validated).

    ``num_hidden_layers`` may be overridden together with ``compress_ratios`` (length num_hidden_layers +
    num_nextn_predict_layers). If only ``compress_ratios`` is given, ``num_hidden_layers`` follows from it.
    """
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    cfg = copy.deepcopy(TINY_CONFIG)
    cfg.update(copy.deepcopy(overrides))
    if "compress_ratios" in overrides and "num_hidden_layers" not in overrides:
        cfg["num_hidden_layers"] = len(cfg["compress_ratios"]) - cfg["num_nextn_predict_layers"]
    elif "num_nextn_predict_layers" in overrides and "compress_ratios" not in overrides:
        n = cfg["num_hidden_layers"]
        cfg["compress_ratios"] = list(cfg["compress_ratios"][:n]) + [0] * cfg["num_nextn_predict_layers"]
    DeepseekV4Spec.from_dict(cfg, source="tiny_config()")
    return cfg


def hf_config(path):
    """HF transformers' ``DeepseekV4Config`` for a checkpoint directory, for any compression ratios.

    transformers 5.19 maps the native ``compress_ratios`` through a fixed {0: SWA, 4: CSA, 128: HCA} table and
    raises ``KeyError`` on other ratios; this passes the equivalent ``layer_types`` + ``compress_rates``
    instead (:meth:`DeepseekV4Spec.hf_layer_schedule`), so test configs such as ``[0, 4, 8, 0]`` load in the
    oracle too.
    """
    from transformers import DeepseekV4Config

    from vllm_dsv4_mtp.config import DeepseekV4Spec

    f = Path(path) / "config.json"
    raw = json.loads(f.read_text())
    spec = DeepseekV4Spec.from_dict(raw, source=str(f))
    d = {k: v for k, v in raw.items() if k not in ("compress_ratios", "quantization_config")}
    d.update(spec.hf_layer_schedule())
    return DeepseekV4Config(**d)


# ---------------------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------------------
def _init_tensor(slot, spec, g):
    """Random values for one logical tensor, scaled so activations stay O(1) through the tiny model.

    Linear weights: N(0, 1/in) (unit-variance outputs for unit-variance inputs); output projections into the
    residual streams (wo_b, w2, e/h_proj) half that, so 4 blocks of hc_post do not blow up; RMSNorm weights
    around 1; hyper-connection logits O(1) so pre/post/comb really mix the 4 streams; the head at 2/sqrt(D) so
    logits after the final norm have std ~2 (peaked, not tied). F32 where the release stores F32.
    """
    import torch

    name, shape = slot.name, slot.shape

    def normal(std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    leaf = name.rsplit(".", 2)
    if name.endswith("tid2eid"):
        # each token gets num_experts_per_tok distinct experts (a random permutation's first k)
        perm = torch.rand((shape[0], spec.n_routed_experts), generator=g).argsort(dim=-1)
        return perm[:, : shape[1]].to(torch.int64)
    if "hc_" in name and name.endswith("_fn"):
        return normal(1.0 / math.sqrt(shape[1]))
    if "hc_" in name and name.endswith("_base"):
        return normal(0.5)
    if "hc_" in name and name.endswith("_scale"):
        return 0.25 + 0.5 * torch.rand(shape, generator=g)
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith(".ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if len(shape) == 1:  # RMSNorm weights
        return (1.0 + normal(0.1)).to(torch.bfloat16)
    if name == "embed.weight":
        return normal(1.0).to(torch.bfloat16)
    if name == "head.weight":
        return normal(2.0 / math.sqrt(shape[1])).to(torch.bfloat16)
    residual_out = leaf[-2] in ("wo_b", "w2", "e_proj", "h_proj")
    std = (0.5 if residual_out else 1.0) / math.sqrt(shape[1])
    return normal(std).to(torch.bfloat16)


def _quark_exclude(spec, slots, expert_precision: str, shared_precision: str) -> list[str]:
    """Native module names Quark leaves unquantized: every linear that is not stored MXFP4 (MTP included)."""
    out = []
    for s in slots.values():
        if not s.name.endswith(".weight") or len(s.shape) != 2:
            continue
        if s.is_mtp:
            out.append(s.module)
        elif (
            s.kind == "routed_experts"
            and expert_precision == "mxfp4"
            or s.kind == "shared_experts"
            and shared_precision == "mxfp4"
        ):
            continue
        else:
            out.append(s.module)
    return out


def _layer_storage(slot, experts: str, linears: str, shared_experts: str) -> str:
    """Storage precision of one linear weight in the tiny checkpoint (MTP: BF16 unless official FP8)."""
    if not slot.quantizable:
        return "bf16"
    official = experts == "fp4-official" or (experts == "bf16" and linears == "fp8")
    if slot.is_mtp and not official:
        return "bf16"  # the project's policy: MTP kept BF16 (Quark `exclude`)
    if slot.kind == "routed_experts":
        return experts
    if slot.kind == "shared_experts":
        return {"mxfp4": "mxfp4", "fp8": "fp8-block"}.get(shared_experts, "bf16")
    return "fp8-block" if linears == "fp8" else "bf16"


def _check_layout(experts: str, linears: str, shared_experts: str | None) -> str:
    """Validate the storage choices of :func:`build_tiny_checkpoint`; returns the shared experts' storage."""
    if experts not in ("bf16", "mxfp4", "fp4-official"):
        raise ValueError(f"experts must be 'bf16', 'mxfp4' or 'fp4-official', got {experts!r}")
    if linears not in ("bf16", "fp8"):
        raise ValueError(f"linears must be 'bf16' or 'fp8', got {linears!r}")
    if linears == "fp8" and experts == "mxfp4":
        raise ValueError(
            "linears='fp8' with experts='mxfp4' (a Quark config with FP8 layer entries) is not "
            "built by the tiny builder; use linears='bf16' with Quark MXFP4 experts"
        )
    shared = shared_experts or linears
    if shared not in ("bf16", "fp8", "mxfp4") or (shared == "mxfp4" and experts != "mxfp4"):
        raise ValueError(f"shared_experts must be 'bf16', 'fp8', or 'mxfp4' with experts='mxfp4', got {shared!r}")
    return shared


def _with_quantization_config(cfg: dict[str, Any], spec, slots, storages, experts: str, shared: str) -> dict:
    """``cfg`` with the ``quantization_config`` (and ``expert_dtype``) that describe how it is stored."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    cfg = dict(cfg)
    cfg.pop("quantization_config", None)
    if experts == "mxfp4":
        from vllm_dsv4_mtp.formats.quark_config import mxfp4_experts_config

        cfg["quantization_config"] = mxfp4_experts_config(exclude=_quark_exclude(spec, slots, experts, shared))
    elif experts == "fp4-official" or "fp8-block" in storages.values():  # the official release's config
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    if experts == "fp4-official":
        cfg["expert_dtype"] = "fp4"
    elif experts == "bf16":
        cfg.pop("expert_dtype", None)
    DeepseekV4Spec.from_dict(cfg, source="build_tiny_checkpoint(config)")
    return cfg


def build_tiny_checkpoint(
    out_dir,
    config: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    experts: str = "bf16",
    mtp: bool = True,
    linears: str = "bf16",
    shared_experts: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    tokenizer: bool = True,
):
    """Write a random tiny DeepSeek-V4 checkpoint in the native release naming; returns ``Path(out_dir)``.

    experts: "bf16" | "mxfp4" (Quark: packed uint8 ``.weight`` + uint8 E8M0 ``.weight_scale``, quantized from
        the same BF16 weights a "bf16" build with the same seed has, plus a Quark ``quantization_config`` whose
        ``exclude`` lists every other linear, MTP included) | "fp4-official" (the official release's int8
        packed ``.weight`` + F8_E8M0 ``.scale``).
    linears: "bf16" | "fp8": attention projections, ``indexer.wq_b`` and shared experts in FP8 e4m3 with
        128x128 E8M0 block scales (official layout ``.scale`` and ``quant_method: fp8`` config; MTP included,
        as in the release) - only with experts "bf16" or "fp4-official".
    shared_experts: "bf16" | "fp8" | "mxfp4" (default: follow ``linears``); "mxfp4" needs experts "mxfp4"
        (the AMD export's FSE layout: main-layer shared experts MXFP4, MTP's BF16).
    mtp: include the ``mtp.*`` tensors (``num_nextn_predict_layers`` in config.json is kept either way, like a
        release whose MTP weights were stripped).

    The random values depend only on ``config`` and ``seed``: every precision variant stores the same
    underlying BF16 weights.
    """
    import torch

    from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointWriter

    shared = _check_layout(experts, linears, shared_experts)
    cfg = dict(config) if config is not None else tiny_config()
    spec = DeepseekV4Spec.from_dict(cfg, source="build_tiny_checkpoint(config)")
    tok = None
    if tokenizer:  # first: a vocabulary the tiny tokenizer cannot have fails before any weight is written
        from vllm_dsv4_mtp.tools.tiny_tokenizer import train_tokenizer

        tok = train_tokenizer(spec.vocab_size)
    slots = weight_slots(spec, mtp=True)
    out = Path(out_dir)
    g = torch.Generator().manual_seed(seed)

    storages = {name: _layer_storage(s, experts, linears, shared) for name, s in slots.items()}
    cfg = _with_quantization_config(cfg, spec, slots, storages, experts, shared)

    with CheckpointWriter(out, max_shard_bytes=max_shard_bytes, overwrite=True) as w:
        for name, slot in slots.items():
            value = _init_tensor(slot, spec, g)  # drawn for every slot so variants share their weights
            if slot.is_mtp and not mtp:
                continue
            for n, t in _store(slot, value, storages[name]).items():
                w.add(n, t)
        w.write_config(cfg)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id}, indent=2) + "\n"
    )
    if tok is not None:
        from vllm_dsv4_mtp.tools.tiny_tokenizer import save_tokenizer

        save_tokenizer(tok, out, model_max_length=spec.max_position_embeddings)
    return out


def _store(slot, value, precision: str) -> dict[str, Any]:
    """The stored tensors of one slot in a storage precision (see config.quantized_expectations)."""
    import torch

    from vllm_dsv4_mtp.config import scale_name

    if precision == "bf16":
        return {slot.name: value}
    w = value.float()
    if precision in ("mxfp4", "fp4-official"):
        from vllm_dsv4_mtp.formats import mxfp4

        packed, scales = mxfp4.quantize(w)
        if precision == "mxfp4":  # Quark: uint8 codes + uint8 E8M0 .weight_scale
            return {slot.name: packed, scale_name(slot.name, "mxfp4"): scales}
        # official release: int8 packed + F8_E8M0 .scale (same bytes)
        return {
            slot.name: packed.view(torch.int8),
            scale_name(slot.name, "fp4-official"): scales.view(torch.float8_e8m0fnu),
        }
    if precision == "fp8-block":
        from vllm_dsv4_mtp.formats.fp8 import quantize_block_fp8

        q, s = quantize_block_fp8(w, scale_format="e8m0")
        if s.dtype == torch.uint8:
            s = s.view(torch.float8_e8m0fnu)
        return {slot.name: q, scale_name(slot.name, "fp8-block"): s}
    raise ValueError(f"unknown storage precision {precision!r}")
