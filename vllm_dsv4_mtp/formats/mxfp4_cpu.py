"""The W4A4 activation rounding (:func:`vllm_dsv4_mtp.formats.mxfp4.fake_quant`) as one compiled CPU loop.

``mxfp4.fake_quant`` is the definition: ~25 torch ops, each over the whole tensor. On a decode step's few rows
that costs ~30 us a call on one core, nearly all of it per-op overhead, and the portable MoE calls it twice
per W4A4 layer. This module computes the same values in one pass per 32-element block, compiled by numba
(a dependency of vLLM itself, so present wherever vLLM is): ~4 us at one token.

Bit for bit the same function as ``mxfp4.fake_quant`` (tests/test_mxfp4.py compares them over every bfloat16
bit pattern, float32 corners and random bits, and against amd-quark): per block, ``amax`` (NaN in the block
-> every element NaN), the scale ``p / 4`` with ``p`` the power of two of ``bits(amax) + 2**21`` clamped to
``[2**-127, 2**127]`` (Quark's "even" rule), each magnitude divided by the scale and rounded to the E2M1
grid by ``(a + C) - C`` (``C = spacing * 2**23``: float32 round-half-to-even to a multiple of the spacing,
0.5 below 2, 1 below 4, 2 above), saturated at 6, multiplied back, with the sign of a non-zero result.
Every step is float32 arithmetic (numba keeps float32 operands in float32, and without fastmath LLVM may
not fold ``(a + C) - C``). The products are exact (a 2-bit significand times a power of two), so a bfloat16
result is the float32 one's top 16 bits.

Inputs: a CPU tensor, float32 or bfloat16, not requiring grad (its bits are read through numpy as unsigned
integers: numpy has no bfloat16). Anything else is :func:`supports`' False, and the caller keeps
``mxfp4.fake_quant``. The loop is compiled on first use (~1 s) and kept in numba's on-disk cache (next to
this file, or numba's user cache directory where this one is read-only), which later processes load in ms.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_dsv4_mtp.formats.mxfp4 import check_blocks

_NAN32 = 0x7FC00000
_EXPONENT = 0x7F800000


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`fake_quant` takes ``x`` (a CPU float32 / bfloat16 tensor that does not require grad)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not x.requires_grad


def fake_quant(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``mxfp4.fake_quant(x, group_size)`` for an ``x [..., K]`` that :func:`supports` takes; same shape and
    dtype. ``K`` not a multiple of ``group_size``: the same ValueError as ``mxfp4.fake_quant``."""
    if not supports(x):
        raise TypeError(f"the fused MXFP4 rounding takes CPU float32 / bfloat16 tensors without grad, got a "
                        f"{x.dtype} tensor on {x.device}" + (" requiring grad" if x.requires_grad else ""))
    check_blocks(x, group_size)
    x = x.contiguous()
    out = torch.empty_like(x)
    bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    unsigned = np.uint16 if x.dtype == torch.bfloat16 else np.uint32
    src = x.view(bits).reshape(-1).numpy().view(unsigned)
    dst = out.view(bits).reshape(-1).numpy().view(unsigned)
    _kernel()(src, dst, group_size, x.dtype == torch.bfloat16)
    return out


@functools.cache
def _kernel():
    """The compiled loop (numba compiles it at its first call)."""
    from numba import njit

    def round_blocks(src, dst, group, bf16):  # pragma: no cover (compiled: numba runs a copy of this code)
        """``src`` / ``dst``: the flat float32 (uint32) or bfloat16 (uint16) bits; ``group``: the block size."""
        values = np.empty(group, np.float32)
        value_bits = values.view(np.uint32)
        result = np.empty(group, np.float32)
        result_bits = result.view(np.uint32)
        word = np.empty(1, np.float32)  # a float32 <-> uint32 bit cast
        word_bits = word.view(np.uint32)
        for start in range(0, src.shape[0], group):
            for j in range(group):
                b = np.uint32(src[start + j])
                value_bits[j] = b << np.uint32(16) if bf16 else b
            amax = np.float32(0.0)
            nan = False
            for j in range(group):
                a = abs(values[j])
                nan |= a != a
                amax = max(amax, a)
            if nan:
                for j in range(group):
                    dst[start + j] = _NAN32 >> 16 if bf16 else _NAN32
                continue
            word[0] = amax
            word_bits[0] = (word_bits[0] + np.uint32(1 << 21)) & np.uint32(_EXPONENT)
            scale = min(max(word[0] * np.float32(0.25), np.float32(2.0**-127)), np.float32(2.0**127))
            for j in range(group):
                v = values[j]
                a = abs(v) / scale
                if a < np.float32(2.0):
                    c = np.float32(2.0**22)
                elif a < np.float32(4.0):
                    c = np.float32(2.0**23)
                else:
                    c = np.float32(2.0**24)
                r = min((a + c) - c, np.float32(6.0)) * scale
                result[j] = -r if v < np.float32(0.0) and r != np.float32(0.0) else r
            for j in range(group):
                dst[start + j] = result_bits[j] >> np.uint32(16) if bf16 else result_bits[j]

    try:
        return njit(nogil=True, cache=True)(round_blocks)
    except RuntimeError:  # numba finds no writable cache directory: compile in each process instead
        return njit(nogil=True)(round_blocks)
