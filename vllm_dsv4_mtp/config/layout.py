"""The native DeepSeek-V4 tensor layout of a config: every tensor's name, logical shape, dtype and module kind.

:func:`weight_slots` is the precision-independent table (one row per logical tensor); :func:`expected_tensors`
lists every stored tensor of the release layout in a chosen storage precision (quantized weights and their
scales), which the loader, the quantizer, ``inspect`` and the capacity check share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_dsv4_mtp.config.spec import FP8_BLOCK, MX_GROUP, DeepseekV4Spec


@dataclass(frozen=True)
class WeightSlot:
    """One logical tensor of the native layout.

    ``shape`` is the logical (unquantized) shape. ``linear`` slots are ``[out, in]`` matrices of a linear layer
    and may be stored quantized (``quantizable`` lists the storage precisions the model accepts); the others
    are stored in exactly ``dtypes``.
    """

    name: str  # full tensor name, e.g. "layers.3.attn.wq_a.weight"
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # safetensors dtypes when stored unquantized
    kind: str  # one of MODULE_KINDS
    layer: int | None  # layer id (MTP layers >= num_hidden_layers), None for model-level tensors
    quantizable: tuple[str, ...] = ()  # storage precisions besides "bf16" for linear weights

    @property
    def module(self) -> str:
        """Module name (tensor name without ``.weight``)."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name

    @property
    def is_mtp(self) -> bool:
        return self.name.startswith("mtp.")


@dataclass(frozen=True)
class TensorExpectation:
    """What one stored tensor must look like: shape, accepted safetensors dtypes, module kind."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    kind: str
    role: str = "weight"  # "weight" | "scale"
    precision: str = "bf16"  # the precision of the weight this tensor belongs to


BF16 = ("BF16",)
F32 = ("F32",)
TID2EID = ("I64", "I32")
# Quantized storage: (weight dtypes, scale dtypes)
FP8_WEIGHT = ("F8_E4M3",)
FP8_SCALE = ("F8_E8M0", "U8", "F32")  # official ue8m0; a Quark export may store raw uint8; old FP8 used F32
MXFP4_WEIGHT = ("U8",)
MXFP4_SCALE = ("U8", "F8_E8M0")
FP4_OFFICIAL_WEIGHT = ("I8",)
FP4_OFFICIAL_SCALE = ("F8_E8M0",)

PRECISIONS = ("bf16", "fp8-block", "mxfp4", "fp4-official")

_ATTN_Q = ("fp8-block",)
_EXPERT_Q = ("fp8-block", "mxfp4", "fp4-official")
_SHARED_Q = ("fp8-block", "mxfp4")


def fp8_block_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))


def packed_fp4_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (out, inp // 2)


def mx_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (out, inp // MX_GROUP)


def weight_slots(spec: DeepseekV4Spec, *, mtp: bool = True) -> dict[str, WeightSlot]:
    """Every logical tensor of the native release layout, in file order (model-level, layers, MTP)."""
    D, V, hc = spec.hidden_size, spec.vocab_size, spec.hc_mult
    slots: dict[str, WeightSlot] = {}

    def add(name, shape, kind, layer, dtypes=BF16, quantizable=()):
        slots[name] = WeightSlot(name, tuple(int(s) for s in shape), dtypes, kind, layer, quantizable)

    add("embed.weight", (V, D), "embed_head", None)
    for lid in range(spec.num_hidden_layers):
        _block_slots(spec, lid, add)
    add("norm.weight", (D,), "norm_hc", None)
    add("head.weight", (V, D), "embed_head", None)
    add("hc_head_fn", (hc, hc * D), "norm_hc", None, F32)
    add("hc_head_base", (hc,), "norm_hc", None, F32)
    add("hc_head_scale", (1,), "norm_hc", None, F32)
    if mtp:
        for i in range(spec.num_nextn_predict_layers):
            lid = spec.num_hidden_layers + i
            p = spec.layer_prefix(lid)
            add(p + "e_proj.weight", (D, D), "mtp_proj", lid, quantizable=_ATTN_Q)
            add(p + "h_proj.weight", (D, D), "mtp_proj", lid, quantizable=_ATTN_Q)
            add(p + "enorm.weight", (D,), "norm_hc", lid)
            add(p + "hnorm.weight", (D,), "norm_hc", lid)
            _block_slots(spec, lid, add)
            add(p + "norm.weight", (D,), "norm_hc", lid)
            add(p + "hc_head_fn", (hc, hc * D), "norm_hc", lid, F32)
            add(p + "hc_head_base", (hc,), "norm_hc", lid, F32)
            add(p + "hc_head_scale", (1,), "norm_hc", lid, F32)
    return slots


def _block_slots(spec: DeepseekV4Spec, lid: int, add) -> None:
    """One decoder block (main layer or the MTP layer's block) in the native naming."""
    D, hc, H, hd = spec.hidden_size, spec.hc_mult, spec.num_attention_heads, spec.head_dim
    p = spec.layer_prefix(lid)
    add(p + "attn_norm.weight", (D,), "norm_hc", lid)
    add(p + "ffn_norm.weight", (D,), "norm_hc", lid)
    for site in ("attn", "ffn"):
        add(f"{p}hc_{site}_fn", (spec.hc_mix, hc * D), "norm_hc", lid, F32)
        add(f"{p}hc_{site}_base", (spec.hc_mix,), "norm_hc", lid, F32)
        add(f"{p}hc_{site}_scale", (3,), "norm_hc", lid, F32)
    a = p + "attn."
    add(a + "attn_sink", (H,), "norm_hc", lid, F32)
    add(a + "wq_a.weight", (spec.q_lora_rank, D), "attention", lid, quantizable=_ATTN_Q)
    add(a + "q_norm.weight", (spec.q_lora_rank,), "norm_hc", lid)
    add(a + "wq_b.weight", (H * hd, spec.q_lora_rank), "attention", lid, quantizable=_ATTN_Q)
    add(a + "wkv.weight", (hd, D), "attention", lid, quantizable=_ATTN_Q)
    add(a + "kv_norm.weight", (hd,), "norm_hc", lid)
    add(
        a + "wo_a.weight",
        (spec.o_groups * spec.o_lora_rank, spec.o_group_in_dim),
        "attention",
        lid,
        quantizable=_ATTN_Q,
    )
    add(a + "wo_b.weight", (D, spec.o_groups * spec.o_lora_rank), "attention", lid, quantizable=_ATTN_Q)
    r = spec.compress_ratio(lid)
    if r > 1:
        blocks_per_entry = spec.compressor_blocks_per_entry(lid)
        _compressor_slots(a + "compressor.", r, blocks_per_entry, hd, D, "compressor", lid, add)
    if spec.has_indexer(lid):
        ix = a + "indexer."
        nI, dI = spec.index_n_heads, spec.index_head_dim
        add(ix + "wq_b.weight", (nI * dI, spec.q_lora_rank), "indexer", lid, quantizable=_ATTN_Q)
        add(ix + "weights_proj.weight", (nI, D), "indexer", lid)
        _compressor_slots(ix + "compressor.", r, 2, dI, D, "indexer", lid, add)
    f = p + "ffn."
    E, I = spec.n_routed_experts, spec.moe_intermediate_size
    add(f + "gate.weight", (E, D), "router", lid)
    if spec.is_hash_layer(lid):
        add(f + "gate.tid2eid", (spec.vocab_size, spec.num_experts_per_tok), "router", lid, TID2EID)
    else:
        add(f + "gate.bias", (E,), "router", lid, F32)
    for e in range(E):
        add(f"{f}experts.{e}.w1.weight", (I, D), "routed_experts", lid, quantizable=_EXPERT_Q)
        add(f"{f}experts.{e}.w2.weight", (D, I), "routed_experts", lid, quantizable=_EXPERT_Q)
        add(f"{f}experts.{e}.w3.weight", (I, D), "routed_experts", lid, quantizable=_EXPERT_Q)
    Is = spec.shared_intermediate_size
    add(f + "shared_experts.w1.weight", (Is, D), "shared_experts", lid, quantizable=_SHARED_Q)
    add(f + "shared_experts.w2.weight", (D, Is), "shared_experts", lid, quantizable=_SHARED_Q)
    add(f + "shared_experts.w3.weight", (Is, D), "shared_experts", lid, quantizable=_SHARED_Q)


def _compressor_slots(c: str, ratio: int, blocks_per_entry: int, hd: int, D: int, kind: str, lid: int, add) -> None:
    add(c + "ape", (ratio, blocks_per_entry * hd), kind, lid, F32)
    add(c + "wkv.weight", (blocks_per_entry * hd, D), kind, lid)
    add(c + "wgate.weight", (blocks_per_entry * hd, D), kind, lid)
    add(c + "norm.weight", (hd,), kind, lid)


def scale_name(weight_name: str, precision: str) -> str:
    """Name of the scale tensor that goes with a quantized ``<module>.weight``.

    Quark exports (mxfp4, and fp8 in a Quark checkpoint) use ``<module>.weight_scale``; the official DeepSeek
    release (fp4-official, and fp8-block there) uses ``<module>.scale``.
    """
    module = weight_name[: -len(".weight")]
    return module + (".weight_scale" if precision in ("mxfp4", "fp8-quark") else ".scale")


def quantized_expectations(slot: WeightSlot, precision: str) -> dict[str, TensorExpectation]:
    """The stored tensors for one linear weight in a storage precision.

    ``precision``: "bf16", "fp8-block" (official ``.scale``), "fp8-quark" (``.weight_scale``), "mxfp4" (Quark:
    uint8 packed + uint8 E8M0 ``.weight_scale``) or "fp4-official" (int8 packed + F8_E8M0 ``.scale``).
    """
    kind = slot.kind
    if precision == "bf16":
        return {slot.name: TensorExpectation(slot.shape, slot.dtypes, kind)}
    if precision in ("fp8-block", "fp8-quark"):
        return {
            slot.name: TensorExpectation(slot.shape, FP8_WEIGHT, kind, "weight", "fp8-block"),
            scale_name(slot.name, precision): TensorExpectation(
                fp8_block_scale_shape(slot.shape), FP8_SCALE, kind, "scale", "fp8-block"
            ),
        }
    if precision in ("mxfp4", "fp4-official"):
        if slot.shape[1] % MX_GROUP:
            raise ValueError(
                f"{slot.name}: input width {slot.shape[1]} is not a multiple of {MX_GROUP}; "
                f"it cannot be stored as {precision}"
            )
        wd, sd = (MXFP4_WEIGHT, MXFP4_SCALE) if precision == "mxfp4" else (FP4_OFFICIAL_WEIGHT, FP4_OFFICIAL_SCALE)
        return {
            slot.name: TensorExpectation(packed_fp4_shape(slot.shape), wd, kind, "weight", precision),
            scale_name(slot.name, precision): TensorExpectation(
                mx_scale_shape(slot.shape), sd, kind, "scale", precision
            ),
        }
    raise ValueError(f"unknown storage precision {precision!r}")


def expected_tensors(
    spec: DeepseekV4Spec,
    experts: str = "bf16",
    *,
    mtp: bool = True,
    linears: str = "bf16",
    shared_experts: str | None = None,
    mtp_experts: str | None = None,
    mtp_linears: str | None = None,
) -> dict[str, TensorExpectation]:
    """Every stored tensor of the native release layout: ``{name: TensorExpectation(shape, dtypes, kind)}``.

    experts: routed-expert storage, "bf16" | "mxfp4" (Quark: ``.weight`` U8 ``[out, in/2]`` + ``.weight_scale``
        U8 E8M0 ``[out, in/32]``) | "fp4-official" (``.weight`` I8 packed + ``.scale`` F8_E8M0) | "fp8-block".
    linears: attention projections, ``indexer.wq_b``, ``e_proj``/``h_proj`` and shared experts: "bf16" | "fp8"
        (F8_E4M3 ``[out, in]`` + a 128x128 block scale: ``.scale`` in the official layout, ``.weight_scale``
        when the experts are Quark "mxfp4").
    shared_experts: override for the shared experts ("bf16" | "fp8" | "mxfp4"; default: same as ``linears``).
    mtp_experts / mtp_linears: the MTP layer's precision (default: same as the main layers).
    mtp: include the ``mtp.*`` tensors.
    """
    quark = experts == "mxfp4"

    def lin(p: str) -> str:
        if p == "fp8":
            return "fp8-quark" if quark else "fp8-block"
        if p in ("bf16", "mxfp4"):
            return p
        raise ValueError(f"linears/shared_experts must be 'bf16', 'fp8' (or 'mxfp4' for shared), got {p!r}")

    if experts not in ("bf16", "mxfp4", "fp4-official", "fp8-block"):
        raise ValueError(f"experts must be 'bf16', 'mxfp4', 'fp4-official' or 'fp8-block', got {experts!r}")
    out: dict[str, TensorExpectation] = {}
    for slot in weight_slots(spec, mtp=mtp).values():
        if not slot.quantizable:
            out[slot.name] = TensorExpectation(slot.shape, slot.dtypes, slot.kind)
            continue
        in_mtp = slot.is_mtp
        if slot.kind == "routed_experts":
            p = (mtp_experts or experts) if in_mtp else experts
            if p == "fp8-block" and quark:
                p = "fp8-quark"
        elif slot.kind == "shared_experts":
            p = lin((mtp_linears or shared_experts or linears) if in_mtp else (shared_experts or linears))
        else:
            p = lin((mtp_linears or linears) if in_mtp else linears)
        out.update(quantized_expectations(slot, p))
    return out


def parameter_count(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)
