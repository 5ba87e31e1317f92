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

from vllm_dsv4_mtp.model.attention import DeepseekV4Attention
from vllm_dsv4_mtp.model.hyper_connection import HyperConnection
from vllm_dsv4_mtp.model.moe import DeepseekV4MoE


class DeepseekV4DecoderLayer(nn.Module):
    """Native ``layers.N.*`` (or ``mtp.i.*`` without the MTP-only tensors).

    Args:
        compress_ratio: 0 (SWA), 4 (C4 + indexer) or another ratio (C128-style); MTP blocks pass 0.
        is_hash: hash-routed MoE (``gate.tid2eid``) instead of bias-routed.
        expert_format: "bf16" | "mxfp4" routed experts (see ``kernels/experts.py``).
        shared_format: "bf16" (also FP8 checkpoints, decoded at load) | "mxfp4" (AMD export's main layers).
    """

    def __init__(self, vllm_config: VllmConfig, *, compress_ratio: int, is_hash: bool, expert_format: str,
                 prefix: str, activation_quant: bool = True, shared_format: str = "bf16"):
        super().__init__()
        config = vllm_config.model_config.hf_config
        d, hc, eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        iters = getattr(config, "hc_sinkhorn_iters", 20)
        hc_eps = getattr(config, "hc_eps", 1e-6)
        self.attn = DeepseekV4Attention(vllm_config, compress_ratio=compress_ratio, prefix=f"{prefix}.attn")
        self.ffn = DeepseekV4MoE(config, is_hash=is_hash, expert_format=expert_format, prefix=f"{prefix}.ffn",
                                 activation_quant=activation_quant, shared_format=shared_format)
        self.attn_norm = RMSNorm(d, eps=eps)
        self.ffn_norm = RMSNorm(d, eps=eps)
        self.hc_attn = HyperConnection(d, hc, iters, hc_eps, eps)
        self.hc_ffn = HyperConnection(d, hc, iters, hc_eps, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``x: [T, hc, D]`` streams, ``positions: [T]``, ``input_ids: [T]`` -> ``[T, hc, D]``."""
        u, post, comb = self.hc_attn.pre(x)
        x = self.hc_attn.post(self.attn(positions, self.attn_norm(u)), x, post, comb)
        u, post, comb = self.hc_ffn.pre(x)
        return self.hc_ffn.post(self.ffn(self.ffn_norm(u), input_ids), x, post, comb)
