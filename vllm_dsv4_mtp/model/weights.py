"""Native DeepSeek-V4 tensor names -> the plugin's parameters (and back, for error messages).

The checkpoint layouts served (``dsv4-architecture.md`` section 6):

* BF16: every tensor in its own dtype.
* Official release: FP8 e4m3 linears with a 128x128 ``.scale`` (E8M0), FP4 experts as int8 packed + ``.scale``.
* AMD Quark export: MXFP4 experts, uint8 packed ``.weight`` + uint8 E8M0 ``.weight_scale``; FP8 linears with
  ``.weight_scale``.

FP8 linears are decoded to the model dtype at load (``vllm_dsv4_mtp.formats.fp8``): the portable path runs
them unquantized. Expert tensors go to the routed-experts module untouched (raw bytes).

Stacked parameters (one GEMM for several native matrices), as ``(param, native, shard)``:
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: (internal module suffix, native module suffix, shard id) -- matched on ``.<native>.`` inside a name
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
    ("compressor.fused_wkv_wgate", "compressor.wkv", 0),
    ("compressor.fused_wkv_wgate", "compressor.wgate", 1),
    ("shared_experts.gate_up_proj", "shared_experts.w1", 0),
    ("shared_experts.gate_up_proj", "shared_experts.w3", 1),
)

# plain renames of a name's tail (applied after the layer prefix is rewritten)
_LEAF_RENAMES: tuple[tuple[str, str], ...] = (
    (".hc_attn_fn", ".hc_attn.fn"), (".hc_attn_base", ".hc_attn.base"), (".hc_attn_scale", ".hc_attn.scale"),
    (".hc_ffn_fn", ".hc_ffn.fn"), (".hc_ffn_base", ".hc_ffn.base"), (".hc_ffn_scale", ".hc_ffn.scale"),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
)
_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.fn",
    "hc_head_base": "model.hc_head.base",
    "hc_head_scale": "model.hc_head.scale",
}
_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<shard>w[123])\.(?P<part>weight|weight_scale|scale)$")
_SCALE_SUFFIXES = (".weight_scale", ".scale")


@dataclass(frozen=True)
class Target:
    """Where one native tensor goes.

    kind: "param" (``param`` [, ``shard``]), "expert" (``param`` = experts module path, ``expert``, ``shard``,
    ``part``), "scale" (an FP8 block scale of the linear ``param`` [, ``shard``]) or "skip".
    """

    kind: str
    param: str = ""
    shard: int | str | None = None
    expert: int | None = None
    part: str | None = None
    why: str = ""


def map_native_name(name: str, *, num_hidden_layers: int) -> Target:
    """Map a native tensor name of the main model to its target. ``mtp.*`` is skipped (it is the draft's)."""
    if name.startswith("mtp."):
        return Target("skip", why="MTP layer: loaded by the draft model (DeepSeekV4MTPModel), not the target")
    if name in _TOP_LEVEL:
        return Target("param", _TOP_LEVEL[name])
    m = re.match(r"^layers\.(\d+)\.", name)
    if not m:
        raise KeyError(f"{name}: not a DeepSeek-V4 tensor name (expected embed/head/norm/hc_head_*/layers.N.*/mtp.*)")
    if int(m.group(1)) >= num_hidden_layers:
        raise KeyError(f"{name}: layer {m.group(1)} is beyond num_hidden_layers={num_hidden_layers}")
    internal = "model." + name
    em = _EXPERT.match(internal)
    if em:
        return Target("expert", em.group("prefix"), shard=em.group("shard"), expert=int(em.group("e")),
                      part=em.group("part"))
    kind = "param"
    for suffix in _SCALE_SUFFIXES:
        if internal.endswith(suffix):
            internal = internal[: -len(suffix)] + ".weight"
            kind = "scale"
            break
    for new, old, shard in STACKED_PARAMS:
        if f".{old}." in internal:
            return Target(kind, internal.replace(f".{old}.", f".{new}."), shard=shard)
    for old, new in _LEAF_RENAMES:
        if old.endswith(".") and old in internal:
            internal = internal.replace(old, new)
        elif not old.endswith(".") and internal.endswith(old):
            internal = internal[: -len(old)] + new
    return Target(kind, internal)
