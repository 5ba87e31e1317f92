"""``DeepSeekV4MTPModel`` on gfx950: vLLM's in-tree AMD MTP draft, built in BF16 (or ``stored``), loaded by the plugin.

Only imported where :mod:`vllm_dsv4_mtp.platform` chose ``IN_TREE`` (its parent module needs ROCm and AITER).
Forward, ``compute_logits`` and the module tree are vLLM's own; the plugin changes what they are built from
(:func:`.plan.bf16_draft_config`: no quantization, no fused shared expert, none of the target's FP4-only kernel
settings, each difference logged) and how they are loaded (strict, quantized MTP tensors decoded to BF16). Under
``VLLM_DSV4_MTP_DRAFT_PRECISION=stored`` the view's quantization is the checkpoint's Quark config keyed for the
draft's module names (:mod:`.stored`), and quantized MTP tensors go into the quant methods' parameters as stored.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v4.amd.mtp import DeepSeekV4MTP

from vllm_dsv4_mtp import draft_policy
from vllm_dsv4_mtp.gfx950.plan import (
    bf16_draft_config,
    draft_view_changes,
    in_tree_param_map,
    refuse_draft_kernels,
    shared_with_target,
)
from vllm_dsv4_mtp.gfx950.stored import mtp_stored_dtypes, stored_plan, summary, unkeyed_quantized
from vllm_dsv4_mtp.weights.loader import DRAFT, CheckpointLoader

logger = init_logger("vllm.dsv4_mtp.gfx950")


class DeepSeekV4MTPModel(DeepSeekV4MTP):
    """vLLM's in-tree AMD DeepSeek-V4 MTP draft: every layer unquantized (BF16), or under
    ``VLLM_DSV4_MTP_DRAFT_PRECISION=stored`` the checkpoint's Quark schemes keyed for its modules (:mod:`.stored`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        mc = vllm_config.model_config
        plan = draft_policy.check_draft(mc.hf_config, mc.model, mc.dtype, stored_ok=True)
        stored = None
        if plan.precision == draft_policy.STORED:
            stored = stored_plan(plan.spec, plan.source, mtp_stored_dtypes(plan.source))
        refuse_draft_kernels(vllm_config)
        changes = draft_view_changes(
            vllm_config, fse_requested=bool(rocm_aiter_ops.is_fusion_moe_shared_experts_enabled())
        )
        quant = stored.config if stored is not None else None
        super().__init__(vllm_config=bf16_draft_config(vllm_config, changes, quant), prefix=prefix)
        self.plan = plan
        self.stored = quant is not None
        ffn = self.model.layers[str(plan.spec.num_hidden_layers)].mtp_block.ffn
        self.fused_shared_expert = ffn.is_fused_shared_expert_enabled
        for change in changes:
            if change.setting != "fused shared expert" or not self.fused_shared_expert:
                logger.info(change.message())
        if self.stored:
            fallen = unkeyed_quantized(self, stored.schemes)
            if fallen:
                raise draft_policy.MtpPrecisionError(
                    f"{plan.source}: {draft_policy.DRAFT_PRECISION_ENV}=stored: {fallen[0]} (and {len(fallen) - 1} "
                    "more) asked the Quark config under a name the plugin did not key; it would take the global "
                    "scheme. This vLLM builds the MTP layer differently from the releases the plugin supports."
                )
            logger.info(
                "vllm-dsv4-mtp: DeepSeek-V4 MTP draft = vLLM's in-tree AMD MTP layers at the checkpoint's stored "
                "precision (%s=stored; %s, fused shared expert: %s): %s",
                draft_policy.DRAFT_PRECISION_ENV,
                plan.dtype,
                self.fused_shared_expert,
                summary(stored.schemes),
            )
            return
        logger.info(
            "vllm-dsv4-mtp: DeepSeek-V4 MTP draft = vLLM's in-tree AMD MTP layers in BF16 (%s, fused "
            "shared expert: %s; quantized MTP weights: %s)%s",
            plan.dtype,
            self.fused_shared_expert,
            plan.quantized_mtp,
            f"; {draft_policy.DRAFT_PRECISION_ENV}=stored: {stored.note}" if stored is not None else "",
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        spec = self.plan.spec
        return CheckpointLoader(
            self,
            spec,
            scope=DRAFT,
            dtype=self.plan.dtype,
            source=self.plan.source,
            admit=self.plan.admit,
            param_for=in_tree_param_map(spec, fused_shared_expert=self.fused_shared_expert),
            not_from_checkpoint=shared_with_target(spec),
            stored=self.stored,
        ).load(weights)
