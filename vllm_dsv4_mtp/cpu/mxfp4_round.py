"""The W4A4 activation rounding as one compiled CPU loop: :func:`compiled_round` is ``mxfp4.fake_quant``, bit
for bit, in one call instead of ~17 torch ops (the model calls ``cpu/kit.py:round_to_mxfp4``, which takes it
where the kit's probe found it equal).

The portable MoE rounds every MXFP4 expert GEMM's input (twice a layer: the layer's input, the routed rows'
SwiGLU); at decode sizes those torch ops are most of an MXFP4 layer's extra cost over BF16. The loop
(``csrc/mxfp4_round.c``, built on first use: ``cpu/compiled.py``) serves contiguous bfloat16 / float32 CPU
tensors whose last dimension is a multiple of 32, once a probe per process has found it equal to ``fake_quant``
on the codec's corner values; anything else, or a machine without a compiler, takes ``fake_quant`` itself.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_dsv4_mtp.cpu.compiled import ROW_DTYPES, KernelError, function
from vllm_dsv4_mtp.formats import mxfp4

SIGNATURE = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)  # x, out, rows, k, bf16


def loaded():
    """The C function, or None where the loop cannot be built or loaded (logged once)."""
    return function("mxfp4_round", "dsv4_mxfp4_round", SIGNATURE)


def compiled_round(x: torch.Tensor) -> torch.Tensor:
    """The compiled loop on ``x [..., K]`` (bfloat16 or float32, CPU, ``K % 32 == 0``) -> the same shape and
    dtype; raises :class:`KernelError` where the library is not available."""
    fn = loaded()
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
