"""``VLLM_DSV4_MTP_DRAFT_PRECISION=stored`` on gfx950: the checkpoint's Quark config, keyed for the draft.

vLLM's in-tree AMD MTP layers ask the quantization config with their own prefixes (``model.layers.{L}.e_proj``,
``model.layers.{L}.attn.wq_b``, ``model.layers.{L}.ffn.experts``, ``L = num_hidden_layers + i``), while a Quark
export names the MTP modules natively (``mtp.{i}.attn.wq_b``), exactly or by ``re:`` pattern. vLLM's
``QuarkConfig`` matches ``layer_quant_config`` keys only by substring or glob, never by ``re:``, so on every
release a ``re:`` key falls through to the global scheme; on 0.32 even exact keys miss the draft (0.33+ re-key
``model.mtp.{i}.`` to ``model.layers.{L}.``, which still leaves ``re:`` keys unmatched).

:func:`stored_draft_quark` resolves each MTP module with the plugin's own Quark matcher (exact, glob and ``re:``,
:class:`~vllm_dsv4_mtp.formats.quark_config.QuarkQuantConfig`) and writes a config dict for the draft alone in
which every prefix the draft asks is an exact ``layer_quant_config`` key or ``exclude`` entry, then hands it to
vLLM's own ``QuarkConfig.from_config``. The target keeps the checkpoint's config object, untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.draft_policy import DRAFT_PRECISION_ENV, MtpPrecisionError
from vllm_dsv4_mtp.formats.quark_config import QuarkConfigError, QuarkQuantConfig, classify_weight_spec

#: the draft's fused linears and the native shards vLLM's ``packed_modules_mapping`` unfolds them to
PACKED = {"fused_wqa_wkv": ["wq_a", "wkv"], "gate_up_proj": ["w1", "w3"]}


@dataclass(frozen=True)
class DraftModule:
    """One prefix the in-tree draft asks the quantization config with, and the native modules stored for it."""

    prefix: str  # the draft's prefix, e.g. model.layers.61.attn.fused_wqa_wkv
    keys: tuple[str, ...]  # the names vLLM looks up for it (a packed linear: one per shard)
    native: tuple[str, ...]  # the checkpoint's module names, e.g. mtp.0.attn.wq_a, mtp.0.attn.wkv


def draft_modules(spec: DeepseekV4Spec) -> list[DraftModule]:
    """Every quantizable module of the in-tree MTP layers, by the prefix vLLM builds it with."""
    out = []
    for i in range(spec.num_nextn_predict_layers):
        layer, mtp = f"model.layers.{spec.num_hidden_layers + i}.", f"mtp.{i}."
        for leaf in ("e_proj", "h_proj", "attn.wq_b", "attn.wo_a", "attn.wo_b"):
            out.append(DraftModule(layer + leaf, (layer + leaf,), (mtp + leaf,)))
        for parent, fused in (("attn.", "fused_wqa_wkv"), ("ffn.shared_experts.", "gate_up_proj")):
            shards = PACKED[fused]
            out.append(
                DraftModule(
                    layer + parent + fused,
                    tuple(layer + parent + s for s in shards),
                    tuple(mtp + parent + s for s in shards),
                )
            )
        down = layer + "ffn.shared_experts.down_proj"
        out.append(DraftModule(down, (down,), (mtp + "ffn.shared_experts.w2",)))
        experts = layer + "ffn.experts"
        native = tuple(f"{mtp}ffn.experts.{e}.w{k}" for e in range(spec.n_routed_experts) for k in (1, 2, 3))
        out.append(DraftModule(experts, (experts,), native))
    return out


@dataclass
class StoredPlan:
    """What ``stored`` builds: ``config`` (vLLM's ``QuarkConfig`` for the draft, None where the draft is BF16
    anyway), each draft prefix's scheme (``schemes``: "mxfp4" / "fp8-block" / "bf16") and ``note``, the start-up
    line saying so."""

    config: Any
    schemes: dict[str, str] = field(default_factory=dict)
    note: str = ""


def _resolve(quark: QuarkQuantConfig, module: DraftModule) -> tuple[str, dict[str, Any] | None]:
    """The one (field, LAYER config) all native modules behind ``module`` share; None config: excluded."""
    seen: dict[str, tuple[str, dict | None]] = {}
    for name in module.native:
        if quark.is_excluded(name):
            seen[name] = ("exclude", None)
        else:
            seen[name] = quark.layer_entry(name)
    first, (path, cfg) = next(iter(seen.items()))
    for name, (p, c) in seen.items():
        if c != cfg:
            raise MtpPrecisionError(
                f"{quark.source}: {DRAFT_PRECISION_ENV}=stored: vLLM builds {module.prefix} as one layer, but "
                f"quantization_config gives {first} {path} and {name} {p}; use {DRAFT_PRECISION_ENV}=bf16"
            )
    return path, cfg


def stored_draft_quark(spec: DeepseekV4Spec, qc: Mapping[str, Any], source: str) -> tuple[dict, dict[str, str]]:
    """The Quark ``quantization_config`` dict for the draft (every draft prefix keyed exactly) and each prefix's
    scheme. ``qc``: the checkpoint's ``quantization_config``."""
    quark = QuarkQuantConfig.from_dict(dict(qc), source=f"{source}/config.json")
    layers: dict[str, Any] = {}
    exclude: list[str] = []
    schemes: dict[str, str] = {}
    for module in draft_modules(spec):
        path, cfg = _resolve(quark, module)
        if cfg is None:
            exclude.extend(module.keys)
            schemes[module.prefix] = "bf16"
            continue
        try:
            kind = classify_weight_spec(cfg.get("weight"))
        except ValueError as e:
            where = f"quantization_config.{path}.weight (for {module.native[0]})"
            raise QuarkConfigError(f"{quark.source}: {where}: {e}") from None
        schemes[module.prefix] = kind or "bf16"
        for key in module.keys:
            layers[key] = copy.deepcopy(cfg)
    draft = copy.deepcopy(dict(qc))
    draft["layer_quant_config"] = layers
    draft["exclude"] = exclude
    return draft, schemes


def stored_plan(spec: DeepseekV4Spec, source: str, stored_dtypes: Mapping[str, str] | None) -> StoredPlan:
    """What ``stored`` builds for this checkpoint, or a :class:`MtpPrecisionError` naming why it cannot apply.

    ``stored_dtypes``: ``{mtp tensor: safetensors dtype}`` of a local checkpoint (None for a hub id: the loader
    checks each tensor against its parameter instead)."""
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

    qc = spec.quantization_config
    if not qc:
        return StoredPlan(None, note="the checkpoint has no quantization_config: stored is BF16")
    method = qc.get("quant_method")
    if method != "quark":
        raise MtpPrecisionError(
            f"{source}/config.json: {DRAFT_PRECISION_ENV}=stored on gfx950 builds the draft from a Quark "
            f"quantization_config, but quantization_config.quant_method is {method!r}; use "
            f"{DRAFT_PRECISION_ENV}=bf16"
        )
    draft, schemes = stored_draft_quark(spec, qc, source)
    if all(s == "bf16" for s in schemes.values()):
        quantized = sorted(n for n, d in (stored_dtypes or {}).items() if d in ("F8_E4M3", "U8", "I8"))
        if quantized:
            raise MtpPrecisionError(
                f"{source}: {DRAFT_PRECISION_ENV}=stored: quantization_config.exclude covers every MTP module, but "
                f"{quantized[0]} is stored {stored_dtypes[quantized[0]]} (and {len(quantized) - 1} more quantized "
                f"MTP tensors): no scheme in the config describes them; use {DRAFT_PRECISION_ENV}=bf16"
            )
        return StoredPlan(None, schemes, "quantization_config excludes every MTP module: stored is BF16")
    config = QuarkConfig.from_config(draft)
    config.packed_modules_mapping = dict(PACKED)
    return StoredPlan(config, schemes)


def mtp_stored_dtypes(model: str) -> dict[str, str] | None:
    """``{mtp tensor: safetensors dtype}`` of a local checkpoint directory; None for a hub id."""
    from pathlib import Path

    if not Path(model).is_dir():
        return None
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    return {n: i.dtype for n, i in CheckpointReader(model).tensors.items() if n.startswith("mtp.")}


def unkeyed_quantized(model: Any, schemes: Mapping[str, str]) -> list[str]:
    """Prefixes of the draft's quantized layers the plugin did not key: each would take Quark's global scheme.
    Empty when every quantized module was resolved from the checkpoint's own entries."""
    out = []
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        # vLLM's unquantized methods (linear, MoE, embedding / LM head) have no scheme to fall back to
        if method is None or type(method).__name__.startswith("Unquantized"):
            continue
        prefix = getattr(m, "layer_name", None) or getattr(m, "prefix", None)
        if prefix not in schemes:
            out.append(str(prefix))
    return out


def summary(schemes: Mapping[str, str]) -> str:
    """``e_proj fp8-block, ..., ffn.experts mxfp4`` (the layer prefix dropped; one MTP layer's worth)."""
    seen: dict[str, str] = {}
    for prefix, scheme in schemes.items():
        seen.setdefault(prefix.split(".", 3)[-1], scheme)
    return ", ".join(f"{leaf} {scheme}" for leaf, scheme in seen.items())
