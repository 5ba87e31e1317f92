"""The model's RMS norms (sub-layer, ``q_norm`` / ``kv_norm``, compressor, MTP and final norms)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import RMSNorm


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU, where vLLM runs this norm's native formula, the same formula op for op (the same values) without
    the custom-op dispatch, which costs more host time than these norms of a few hundred channels per token.
    """
    if x.device.type != "cpu":
        return norm(x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon)
    return (xf.to(norm.weight.dtype) * norm.weight).to(x.dtype)
