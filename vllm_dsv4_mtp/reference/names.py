"""Tensor names: HF transformers' DeepSeek-V4 modules <-> the native DeepSeek release layout.

The native -> HF direction is transformers' own ``conversion_mapping.py`` entry for ``deepseek_v4``
(applied by ``from_pretrained``); this module is its inverse, written for the tensors a DeepSeek-V4 block
has, and checked by round trip (export native, ``DeepseekV4ForCausalLM.from_pretrained`` it back, compare
logits: ``tests/test_embedded.py``).

One block's names (relative to ``layers.N.`` / ``model.layers.N.``; the MTP block uses the same names
under ``mtp.0.``):

=============================================  ==================================================
HF (transformers 5.19)                          native
=============================================  ==================================================
``input_layernorm.weight``                      ``attn_norm.weight``
``post_attention_layernorm.weight``             ``ffn_norm.weight``
``attn_hc.{fn,base,scale}``                     ``hc_attn_{fn,base,scale}``
``ffn_hc.{fn,base,scale}``                      ``hc_ffn_{fn,base,scale}``
``self_attn.q_a_proj / q_a_norm / q_b_proj``    ``attn.wq_a / q_norm / wq_b``
``self_attn.kv_proj / kv_norm``                 ``attn.wkv / kv_norm``
``self_attn.o_a_proj / o_b_proj``               ``attn.wo_a / wo_b``
``self_attn.sinks``                             ``attn.attn_sink``
``self_attn.compressor.{kv_proj,gate_proj}``    ``attn.compressor.{wkv,wgate}``
``self_attn.compressor.position_bias``          ``attn.compressor.ape``
``self_attn.compressor.kv_norm``                ``attn.compressor.norm``
``self_attn.compressor.indexer.{...}``          ``attn.indexer.compressor.{...}`` (same leaf names)
``self_attn.compressor.indexer.q_b_proj``       ``attn.indexer.wq_b``
``...indexer.scorer.weights_proj``              ``attn.indexer.weights_proj``
``mlp.gate.weight``                             ``ffn.gate.weight``
``mlp.gate.e_score_correction_bias``            ``ffn.gate.bias``
``mlp.gate.tid2eid``                            ``ffn.gate.tid2eid``
``mlp.experts.gate_up_proj [E, 2I, D]``         ``ffn.experts.E.w1.weight [I, D]`` ++ ``w3`` (dim 0)
``mlp.experts.down_proj [E, D, I]``             ``ffn.experts.E.w2.weight [D, I]``
``mlp.shared_experts.{gate,up,down}_proj``      ``ffn.shared_experts.w{1,3,2}``
=============================================  ==================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# HF leaf (relative to a decoder layer) -> native leaf; experts are handled separately (split/merge).
_BLOCK_HF_TO_NATIVE: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_BLOCK_NATIVE_TO_HF = {v: k for k, v in _BLOCK_HF_TO_NATIVE.items()}

# Top-level (outside any block) HF -> native, for DeepseekV4ForCausalLM.
_TOP_HF_TO_NATIVE: dict[str, str] = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

# Native tensors kept in float32 / integer in the release (everything else floating is BF16).
F32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")


def native_dtype(name: str) -> torch.dtype:
    """The dtype a tensor has in the DeepSeek BF16 release layout (hc_* / attn_sink / ape / gate.bias F32,
    tid2eid int64, BF16 elsewhere)."""
    if name.endswith("tid2eid"):
        return torch.int64
    if name.endswith(F32_SUFFIXES):
        return torch.float32
    return torch.bfloat16


def block_hf_to_native(hf: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """One decoder block's HF state (names relative to the layer) -> native names under ``prefix``
    (e.g. ``"layers.3."`` or ``"mtp.0."``). Experts are split per expert; unknown names are an error."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = t[e]
        elif name in _BLOCK_HF_TO_NATIVE:
            out[prefix + _BLOCK_HF_TO_NATIVE[name]] = t
        else:
            raise KeyError(f"no native name for HF block tensor {name!r} (block {prefix!r})")
    return out


def block_native_to_hf(
    native: Mapping[str, torch.Tensor], prefix: str, n_experts: int, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Native tensors under ``prefix`` -> one HF decoder block's state (names relative to the layer).
    Routed experts are stacked into ``gate_up_proj`` / ``down_proj``; a missing expert tensor is a
    KeyError naming it and ``source``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in native.items():
        if not name.startswith(prefix) or ".ffn.experts." in f".{name[len(prefix) :]}":
            continue
        leaf = name[len(prefix) :]
        if leaf not in _BLOCK_NATIVE_TO_HF:
            raise KeyError(f"{source}: unexpected tensor {name!r} (not part of a DeepSeek-V4 block)")
        out[_BLOCK_NATIVE_TO_HF[leaf]] = t
    gate_up, down = [], []
    for e in range(n_experts):
        w = {}
        for k in ("w1", "w2", "w3"):
            key = f"{prefix}ffn.experts.{e}.{k}.weight"
            if key not in native:
                raise KeyError(f"{source}: missing tensor {key!r}")
            w[k] = native[key]
        gate_up.append(torch.cat([w["w1"], w["w3"]], dim=0))
        down.append(w["w2"])
    out["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["mlp.experts.down_proj"] = torch.stack(down)
    return out


def causal_lm_to_native(hf_state: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A ``DeepseekV4ForCausalLM.state_dict()`` -> native names (no dtype change). Non-persistent rope
    buffers are not in a state_dict; anything else unknown is an error."""
    out: dict[str, torch.Tensor] = {}
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    for name, t in hf_state.items():
        if name in _TOP_HF_TO_NATIVE:
            out[_TOP_HF_TO_NATIVE[name]] = t
        elif name.startswith("model.layers."):
            idx, leaf = name[len("model.layers.") :].split(".", 1)
            per_layer[int(idx)][leaf] = t
        else:
            raise KeyError(f"no native name for HF tensor {name!r}")
    for i, layer in enumerate(per_layer):
        out.update(block_hf_to_native(layer, f"layers.{i}."))
    return out
