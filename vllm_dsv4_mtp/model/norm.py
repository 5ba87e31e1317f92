"""The model's RMS norms (sub-layer, ``q_norm`` / ``kv_norm``, compressor, MTP and final norms)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.layernorm import RMSNorm

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _normalise(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` normalised in float32, rounded to ``dtype`` (the first half of vLLM's native ``RMSNorm``)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype)


def _fused_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, None, eps)
    return out


@functools.cache
def fused_kernel_matches(dtype: torch.dtype, width: int, eps: float) -> bool:
    """Whether vLLM's CPU ``rms_norm`` kernel gives :func:`_normalise`'s values for ``width`` channels of
    ``dtype`` on this CPU. vLLM builds the kernel per instruction set: where the CPU has no AVX512-BF16 its
    bfloat16 conversion truncates instead of rounding to nearest, and some widths are refused; only an exact
    match on a probe (random rows and edge magnitudes) lets the kernel stand in for the formula."""
    g = torch.Generator().manual_seed(width)
    probe = torch.randn(16, width, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(-1)
    probe = probe.to(dtype)
    try:
        return torch.equal(_fused_normalise(probe, eps), _normalise(probe, eps, dtype))
    except (RuntimeError, AttributeError):  # no kernel in this build, or a width it does not take
        return False


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, no weight (the query heads' own RMS), ``x: [..., C]`` -> same shape
    and dtype: normalised in float32, rounded once; in 16-bit on CPU through vLLM's ``rms_norm`` kernel where
    it reproduces that (:func:`fused_kernel_matches`), one op instead of torch's five."""
    if x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and fused_kernel_matches(x.dtype, x.shape[-1], eps):
        return _fused_normalise(x.contiguous().view(-1, x.shape[-1]), eps).view(x.shape)
    return _normalise(x, eps, x.dtype)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU vLLM runs this norm's native formula (normalise in float32, round to the weight's dtype, multiply
    by the weight); for norms of a few hundred channels per token the cost is host time, so this computes the
    same without the custom-op dispatch. In 16-bit the normalisation is vLLM's CPU ``rms_norm`` kernel without
    a weight (one op instead of torch's five; it needs a contiguous input) where it reproduces the formula
    (:func:`fused_kernel_matches`); otherwise, and in float32, torch's ``rms_norm``. Then the weight multiplies.
    ``tests/test_model_layers.py`` holds the result equal to vLLM's ``RMSNorm``.
    """
    if x.device.type != "cpu":
        return norm(x)
    eps, weight = norm.variance_epsilon, norm.weight
    normed = rms_normalise(x, eps) if weight.dtype == x.dtype else _normalise(x, eps, weight.dtype)
    return (normed * weight).to(x.dtype)
