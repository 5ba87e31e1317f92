"""OCP MXFP4: E2M1 elements in blocks of 32 along the last (reduction) dim, one E8M0 scale per block.

Bit-exact with what AMD Quark 0.13 writes for ``OCP_MXFP4Spec`` (``scale_calculation_mode="even"``,
``round_method="half_even"``), which is the format of ``amd/DeepSeek-V4-Pro-MXFP4`` experts.

Storage (the layout of Quark's export and of the official DeepSeek-V4 FP4 experts):

- ``packed``: uint8 ``[..., K // 2]``; byte ``j`` holds element ``2j`` in its LOW nibble and ``2j + 1`` in
  its high nibble. A nibble is an E2M1 code: bit 3 = sign, bits 0-2 index ``0, .5, 1, 1.5, 2, 3, 4, 6``.
- ``scales``: uint8 ``[..., K // 32]``, raw E8M0 bytes: value ``2 ** (byte - 127)``; byte 0 is ``2**-127``;
  255 is NaN (OCP MX v1.0). Never cast E8M0 numerically: always move the raw bytes (``.view(torch.uint8)``).

Scale rule (Quark's ``even_round``): add ``2**21`` to the float32 bit pattern of the block's amax and keep only
its exponent bits (a significand below 1.75 stays in its binade, 1.75 or more moves up to the next power of
two), then ``exponent = floor(log2(that)) - 2`` (2 = emax of E2M1), clamped to ``[-127, 127]``. In bit terms,
with ``E`` the biased exponent of ``bits(amax) + 2**21``: ``byte = clamp(E - 2, 0, 252)``, or 254 when ``E`` is
255 (amax is, or rounds up to, inf; byte 253 never occurs). This is ``floor(log2(amax)) - 2`` except
one higher when amax's significand is >= 1.75 (amax 1.75 -> scale 0.5, amax 7 -> scale 2, so 7 quantizes to
8, not 6). Elements: ``x / scale`` rounded to the nearest E2M1 value, ties to even, saturating at +-6.

Special values (first: Quark's defined behaviour, which this module matches; then where Quark has none):

- all-zero block: every code 0 and scale byte 1 (``2**-126``). Quark's quantizer picks ``2**-127`` here but its
  exporter clamps the logged scale at ``2**-126`` (``safe_log2``) and writes 1; we write the same byte.
- negative values that round to zero, and ``-0.0``: code 0 (+0), as Quark's quantizer returns +0.0 for them.
  ``fake_quant`` therefore yields +0.0 there. Decoding code 8 (as other producers may write) gives -0.0.
- blocks whose amax rounds below ``2**-124`` (not all zero): scale ``2**-127`` (byte 0). Quark quantizes the
  elements with that scale too, but its exporter writes byte 1 (clamped), which decodes to twice the value
  it quantized; we write the byte that decodes to Quark's own fake-quant result.
- +-inf in a block: the scale is ``2**127`` (byte 254, Quark's rule), the infinite element saturates to +-6
  (code 7 / 15; OCP saturating conversion; Quark's packer turns inf into code 6 by bit extraction), the
  other elements are quantized against ``2**127``. Decoding gives +-inf (6 * 2**127 overflows float32,
  bfloat16 and float16), equal to Quark's fake-quant value.
- NaN anywhere in a block: scale byte 255 (NaN, OCP) and every code 0; the block decodes to NaN (even a
  decoder that ignores the NaN encoding computes ``2**128 * 0 = NaN``). Quark's exporter writes an
  undefined byte here (a NaN cast to int); its fake-quant gives NaN for the whole block, as we do.

All functions work on any leading dims and compute in float32 (bfloat16/float16 inputs are exact in it).
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# The scale byte Quark's exporter writes for an all-zero block (see the module docstring).
E8M0_ZERO_BLOCK = 1
E2M1_MAX = 6.0
_E2M1_EMAX = 2  # floor(log2(6)): the scale exponent is floor(log2(amax)) - 2

# E2M1 value of each 4-bit code (bit 3 = sign).
E2M1_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)

# Midpoints between neighbouring E2M1 magnitudes. Round-half-to-even sends a tie to the neighbour with an
# even code (mantissa bit 0): 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4 go DOWN (so |v| must exceed them),
# 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 go UP (|v| reaching them is enough).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _byte_view(t: torch.Tensor, what: str, allowed: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Reinterpret ``t``'s bytes as uint8 (never a numeric cast)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype in allowed:
        return t.contiguous().view(torch.uint8)
    names = ", ".join(str(d) for d in (torch.uint8, *allowed))
    raise TypeError(f"MXFP4 {what} must be raw bytes ({names}), got {t.dtype}")


def _packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    allowed = (torch.int8,) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())
    return _byte_view(packed, "packed elements", allowed)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    allowed = (torch.int8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    return _byte_view(scales, "E8M0 scales", allowed)


def _check_last_dim(x: torch.Tensor, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"MXFP4 group_size must be a positive even number, got {group_size}")
    if x.ndim == 0 or x.shape[-1] % group_size:
        k = x.shape[-1] if x.ndim else "a 0-d tensor"
        raise ValueError(
            f"MXFP4 quantizes blocks of {group_size} along the last dim, but its size is {k} "
            f"(shape {tuple(x.shape)}): not a multiple of {group_size}"
        )


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Raw E8M0 bytes ``[...]`` (uint8 / int8 / float8_e8m0fnu) -> float32 ``2**(byte - 127)``; 255 -> NaN."""
    b = _scale_bytes(scales).to(torch.int32)
    return _byte_value_bits(b).view(torch.float32).masked_fill(b == E8M0_NAN, float("nan"))


def _byte_value_bits(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as int32 -> the float32 bit patterns of ``2**(byte - 127)``."""
    # byte 0 is 2**-127, a float32 subnormal (bit 22); every other byte is a plain biased exponent.
    return torch.where(byte == 0, 1 << 22, byte << 23)


def _even_rule_byte(a: torch.Tensor) -> torch.Tensor:
    """Float32 block amax ``[...]`` -> the int32 scale byte of Quark's "even" rule, zero and NaN blocks aside.

    ``byte = clamp(E - 2, 0, 252)`` with ``E`` the biased float32 exponent of ``bits(amax) + 2**21``: an amax
    whose significand is >= 1.75 moves up one binade. An amax that is inf, or rounds up to inf (``E == 255``),
    has log2 = inf, clamped to exponent 127: byte 254, so byte 253 is never produced (finite roundings top out
    at 2**127 -> 125 -> byte 252). In int32 only NaN bit patterns can wrap; callers mask NaN blocks.
    """
    rounded_exp = (a.view(torch.int32) + (1 << 21)) >> 23  # amax >= 0, so the sign bit is clear
    return (rounded_exp - _E2M1_EMAX).clamp_(0, 252).masked_fill_(rounded_exp >= 255, 254)


def e8m0_scale_even(amax: torch.Tensor) -> torch.Tensor:
    """Block amax ``[...]`` (float, >= 0 or NaN) -> E8M0 scale byte ``[...]`` uint8 by Quark's "even" rule
    (:func:`_even_rule_byte`); zero amax -> :data:`E8M0_ZERO_BLOCK`; NaN -> 255."""
    a = amax.to(torch.float32)
    byte = _even_rule_byte(a).to(torch.uint8)
    byte = byte.masked_fill(a == 0, E8M0_ZERO_BLOCK)
    return byte.masked_fill(torch.isnan(a), E8M0_NAN)


def quantize_codes(x: torch.Tensor, group_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` float -> (E2M1 codes uint8 ``[..., K]``, one per element; scales uint8 ``[..., K // g]``)."""
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"MXFP4 quantize needs a floating-point tensor, got {x.dtype}")
    _check_last_dim(x, group_size)
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = x.to(torch.float32).reshape(*lead, k // group_size, group_size)
    amax = blocks.abs().amax(dim=-1)  # NaN-propagating
    scales = e8m0_scale_even(amax)
    # Division by an exact power of two (as Quark does). NaN blocks give NaN here, and every comparison
    # below is False for NaN, so their codes come out 0.
    v = blocks / e8m0_to_float(scales).unsqueeze(-1)
    a = v.abs()
    codes = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _TIES_DOWN:
        codes += a > t
    for t in _TIES_UP:
        codes += a >= t
    # Quark returns +0.0 for anything that rounds to zero, so the sign is kept only on non-zero codes.
    codes |= ((v < 0) & (codes > 0)).to(torch.uint8) << 3
    return codes.reshape(*lead, k), scales


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 ``[..., K]`` (K even) -> packed uint8 ``[..., K // 2]``, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes needs an even last dim, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed ``[..., N]`` (uint8 / int8 / float4_e2m1fn_x2) -> E2M1 codes uint8 ``[..., 2N]``."""
    b = _packed_bytes(packed)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def quantize(x: torch.Tensor, group_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (packed uint8 ``[..., K // 2]``, E8M0 scales uint8 ``[..., K // group_size]``)."""
    codes, scales = quantize_codes(x, group_size)
    return pack_codes(codes), scales


def _byte_lut(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the two element values (low nibble first) of every packed byte."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    b = torch.arange(256, device=device)
    return torch.stack((values[b & 0x0F], values[b >> 4]), dim=-1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed ``[..., N]`` -> unscaled E2M1 element values float32 ``[..., 2N]``."""
    b = _packed_bytes(packed)
    return _byte_lut(b.device)[b.long()].reshape(*b.shape[:-1], b.shape[-1] * 2)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, group_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """(packed ``[..., K // 2]``, scales ``[..., K // group_size]``) -> values ``[..., K]`` in ``dtype``.

    The product is formed in float32, where it is exact (or +-inf on overflow), then cast.
    """
    p, s = _packed_bytes(packed), _scale_bytes(scales)
    k = p.shape[-1] * 2 if p.ndim else 0
    if p.ndim == 0 or s.shape[:-1] != p.shape[:-1] or s.shape[-1] * group_size != k:
        raise ValueError(
            f"MXFP4 scales shape {tuple(s.shape)} does not match packed shape {tuple(p.shape)}: "
            f"expected {(*p.shape[:-1], k // group_size) if p.ndim else '?'} (one scale per {group_size} elements)"
        )
    return _scaled(unpack_e2m1(p), s, group_size).to(dtype)


def fake_quant(x: torch.Tensor, group_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Quantize-dequantize ``x [..., K]`` (the W4A4 activation rounding); same shape and dtype as ``x``.

    The same values as ``dequantize(*quantize(x))``, bit for bit, in a fraction of the ops (it runs on every
    W4A4 GEMM input of every step): no codes or scale bytes are formed. A block's values, divided by its E8M0
    scale (:func:`_even_scale`, exact: a power of two), are rounded to the E2M1 grid directly: the grid's
    spacing ``s`` is 0.5 below 2, 1 below 4 and 2 up to 6 (the largest value). ``(v + C) - C`` with
    ``C = 1.5 * s * 2**23`` is ``v`` rounded to a multiple of ``s``, half to even, for either sign (``v + C``
    stays in the binade ``[2**23 s, 2**24 s)``, whose float32 ulp is ``s``, and ``C`` is an even multiple of
    ``s``), which is E2M1's tie rule (ties go to the even code); a value that rounds to zero comes out
    ``C - C = +0.0``, as Quark writes it. ``C``'s bits come from ``v``'s exponent, without the comparisons and
    selects that would cost most of this function's time on CPU.
    """
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"MXFP4 quantize needs a floating-point tensor, got {x.dtype}")
    _check_last_dim(x, group_size)
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = x.to(torch.float32).reshape(*lead, k // group_size, group_size)
    scale = _even_scale(blocks.abs().amax(dim=-1, keepdim=True))  # NaN for a NaN block: every element NaN
    v = blocks / scale
    offset = _grid_offset(v)
    q = (v + offset).sub_(offset).clamp_(-6.0, 6.0)  # saturates at +-6, as the largest codes
    return q.mul_(scale).reshape(*lead, k).to(x.dtype)


def _grid_offset(v: torch.Tensor) -> torch.Tensor:
    """``C = 1.5 * s * 2**23`` for values ``v`` (float32, any sign, NaN allowed): ``s`` the E2M1 grid spacing at
    ``|v|``, 0.5 below 2 (biased exponent <= 127), 1 in [2, 4) (128), 2 from 4 up (>= 129); ``C``'s biased
    exponent is that exponent, clamped to [127, 129], plus 22, and its significand 1.5."""
    # the exponent field kept in place (the sign bit dropped), clamped, plus 22 and the significand's top bit
    # (a NaN's C is any of the three: NaN + C - C is NaN)
    return ((v.view(torch.int32) & 0x7F800000).clamp_(127 << 23, 129 << 23) + ((22 << 23) | (1 << 22))).view(
        torch.float32
    )


def _even_scale(amax: torch.Tensor) -> torch.Tensor:
    """Block amax float32 ``[...]`` (>= 0 or NaN) -> its E8M0 scale as float32, the value of
    ``e8m0_to_float(e8m0_scale_even(amax))`` except for all-zero blocks (``2**-127`` here, not the exporter's
    byte 1: either way every element rounds to +0.0).

    :func:`_even_rule_byte`'s rule in float arithmetic: ``p``, the power of two of ``bits(amax) + 2**21``'s
    binade (0 below the normal range, inf for ``E == 255``), times 1/4 is byte ``E - 2``, exact; the clamp to
    ``[2**-127, 2**127]`` is bytes 0 and 254 (an inf or rounding-to-inf amax). Equal to the byte route for
    every non-negative float32 bit pattern (checked over all 2**31 of them)."""
    p = ((amax.view(torch.int32) + (1 << 21)) & 0x7F800000).view(torch.float32)
    return (p * 0.25).clamp_(min=2.0**-127, max=2.0**127).masked_fill_(amax.isnan(), float("nan"))


def _scaled(values: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """E2M1 element values float32 ``[..., K]`` x E8M0 bytes ``[..., K // group_size]`` -> float32 ``[..., K]``.

    Exact in float32 (a 2-bit significand times a power of two), or +-inf where 6 * 2**127 overflows.
    """
    *lead, k = values.shape
    blocks = values.reshape(*lead, k // group_size, group_size) * e8m0_to_float(scales).unsqueeze(-1)
    return blocks.reshape(*lead, k)
