"""``DeepSeekV4MTPModel`` on gfx950: vLLM's in-tree AMD MTP draft, built in BF16 (or ``stored``), loaded by the plugin.

Only imported where :mod:`vllm_dsv4_mtp.platform` chose ``IN_TREE`` (its parent module needs ROCm and AITER).
Forward, ``compute_logits`` and the module tree are vLLM's own; the plugin changes what they are built from
(:func:`.plan.bf16_draft_config`: no quantization, no fused shared expert, none of the target's FP4-only kernel
settings, each difference logged) and how they are loaded (strict, quantized MTP tensors decoded to BF16). Under
``VLLM_DSV4_MTP_DRAFT_PRECISION=stored`` the view's quantization is the checkpoint's Quark config keyed for the
draft's module names (:mod:`.stored`), and quantized MTP tensors go into the quant methods' parameters as stored.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v4.amd.mtp import DeepSeekV4MTP

from vllm_dsv4_mtp import draft_policy
from vllm_dsv4_mtp.draft_schedule import StepK
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
        self.step_k = StepK(vllm_config)
        # asked only with a schedule: without one no forward is taken for K = 0
        self.k0_logits_discarded = self.step_k.lookup is not None and runner_samples_at_k0(vllm_config)
        if self.k0_logits_discarded:
            logger.info(
                "vllm-dsv4-mtp: this vLLM's Model Runner V2 samples the draft at K=0 steps and discards the result; "
                "the draft answers those samples with zero logits"
            )
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

    # ------------------------------------------------------------------------------------------ K = 0 steps
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        """vLLM's forward, or at a K = 0 step only the MTP layer's attention-cache write (returns ``hidden_states``,
        which vLLM does not read then)."""
        layer = self._layer(spec_step_idx)
        num_reqs = None if _capturing() else step_num_reqs(layer.mtp_block.attn)
        if getattr(layer.mtp_block, "mono", None) is None and self.step_k.cache_only(num_reqs):
            if inputs_embeds is None:
                inputs_embeds = self.model.embed_input_ids(input_ids)
            write_attention_cache(layer, positions, hidden_states, inputs_embeds)
            return hidden_states
        self.step_k.cache_only(None)  # a whole forward: logits may follow
        return super().forward(input_ids, positions, hidden_states, intermediate_tensors, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        if self._discarded_sample():
            return hidden_states.new_zeros(hidden_states.shape[0], self.config.vocab_size)
        self.step_k.logits_asked()
        return super().compute_logits(hidden_states, spec_step_idx)

    def get_top_tokens(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        if self._discarded_sample():
            return torch.zeros(hidden_states.shape[0], dtype=torch.int64, device=hidden_states.device)
        self.step_k.logits_asked()
        return super().get_top_tokens(hidden_states, spec_step_idx)

    def _discarded_sample(self) -> bool:
        return self.step_k.last_cache_only is not None and self.k0_logits_discarded

    def _layer(self, spec_step_idx: int):
        m = self.model
        return m.layers[str(m.mtp_start_layer_idx + spec_step_idx % m.num_mtp_layers)]


def write_attention_cache(layer, positions: torch.Tensor, hidden_states: torch.Tensor, inputs_embeds: torch.Tensor):
    """The MTP layer up to its attention, which writes the step's kv rows: the same modules, kernels and
    arguments as vLLM's whole forward, so the rows are the same bit for bit (tests/test_in_tree_mtp_k0.py)."""
    from vllm.models.deepseek_v4.amd import mtp as in_tree  # the module global: the kernel object vLLM calls

    d = layer.config.hidden_size
    e, h = in_tree._FUSED_MTP_INPUT_RMSNORM_KERNEL(
        inputs_embeds,
        positions,
        hidden_states.view(-1, layer.hc_mult, d),
        layer.enorm.weight.data,
        layer.hnorm.weight.data,
        layer.enorm.variance_epsilon,
        layer.hc_mult,
    )
    x = layer.h_proj(h) + layer.e_proj(e).unsqueeze(-2)
    block = layer.mtp_block
    # where the mHC kernel folds attn_norm into hc_pre (fused mHC with a supported width), vLLM's block does too
    fold = block.fuse_mhc_rmsnorm
    u, _post, _comb = block.hc_pre(
        x,
        block.hc_attn_fn,
        block.hc_attn_scale,
        block.hc_attn_base,
        norm_weight=block.attn_norm.weight if fold else None,
        norm_eps=block.attn_norm.variance_epsilon if fold else 0.0,
    )
    if not fold:
        u = block.attn_norm(u)
    block.attn(positions, u, None)


def step_num_reqs(attn) -> int | None:
    """The step's request count from the attention metadata vLLM set for this layer's SWA cache: requests with a
    query (a full-graph batch pads requests with empty queries, which the scheduler did not count). None where
    there is no metadata (profile and dummy runs) or it is not one dict (micro-batching)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    swa = getattr(attn, "swa_cache_layer", None)
    if not isinstance(metadata, dict) or swa is None:
        return None
    md = metadata.get(swa.prefix)
    qsl = getattr(md, "query_start_loc_cpu", None)
    if qsl is None:
        return None
    return int((qsl[1:] > qsl[:-1]).sum())


def _capturing() -> bool:
    """Is a CUDA graph being captured (full, or breakable piecewise)? Its replays skip Python, so the capture must
    record the layer every K needs: the whole one."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def runner_samples_at_k0(vllm_config) -> bool:
    """Does vLLM's model runner sample the draft (ask for logits) at a K = 0 step, and then discard it?

    Model Runner V1 (0.32 / 0.33, ``v1/spec_decode/llm_base_proposer.py`` ``propose``) returns an empty draft right
    after the first forward when ``num_speculative_tokens == 0``: no. Model Runner V2's MTP speculator
    (``TargetDependentARSpeculator``) skips sampling at K = 0 where its ``_prefill`` takes ``skip_sample``
    (0.33, 0.34): no. V2 on 0.32 has no such parameter: it samples and then overwrites the draft with -1. Without
    an adaptive-verification estimator (which would read those logits; DSpark only) that sample is discarded."""
    if not getattr(vllm_config, "use_v2_model_runner", True):  # 0.34 has no property: V2 only
        return False
    try:
        from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator
    except ImportError:  # another runner layout: expect no logits at K = 0, and fail loudly if asked
        return False
    spec = vllm_config.speculative_config
    if getattr(spec, "enable_adaptive_verification", False):
        return False
    return "skip_sample" not in inspect.signature(TargetDependentARSpeculator._prefill).parameters
