"""What the gfx950 draft needs besides vLLM's classes: a BF16 view of the engine config and the weight map.

vLLM's in-tree AMD MTP layers take their quantization from ``vllm_config.quant_config``: the checkpoint's
Quark config, shared with the target. Its per-layer entries name native modules (``mtp.0.e_proj``; after
the target's mapper ``model.mtp.0.e_proj``) while the draft's modules are ``model.layers.61.*``, so on vLLM
0.32 no entry matches and every MTP linear falls back to the global MXFP4 W4A4 scheme (vllm-project/vllm#56054);
vLLM 0.33 re-keys the entries (``align_mtp_quant_config``) and the draft then runs in whatever precision the
checkpoint stores. The plugin's draft is BF16 by design, whatever the Quark config says: its layers are built
from :func:`bf16_draft_config`, whose ``quant_config`` is None, so every linear gets vLLM's
``UnquantizedLinearMethod`` and the experts ``UnquantizedFusedMoEMethod`` on both versions (0.33's
alignment is a no-op on None). The target keeps the checkpoint's own config object, untouched.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.weights.names import IN_TREE, ParamRef, draft_param


def bf16_draft_config(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` with ``quant_config = None`` (every sub-config shared, so the draft's
    attention layers still register in the engine's one ``static_forward_context``)."""
    view = copy.copy(vllm_config)
    view.quant_config = None
    return view


def in_tree_param_map(spec: DeepseekV4Spec, *, fused_shared_expert: bool):
    """native ``mtp.i.*`` name -> :class:`ParamRef` in vLLM's in-tree AMD MTP module tree.

    ``fused_shared_expert``: the in-tree MoE fused the shared expert into the routed grouped GEMM
    (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``; always allowed for an unquantized MoE), as expert
    ``n_routed_experts``.
    """
    return partial(draft_param, num_hidden_layers=spec.num_hidden_layers,
                   num_mtp_layers=spec.num_nextn_predict_layers, layout=IN_TREE,
                   fused_shared_expert_id=spec.n_routed_experts if fused_shared_expert else None)


def shared_with_target(spec: DeepseekV4Spec) -> list[str]:
    """Parameters of the in-tree draft that vLLM's proposer replaces with the target's after loading (the
    embedding, and each MTP layer's LM head): no ``mtp.*`` tensor fills them."""
    return ["model.embed_tokens.weight"] + [
        f"model.layers.{spec.num_hidden_layers + i}.shared_head.head.weight"
        for i in range(spec.num_nextn_predict_layers)]


__all__ = ["ParamRef", "bf16_draft_config", "in_tree_param_map", "shared_with_target"]
