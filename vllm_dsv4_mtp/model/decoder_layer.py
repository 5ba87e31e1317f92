"""One DeepSeek-V4 decoder block over ``hc_mult`` residual streams (also the MTP layer's ``mtp_block``).

::

    u, post, comb = hc_attn.pre(X);   X = hc_post(attn(attn_norm(u)), X, post, comb)
    u, post, comb = hc_ffn.pre(X);    X = hc_post(ffn(ffn_norm(u), input_ids), X, post, comb)

``X: [T, hc, D]``. The MoE needs ``input_ids`` (hash routing), so they are part of the block's signature.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.cpu.norm import rms_norm
from vllm_dsv4_mtp.model.attention import DeepseekV4Attention
from vllm_dsv4_mtp.model.hyper_connection import HyperConnection
from vllm_dsv4_mtp.model.moe import DeepseekV4MoE
from vllm_dsv4_mtp.model.quantization import LayerRounding


class DeepseekV4DecoderLayer(nn.Module):
    """Native ``layers.N.*`` (or ``mtp.i.*`` without the MTP-only tensors).

    Args:
        spec: the validated config; ``layer_id`` numbers main layers ``0..n-1`` and MTP layers ``n + i``,
            which fixes the compress ratio (MTP: 0, sliding window) and hash routing (first layers only).
        rounding: the activation rounding of this layer's experts (none for BF16 checkpoints and the bf16 draft).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        spec: DeepseekV4Spec,
        layer_id: int,
        *,
        prefix: str,
        rounding: LayerRounding = LayerRounding(),
    ):
        super().__init__()
        d, hc, eps = spec.hidden_size, spec.hc_mult, spec.rms_norm_eps
        self.attn = DeepseekV4Attention(
            vllm_config, spec, compress_ratio=spec.compress_ratio(layer_id), prefix=f"{prefix}.attn"
        )
        self.ffn = DeepseekV4MoE(
            spec,
            layer_id,
            prefix=f"{prefix}.ffn",
            routed_w4a4=rounding.routed,
            shared_w4a4=rounding.shared,
            shared_fp8=rounding.shared_fp8,
            expert_parallel=vllm_config.parallel_config.enable_expert_parallel,
        )
        self.attn_norm = RMSNorm(d, eps=eps)
        self.ffn_norm = RMSNorm(d, eps=eps)
        self.hc_attn = HyperConnection(d, hc, spec.hc_sinkhorn_iters, spec.hc_eps, eps)
        self.hc_ffn = HyperConnection(d, hc, spec.hc_sinkhorn_iters, spec.hc_eps, eps)

    def write_attention_cache(self, md, positions: torch.Tensor, x: torch.Tensor) -> None:
        """What later steps read of this block: its attention's cache rows for streams ``x: [T, hc, D]``."""
        u, _, _ = self.hc_attn.pre(x)
        self.attn.write_latent(md, positions, rms_norm(u, self.attn_norm))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``x: [T, hc, D]`` streams, ``positions: [T]``, ``input_ids: [T]`` -> ``[T, hc, D]``."""
        u, post, comb = self.hc_attn.pre(x)
        x = self.hc_attn.post(self.attn(positions, rms_norm(u, self.attn_norm)), x, post, comb)
        u, post, comb = self.hc_ffn.pre(x)
        return self.hc_ffn.post(self.ffn(rms_norm(u, self.ffn_norm), input_ids), x, post, comb)
