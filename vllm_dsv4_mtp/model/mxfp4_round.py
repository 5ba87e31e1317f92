"""The W4A4 activation rounding as one compiled CPU loop: :func:`round_to_mxfp4` is ``mxfp4.fake_quant``, bit
for bit, in one call instead of ~17 torch ops.

The portable MoE rounds every MXFP4 expert GEMM's input (twice a layer: the layer's input, the routed rows'
SwiGLU); at decode sizes those torch ops are most of an MXFP4 layer's extra cost over BF16. The loop
(``csrc/mxfp4_round.c``, built on first use: ``model/cpu_kernels.py``) serves contiguous bfloat16 / float32 CPU
tensors whose last dimension is a multiple of 32, once a probe per process has found it equal to ``fake_quant``
on the codec's corner values; anything else, or a machine without a compiler, takes ``fake_quant`` itself.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from vllm.logger import init_logger

from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.model.cpu_kernels import ROW_DTYPES, KernelError, function

logger = init_logger("vllm.dsv4_mtp.mxfp4_round")

SIGNATURE = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)  # x, out, rows, k, bf16


def _function():
    return function("mxfp4_round", "dsv4_mxfp4_round", SIGNATURE)


def compiled_round(x: torch.Tensor) -> torch.Tensor:
    """The compiled loop on ``x [..., K]`` (bfloat16 or float32, CPU, ``K % 32 == 0``) -> the same shape and
    dtype; raises :class:`KernelError` where the library is not available."""
    fn = _function()
    if fn is None:
        raise KernelError("the MXFP4 rounding loop is not available (see the log)")
    if x.dtype not in ROW_DTYPES or x.device.type != "cpu" or x.shape[-1] % mxfp4.BLOCK_SIZE:
        raise ValueError(
            f"compiled_round: a CPU bfloat16 / float32 tensor with a last dimension divisible by "
            f"{mxfp4.BLOCK_SIZE} expected, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    x = x.contiguous()
    out = torch.empty_like(x)
    k = x.shape[-1] if x.dim() else 0
    rc = fn(x.data_ptr(), out.data_ptr(), x.numel() // max(k, 1), k, ROW_DTYPES[x.dtype])
    if rc:
        raise KernelError(f"the MXFP4 rounding loop failed (code {rc})")
    return out


def round_to_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """``mxfp4.fake_quant(x)``: through the compiled loop where it serves ``x`` (:func:`usable`), else
    ``fake_quant`` itself; the same bits either way."""
    if (
        x.dtype in ROW_DTYPES
        and x.device.type == "cpu"
        and x.dim()
        and x.shape[-1] % mxfp4.BLOCK_SIZE == 0
        and usable()
    ):
        return compiled_round(x)
    return mxfp4.fake_quant(x)


@functools.cache
def usable() -> bool:
    """Whether the loop built and equals ``fake_quant`` in every bit on a probe (each bfloat16 exponent with
    several significands and both signs, zeros, infinities, NaN, subnormals, ties of the grid), in both dtypes;
    checked once per process."""
    if _function() is None:
        return False
    every = torch.arange(-(2**15), 2**15, 37, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.25, -2.5, -5.0, 0.0, -0.0] * 3 + [6.0] * 25)
    probe = torch.cat([every[: every.numel() // 32 * 32].float(), ties.float()]).reshape(-1, 32)
    for dtype in ROW_DTYPES:
        x = probe.to(dtype)
        try:
            got, want = compiled_round(x).float(), mxfp4.fake_quant(x).float()
        except (KernelError, ValueError) as e:
            logger.info("vllm-dsv4-mtp: the MXFP4 rounding loop failed its probe (%s); fake_quant is used", e)
            return False
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        if not same.all():
            logger.warning(
                "vllm-dsv4-mtp: the MXFP4 rounding loop differs from fake_quant on a probe; fake_quant is used"
            )
            return False
    return True
