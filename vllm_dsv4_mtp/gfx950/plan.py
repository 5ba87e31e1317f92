"""What the gfx950 draft needs besides vLLM's classes: a BF16 view of the engine config and the weight map.

vLLM's in-tree AMD MTP layers take their quantization from ``vllm_config.quant_config``: the checkpoint's
Quark config, shared with the target. Its per-layer entries name native modules (``mtp.0.e_proj``; after
the target's mapper ``model.mtp.0.e_proj``) while the draft's modules are ``model.layers.61.*``, so on vLLM
0.32 no entry matches and every MTP linear falls back to the global MXFP4 W4A4 scheme (vllm-project/vllm#56054);
vLLM 0.33 re-keys the entries (``align_mtp_quant_config``) and the draft then runs in whatever precision the
checkpoint stores. The plugin's draft is BF16 by design, whatever the Quark config says: its layers are built
from :func:`bf16_draft_config`, whose ``quant_config`` is :class:`Bf16DraftQuantConfig`, so every linear gets
vLLM's ``UnquantizedLinearMethod`` and the experts vLLM's unquantized MoE method on 0.32, 0.33 and 0.34 (the
real classes are built and checked on all three: tests/test_in_tree_mtp_real.py). The target keeps the
checkpoint's own config objects, untouched; the view only differs where a target setting cannot apply to a BF16
draft (:func:`draft_view_changes`), and each difference is logged once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.weights.names import IN_TREE, ParamRef, draft_param


class Bf16DraftQuantConfig(QuantizationConfig):
    """The draft's quantization: none. Every linear gets vLLM's ``UnquantizedLinearMethod``; every other layer
    gets None, on which vLLM's routed experts build their unquantized MoE method and embeddings stay plain.

    Why a config object and not ``quant_config = None``: vLLM counts an unquantized MoE as always able to fuse its
    shared expert into the routed grouped GEMM (``is_shared_expert_quant_fse_compatible(None, ...)`` is True), so
    under ``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1`` (the MI355 profiles) a None-config draft fuses it, and
    vLLM 0.34's ``DeepSeekV4MTP.__init__`` then raises ``NotImplementedError`` ("fused shared experts are not
    supported yet"). For a config class it does not know, vLLM's own rule answers "not compatible" (0.32 to 0.34),
    so the draft keeps a separate shared-expert MLP while the target, built from the checkpoint's config, keeps its
    fusion. The same on 0.32 and 0.33: there the fused draft is a path vLLM's own (quantized) draft never takes,
    0.34's maintainers declared it unsupported, and one layout on every release keeps one loader map. Nothing in
    vLLM is patched: this is an ordinary ``QuantizationConfig`` handed to the draft's constructor.
    """

    def get_name(self) -> str:
        return "dsv4_mtp_bf16_draft"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Bf16DraftQuantConfig:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None


@dataclass(frozen=True)
class DraftViewChange:
    """One target setting the BF16 draft's view of the engine config does not carry, and why."""

    setting: str
    target_value: Any
    draft_value: Any
    reason: str

    def message(self) -> str:
        return (
            f"vllm-dsv4-mtp: the BF16 MTP draft runs with {self.setting}={self.draft_value!r} (the target keeps "
            f"{self.target_value!r}): {self.reason}"
        )


#: target MoE backends the draft's unquantized experts cannot run on (FP4-only kernels)
FP4_ONLY_MOE_BACKENDS = ("aiter_mega_moe",)


def refuse_draft_kernels(vllm_config: Any) -> None:
    """Raise ``ValueError`` for a target MoE backend the BF16 draft cannot run on.

    Refused, not dropped: vLLM's MoE layers read ``moe_backend`` from the current (engine-wide) config, not from
    the config handed to the draft, so only vLLM's own draft override (``speculative_config.moe_backend``, which
    vLLM applies to the draft's config) can give the draft another backend.
    """
    backend = getattr(vllm_config.kernel_config, "moe_backend", None)
    if backend in FP4_ONLY_MOE_BACKENDS:
        raise ValueError(
            f"the BF16 MTP draft cannot run on --moe-backend {backend} (FP4 experts only); give the "
            "draft another backend with speculative_config 'moe_backend'"
        )


def draft_view_changes(vllm_config: Any, *, fse_requested: bool) -> list[DraftViewChange]:
    """The settings of ``vllm_config`` the BF16 draft must not inherit (``moe_backend``: :func:`refuse_draft_kernels`).

    * ``kernel_config.monokernel`` (vLLM 0.33+ ``--monokernel``): ``MonoDecodeLayer.create`` checks its eligibility
      (an ``AITER_MXFP4_BF16`` expert backend) before it skips draft layers, so a BF16 draft would raise
      ``ValueError: --monokernel needs the AITER_MXFP4_BF16 MoE backend``; the mono kernel never runs draft layers;
    * ``fse_requested`` (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS``): not a config field, it is declined by
      :class:`Bf16DraftQuantConfig`; listed so the log says so.
    """
    kc = vllm_config.kernel_config
    changes = []
    if getattr(kc, "monokernel", False):
        changes.append(
            DraftViewChange(
                "kernel_config.monokernel",
                True,
                False,
                "the mono decode kernel takes MXFP4 experts and never runs draft layers",
            )
        )
    if fse_requested:
        changes.append(
            DraftViewChange(
                "fused shared expert",
                True,
                False,
                "vLLM's MTP draft does not take a fused shared expert (0.34 refuses it); the "
                "draft keeps its shared expert as its own MLP",
            )
        )
    return changes


def bf16_draft_config(vllm_config: Any, changes: list[DraftViewChange] = (), quant_config: Any = None) -> Any:
    """A shallow copy of ``vllm_config`` with ``quant_config`` = :class:`Bf16DraftQuantConfig` (or the given
    one: ``stored``'s draft-keyed Quark config) and the ``kernel_config`` settings of ``changes`` reset (a copy of
    the kernel config; every other sub-config shared, so the draft's attention layers still register in the
    engine's one ``static_forward_context``)."""
    view = copy.copy(vllm_config)
    view.quant_config = quant_config if quant_config is not None else Bf16DraftQuantConfig()
    kernel = [c for c in changes if c.setting.startswith("kernel_config.")]
    if kernel:
        view.kernel_config = copy.copy(vllm_config.kernel_config)
        for c in kernel:
            setattr(view.kernel_config, c.setting.removeprefix("kernel_config."), c.draft_value)
    return view


def in_tree_param_map(spec: DeepseekV4Spec, *, fused_shared_expert: bool):
    """native ``mtp.i.*`` name -> :class:`ParamRef` in vLLM's in-tree AMD MTP module tree.

    ``fused_shared_expert``: the in-tree MoE fused the shared expert into the routed grouped GEMM
    (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``; always allowed for an unquantized MoE), as expert
    ``n_routed_experts``.
    """
    return partial(
        draft_param,
        num_hidden_layers=spec.num_hidden_layers,
        num_mtp_layers=spec.num_nextn_predict_layers,
        layout=IN_TREE,
        fused_shared_expert_id=spec.n_routed_experts if fused_shared_expert else None,
    )


def shared_with_target(spec: DeepseekV4Spec) -> list[str]:
    """Parameters of the in-tree draft that vLLM's proposer replaces with the target's after loading (the
    embedding, and each MTP layer's LM head): no ``mtp.*`` tensor fills them."""
    return ["model.embed_tokens.weight"] + [
        f"model.layers.{spec.num_hidden_layers + i}.shared_head.head.weight"
        for i in range(spec.num_nextn_predict_layers)
    ]


__all__ = [
    "Bf16DraftQuantConfig",
    "DraftViewChange",
    "ParamRef",
    "bf16_draft_config",
    "draft_view_changes",
    "in_tree_param_map",
    "refuse_draft_kernels",
    "shared_with_target",
]
