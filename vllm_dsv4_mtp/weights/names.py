"""Native DeepSeek-V4 tensor names -> the parameters that receive them, for each model that loads them.

Three module trees load native checkpoints (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``mtp.0.ffn.experts.7.w2.weight``, ...):

* ``PORTABLE`` target: the plugin's ``DeepseekV4ForCausalLM`` (``model.layers.N.*``, ``lm_head``);
* ``PORTABLE`` draft: the plugin's ``DeepSeekV4MTPModel`` (``model.layers.{L}.*``, ``L = num_hidden_layers + i``);
* ``IN_TREE`` draft: the gfx950 draft, vLLM's in-tree AMD MTP layers (same tree, vLLM's leaf names).

The two layouts share one table and differ in two leaf conventions: vLLM's in-tree layers keep the native
``hc_attn_fn`` / ``hc_head_fn`` names and put the routed experts' weights under ``experts.routed_experts``;
the portable model groups each mHC site's tensors in a module (``hc_attn.fn``) and holds its experts
directly (``experts.w13_weight``).

Stacked parameters (one GEMM over several native matrices), as ``(native leaf, parameter leaf, shard)``:
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PORTABLE = "portable"
IN_TREE = "in_tree"

STACKED = (
    ("attn.wq_a.weight", "attn.fused_wqa_wkv.weight", 0),
    ("attn.wkv.weight", "attn.fused_wqa_wkv.weight", 1),
    ("compressor.wkv.weight", "compressor.fused_wkv_wgate.weight", 0),
    ("compressor.wgate.weight", "compressor.fused_wkv_wgate.weight", 1),
    ("shared_experts.w1.weight", "shared_experts.gate_up_proj.weight", 0),
    ("shared_experts.w3.weight", "shared_experts.gate_up_proj.weight", 1),
)
_RENAMES = (
    ("shared_experts.w2.weight", "shared_experts.down_proj.weight"),
    ("ffn.gate.bias", "ffn.gate.e_score_correction_bias"),
)
_EXPERT = re.compile(r"^(?P<ffn>.*ffn\.)(?:experts\.(?P<e>\d+)|(?P<shared>shared_experts))\.(?P<shard>w[123])\.weight$")
_HC = re.compile(r"^(?P<head>.*)hc_(?P<site>attn|ffn|head)_(?P<part>fn|base|scale)$")
_MTP_OWN = {
    "e_proj.weight",
    "h_proj.weight",
    "enorm.weight",
    "hnorm.weight",
    "norm.weight",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
}


@dataclass(frozen=True)
class ParamRef:
    """Where one (dense) native tensor goes.

    kind: ``"plain"`` (the parameter's own loader), ``"stacked"`` (``shard`` = 0/1 of a merged linear),
    ``"expert"`` (``expert`` id and ``shard`` w1/w2/w3 of a fused-experts parameter) or ``"sink"`` (the
    attention sink, split by heads across tensor-parallel ranks).
    """

    param: str
    kind: str = "plain"
    shard: int | str | None = None
    expert: int | None = None


def _leaf(rest: str, layout: str, fused_shared_expert_id: int | None) -> ParamRef:
    """One decoder block's native leaf (after ``layers.N.`` / ``mtp.i.``) -> a ParamRef relative to the block."""
    m = _EXPERT.match(rest)
    if m and (m["e"] is not None or fused_shared_expert_id is not None):
        w = "w2_weight" if m["shard"] == "w2" else "w13_weight"
        experts = "experts.routed_experts." if layout == IN_TREE else "experts."
        expert = int(m["e"]) if m["e"] is not None else fused_shared_expert_id
        return ParamRef(f"{m['ffn']}{experts}{w}", "expert", m["shard"], expert)
    for native, param, shard in STACKED:
        if rest.endswith(native):
            return ParamRef(rest[: -len(native)] + param, "stacked", shard)
    for native, param in _RENAMES:
        if rest.endswith(native):
            return ParamRef(rest[: -len(native)] + param)
    h = _HC.match(rest)
    if h and layout == PORTABLE:
        return ParamRef(f"{h['head']}hc_{h['site']}.{h['part']}")
    if rest.endswith("attn.attn_sink"):
        return ParamRef(rest, "sink")
    return ParamRef(rest)


def _under(prefix: str, ref: ParamRef) -> ParamRef:
    return ParamRef(prefix + ref.param, ref.kind, ref.shard, ref.expert)


def target_param(name: str, *, num_hidden_layers: int) -> ParamRef:
    """A main-model native name -> the portable target's parameter. Raises KeyError for any other name."""
    if name in _TOP:
        return ParamRef(_TOP[name])
    if name.startswith("hc_head_"):
        return ParamRef("model.hc_head." + name[len("hc_head_") :])
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m:
        raise KeyError(
            f"{name}: not a DeepSeek-V4 main-model tensor name (expected embed/head/norm/hc_head_*/layers.N.*)"
        )
    if int(m[1]) >= num_hidden_layers:
        raise KeyError(f"{name}: layer {m[1]} is beyond num_hidden_layers={num_hidden_layers}")
    return _under(f"model.layers.{m[1]}.", _leaf(m[2], PORTABLE, None))


def draft_param(
    name: str, *, num_hidden_layers: int, num_mtp_layers: int, layout: str, fused_shared_expert_id: int | None = None
) -> ParamRef:
    """An ``mtp.i.*`` native name -> the draft's parameter under ``model.layers.{num_hidden_layers + i}``.

    ``fused_shared_expert_id``: vLLM's in-tree MoE can fuse the shared expert into the routed grouped GEMM
    (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``) as one more expert with this id; its weights then go
    there instead of to ``shared_experts``.
    """
    m = re.match(r"^mtp\.(\d+)\.(.+)$", name)
    if not m:
        raise KeyError(f"{name}: not an MTP tensor name (expected mtp.<i>.<tensor>)")
    i, rest = int(m[1]), m[2]
    if i >= num_mtp_layers:
        raise KeyError(f"{name}: MTP layer {i} is beyond num_nextn_predict_layers={num_mtp_layers}")
    layer = f"model.layers.{num_hidden_layers + i}."
    if rest in _MTP_OWN:
        if rest == "norm.weight":
            return ParamRef(layer + "shared_head.norm.weight")
        if rest.startswith("hc_head_") and layout == PORTABLE:
            return ParamRef(layer + "hc_head." + rest[len("hc_head_") :])
        return ParamRef(layer + rest)
    return _under(layer + "mtp_block.", _leaf(rest, layout, fused_shared_expert_id))
