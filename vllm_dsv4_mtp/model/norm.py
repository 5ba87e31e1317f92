"""RMS norm of the attention's small per-token vectors (``q_norm``, ``kv_norm``, compressor norms)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import RMSNorm


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU, where vLLM runs this norm's native formula, the same formula op for op (the same values) without
    the custom-op dispatch, which costs more host time than these few-hundred-element norms themselves.
    """
    if x.device.type != "cpu":
        return norm(x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon)
    return (xf.to(norm.weight.dtype) * norm.weight).to(x.dtype)
