"""The plugin's ``DeepseekV4ForCausalLM``: DeepSeek-V4 target model on vLLM's building blocks.

::

    X = repeat(embed[ids], hc)                        # [T, hc, D] residual streams
    for block in layers: X = block(positions, X, ids)
    H = X.flatten(1)                                  # [T, hc*D]: what the MTP draft consumes
    logits = head(norm(hc_head(X)))

The model runs eagerly: the class is deliberately not ``@support_torch_compile``-decorated (the portable
attention touches the paged cache from Python; see ``attention/rows.py``). When a speculative config
that feeds hidden states to a drafter is present, the pre-``hc_head`` state ``H`` of the last step is kept in
a buffer returned by :meth:`DeepseekV4ForCausalLM.get_mtp_target_hidden_states`, as vLLM's in-tree model does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from vllm_dsv4_mtp.config import spec_from_hf_config
from vllm_dsv4_mtp.cpu.linear import ensure_prepared, prepare_weights
from vllm_dsv4_mtp.cpu.norm import rms_norm
from vllm_dsv4_mtp.formats.checkpoint import validate_shard_headers
from vllm_dsv4_mtp.model.decoder_layer import DeepseekV4DecoderLayer
from vllm_dsv4_mtp.model.hyper_connection import HyperHead
from vllm_dsv4_mtp.model.quantization import layer_rounding
from vllm_dsv4_mtp.startup_checks import check_step_budget
from vllm_dsv4_mtp.weights.loader import TARGET, CheckpointLoader
from vllm_dsv4_mtp.weights.names import target_param

logger = init_logger("vllm.dsv4_mtp.model")


class DeepseekV4Model(nn.Module):
    """Embedding, decoder blocks, ``hc_head`` and final norm (native ``embed``, ``layers.*``, ``hc_head_*``,
    ``norm``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.spec = spec = spec_from_hf_config(config)
        self.hc_mult = spec.hc_mult
        self.hidden_size = spec.hidden_size
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, prefix=f"{prefix}.embed_tokens")
        rounding = layer_rounding(spec)
        self.rounds_to_mxfp4 = any(r.routed or r.shared for r in rounding)  # W4A4 experts somewhere
        layers = [
            DeepseekV4DecoderLayer(vllm_config, spec, i, prefix=f"{prefix}.layers.{i}", rounding=rounding[i])
            for i in range(spec.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.hc_head = HyperHead(spec.hidden_size, spec.hc_mult, spec.hc_eps, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        # pre-hc_head residual streams for an MTP drafter, [max_num_batched_tokens, hc*D]
        self._mtp_hidden_buffer: torch.Tensor | None = None
        sc = vllm_config.speculative_config
        if sc is not None and (sc.use_eagle() or sc.uses_draft_model()):
            self._mtp_hidden_buffer = torch.zeros(
                vllm_config.scheduler_config.max_num_batched_tokens,
                spec.hc_mult * spec.hidden_size,
                dtype=vllm_config.model_config.dtype,
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> final hidden ``[T, D]`` (after ``hc_head`` and ``norm``)."""
        if input_ids is None:
            raise ValueError("DeepSeek-V4 needs input_ids (hash-routed MoE layers); inputs_embeds alone is not enough")
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = h.unsqueeze(1).repeat(1, self.hc_mult, 1)  # [T, hc, D]
        for layer in self.layers:
            x = layer(positions, x, input_ids)
        if self._mtp_hidden_buffer is not None:
            self._mtp_hidden_buffer[: x.shape[0]].copy_(x.flatten(1))
        return rms_norm(self.hc_head(x), self.norm)


class DeepseekV4ForCausalLM(nn.Module):
    """vLLM model class registered for architecture ``DeepseekV4ForCausalLM`` by the plugin."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        validate_shard_headers(vllm_config.model_config.model)  # a truncated/missing shard named before vLLM reads it
        check_step_budget(vllm_config)  # no prompt that waits forever (chunked prefill off, budget < max-model-len)
        self.config = vllm_config.model_config.hf_config
        self.vllm_config = vllm_config
        self.source = vllm_config.model_config.model
        self.model = DeepseekV4Model(vllm_config=vllm_config, prefix="model")
        spec = self.model.spec
        # what this model asks the CPU kit (its weightless RMS norms' widths among it); answered at prepare_weights
        self.kit_questions = dict(
            dtype=vllm_config.model_config.dtype,
            head_dim=spec.head_dim,
            norm_widths=tuple(sorted({spec.hidden_size, spec.q_lora_rank, spec.head_dim})),
            eps=spec.rms_norm_eps,
            w4a4=self.model.rounds_to_mxfp4,
        )
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(spec.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        ensure_prepared(self)
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """The pre-``hc_head`` streams ``[max_num_batched_tokens, hc*D]`` of the last forward (rows ``[:T]``
        are valid), or None when no drafter consumes them."""
        return self.model._mtp_hidden_buffer

    def describe(self) -> dict:
        """What this instance runs (for logs and tests): class, dtype, per-layer attention and expert arithmetic."""
        layers = self.model.layers
        return {
            "class": f"{type(self).__module__}.{type(self).__name__}",
            "dtype": str(self.lm_head.weight.dtype),
            "compress_ratios": [layer.attn.compress_ratio for layer in layers],
            "hash_layers": [i for i, layer in enumerate(layers) if layer.ffn.gate.is_hash],
            "expert_activation_quant": [layer.ffn.experts.activation_quant for layer in layers],
            "shared_activation_quant": [layer.ffn.shared_experts.activation_quant for layer in layers],
            "row_widths": [layer.attn.row_width for layer in layers],
            "cache_row_width": layers[0].attn.sparse_attn.cache_width,
            "mtp_hidden_buffer": None
            if self.model._mtp_hidden_buffer is None
            else list(self.model._mtp_hidden_buffer.shape),
        }

    def expert_weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The dense weights of one routed expert, per native shard ``w1 [I, D]``, ``w2 [D, I]``, ``w3 [I, D]``
        (TP = 1; for tests: a quantized checkpoint's experts must equal their exact decode)."""
        ex = self.model.layers[layer].ffn.experts
        i = ex.local_intermediate
        w13 = ex.w13_weight[expert - ex.first_expert]
        return {"w1": w13[:i].clone(), "w3": w13[i:].clone(), "w2": ex.w2_weight[expert - ex.first_expert].clone()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the main-model tensors of a native checkpoint (``mtp.*`` is the draft's); strict, see
        :class:`vllm_dsv4_mtp.weights.loader.CheckpointLoader`."""
        spec = self.model.spec
        # vLLM's in-place reload puts every layer on the meta device first (so is the first real load after a dummy one)
        reload = any(p.is_meta for p in self.parameters())
        loaded = CheckpointLoader(
            self,
            spec,
            scope=TARGET,
            dtype=self.vllm_config.model_config.dtype,
            source=self.source,
            param_for=lambda name: target_param(name, num_hidden_layers=spec.num_hidden_layers),
        ).load(weights)
        if reload:  # vLLM's in-place reload calls load_weights, not the hook below
            prepare_weights(self)
        if reload and self.model._mtp_hidden_buffer is not None:
            # vLLM's reload_weights reaches get_model() only (0.32, 0.33): the draft is a model of its own
            logger.warning(
                "vllm-dsv4-mtp: weights reloaded in place into the target only; the MTP draft keeps "
                "the MTP layer it started with (outputs are the new target's, verified; acceptance may "
                "fall): start a new engine to update the draft"
            )
        return loaded

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level post-load hook, after every first load (the dummy one too): the one post-load
        stage (``cpu/linear.py``)."""
        prepare_weights(self)
