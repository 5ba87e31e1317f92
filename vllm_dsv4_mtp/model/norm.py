"""The model's RMS norms (sub-layer, ``q_norm`` / ``kv_norm``, compressor, MTP and final norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.layernorm import RMSNorm

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU vLLM runs this norm's native formula (normalise in float32, round to the weight's dtype, multiply
    by the weight); for norms of a few hundred channels per token the cost is host time, so this computes the
    same without the custom-op dispatch. In 16-bit the normalisation is vLLM's CPU ``rms_norm`` kernel without
    a weight (one op; float32 inside, one rounding, as the formula; it needs a contiguous input), then the
    weight multiplies; in float32 torch's ``rms_norm``. ``tests/test_model_layers.py`` holds both equal to
    vLLM's ``RMSNorm``.
    """
    if x.device.type != "cpu":
        return norm(x)
    if x.dtype in _FUSED_DTYPES and norm.weight.dtype == x.dtype:
        x = x.contiguous()
        normed = torch.empty_like(x)
        torch.ops._C.rms_norm(normed, x, None, norm.variance_epsilon)
        return normed * norm.weight
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return (xf.to(norm.weight.dtype) * norm.weight).to(x.dtype)
