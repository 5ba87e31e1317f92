"""The model's RMS norms (sub-layer, ``q_norm`` / ``kv_norm``, compressor, MTP and final norms) as the kit
computes them: vLLM's CPU ``rms_norm`` kernel where it reproduces the formula, else torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.layernorm import RMSNorm

from vllm_dsv4_mtp.cpu.kit import KIT, vllm_rms_normalise


def _normalise(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` normalised in float32, rounded to ``dtype`` (the first half of vLLM's native ``RMSNorm``)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype)


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, no weight (the query heads' own RMS), ``x: [..., C]`` -> same shape
    and dtype: normalised in float32, rounded once; in 16-bit on CPU through vLLM's ``rms_norm`` kernel where
    it reproduces that (``KIT.rms_norm_kernel``), one op instead of torch's five."""
    if x.device.type == "cpu" and KIT.rms_norm_kernel(x.dtype, x.shape[-1], eps):
        return vllm_rms_normalise(x.contiguous().view(-1, x.shape[-1]), eps).view(x.shape)
    return _normalise(x, eps, x.dtype)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU vLLM runs this norm's native formula (normalise in float32, round to the weight's dtype, multiply
    by the weight); for norms of a few hundred channels per token the cost is host time, so this computes the
    same without the custom-op dispatch. In 16-bit the normalisation is vLLM's CPU ``rms_norm`` kernel without
    a weight (one op instead of torch's five; it needs a contiguous input) where it reproduces the formula
    (``KIT.rms_norm_kernel``); otherwise, and in float32, torch's ``rms_norm``. Then the weight multiplies.
    ``tests/test_model_layers.py`` holds the result equal to vLLM's ``RMSNorm``.
    """
    if x.device.type != "cpu":
        return norm(x)
    eps, weight = norm.variance_epsilon, norm.weight
    normed = rms_normalise(x, eps) if weight.dtype == x.dtype else _normalise(x, eps, weight.dtype)
    return (normed * weight).to(x.dtype)
