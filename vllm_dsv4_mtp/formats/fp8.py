"""FP8 e4m3 weights with one scale per 128x128 block (official DeepSeek-V4 release; Quark FP8).

Storage: ``weight`` float8_e4m3fn ``[out, in]`` plus a scale ``[ceil(out/128), ceil(in/128)]``; block
``(i, j)`` covers rows ``128i .. 128i+127`` and columns ``128j .. 128j+127`` (the last row/column of blocks may
be partial). The official release names the scale ``<module>.scale`` and stores F8_E8M0 (raw exponent
bytes, value ``2**(byte-127)``, 255 = NaN); Quark names it ``<module>.weight_scale``; older DeepSeek
checkpoints store float32 ``weight_scale_inv``. The real weight is ``weight * scale`` (a multiply, whatever
the name says).
"""

from __future__ import annotations

import torch

from vllm_dsv4_mtp.formats.mxfp4 import e8m0_to_float

FP8_BLOCK = 128
E4M3_MAX = 448.0

_E8M0_DTYPES = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def block_scale_shape(shape: tuple[int, ...] | torch.Size, block: int = FP8_BLOCK) -> tuple[int, int]:
    """``[out, in]`` -> ``[ceil(out/block), ceil(in/block)]``."""
    out_f, in_f = shape
    return -(-out_f // block), -(-in_f // block)


def _label(name: str | None) -> str:
    return f"{name}: " if name else ""


def scale_to_float(scale: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """A block scale in any stored form -> float32 values. E8M0 (uint8 / float8_e8m0fnu) is read as raw bytes."""
    if scale.dtype in _E8M0_DTYPES:
        return e8m0_to_float(scale)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return scale.to(torch.float32)
    raise TypeError(f"{_label(name)}FP8 block scale dtype {scale.dtype} is not E8M0 (uint8/float8_e8m0fnu) or float")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 ``[out, in]`` -> ``[rows, block, cols, block]``, zero-padded up to whole blocks.

    One padded copy instead of a full-size expanded scale: decoding a large weight (a shard-sized expert or
    embedding in the quantizer) then needs one float32 temporary, not three.
    """
    out_f, in_f = x.shape
    rows, cols = block_scale_shape(x.shape, block)
    if (rows * block, cols * block) != (out_f, in_f):
        x = torch.nn.functional.pad(x, (0, cols * block - in_f, 0, rows * block - out_f))
    return x.view(rows, block, cols, block)


def dequantize_block_fp8(
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    name: str | None = None,
    block: int = FP8_BLOCK,
) -> torch.Tensor:
    """``weight_fp8`` float8_e4m3fn ``[out, in]`` x ``scale [ceil(out/128), ceil(in/128)]`` -> ``[out, in]`` in
    ``dtype``.

    ``scale`` is float32 (or bf16/fp16) values, or raw E8M0 bytes (uint8 / float8_e8m0fnu). The product is
    formed in float32 and then cast: with E8M0 scales it is exact (4 significant bits times a power of two),
    with a float32 scale it is rounded once to float32.
    ``name`` (the tensor's checkpoint name) is put in every error message.
    """
    if weight_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{_label(name)}FP8 block weight must be float8_e4m3fn (F8_E4M3), got {weight_fp8.dtype}")
    if weight_fp8.ndim != 2:
        raise ValueError(f"{_label(name)}FP8 block weight must be 2-D [out, in], got shape {tuple(weight_fp8.shape)}")
    want = block_scale_shape(weight_fp8.shape, block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{_label(name)}FP8 block scale shape {tuple(scale.shape)} does not match weight shape "
            f"{tuple(weight_fp8.shape)}: expected {want} = [ceil(out/{block}), ceil(in/{block})]"
        )
    s = scale_to_float(scale, name)
    out_f, in_f = weight_fp8.shape
    blocks = _blocks(weight_fp8.to(torch.float32), block).mul_(s[:, None, :, None])
    return blocks.view(want[0] * block, want[1] * block)[:out_f, :in_f].to(dtype)


def quantize_block_fp8(
    w: torch.Tensor, scale_format: str = "e8m0", *, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` float -> (float8_e4m3fn ``[out, in]``, scale ``[ceil(out/128), ceil(in/128)]``).

    For building test checkpoints in the official layout. ``scale_format="e8m0"``: the scale is the smallest
    power of two >= amax/448 (the ue8m0 rule of DeepSeek's reference quantizer), returned as raw uint8
    E8M0 bytes; ``"float32"``: amax/448 as float32. All-zero blocks get the scale of amax = 1e-4 (as the
    reference quantizer clamps). Elements: ``w / scale`` clamped to +-448, rounded to nearest even e4m3.
    """
    if scale_format not in ("e8m0", "float32"):
        raise ValueError(f"scale_format must be 'e8m0' or 'float32', got {scale_format!r}")
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_block_fp8 needs a 2-D float tensor [out, in], got {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    blocks = _blocks(w.to(torch.float32), block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4)  # the zero padding never raises a block's amax
    scale = amax / E4M3_MAX
    if scale_format == "e8m0":
        mant, exp = torch.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
        ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)
        scale_bytes = (ceil_log2 + 127).clamp(0, 254).to(torch.uint8)
        scale_values = e8m0_to_float(scale_bytes)
        stored = scale_bytes
    else:
        scale_values = stored = scale
    q = (blocks / scale_values[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = q.view(blocks.shape[0] * block, blocks.shape[2] * block)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q, stored


def fake_quant_act(x: torch.Tensor, scale_format: str = "float32", *, group: int = FP8_BLOCK) -> torch.Tensor:
    """Dynamic per-token-group FP8 e4m3 rounding of an FP8 block linear's input, as DeepSeek's FP8 GEMMs see it.

    ``x [..., K]`` -> the same shape and dtype. Each run of ``group`` (128) elements along ``K`` (the last run
    may be shorter) gets the scale ``s = max(|x|, 1e-4) / 448`` (``"e8m0"``: rounded up to a power of two, the
    ``scale_fmt: ue8m0`` rule), its elements ``x / s`` round to nearest-even e4m3 and come back as ``q * s``.
    Computed in float32, cast to ``x.dtype`` once (exact for bfloat16: e4m3 times a power of two or a float32
    scale needs at most 4 + 24 bits, and the cast rounds once).
    """
    if scale_format not in ("e8m0", "float32"):
        raise ValueError(f"scale_format must be 'e8m0' or 'float32', got {scale_format!r}")
    k = x.shape[-1]
    xf = x.float()
    pad = -k % group
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    g = xf.reshape(*xf.shape[:-1], -1, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-4) / E4M3_MAX
    if scale_format == "e8m0":
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mant == 0.5, exp - 1, exp))
    q = (g / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float().mul_(scale)
    return q.reshape(xf.shape)[..., :k].to(x.dtype)
