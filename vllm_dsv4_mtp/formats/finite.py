"""Non-finite values (NaN, +-Inf) in stored tensors, found from their bytes.

A NaN or Inf weight is never meaningful in a DeepSeek-V4 checkpoint: it comes from a broken export or a
corrupted file, quantizes to the E8M0 NaN/Inf scale bytes 255/254, and makes the engine emit garbage (empty
strings) without an error. This module says, per stored tensor, whether and how many such values it holds:

- float tensors (F64 / F32 / F16 / BF16): one reduction pass (``torch.aminmax``, which propagates NaN) decides;
  the exact counts are computed only for a tensor that fails it;
- FP8 weights: E4M3 (``fn``) has NaN codes ``0x7F`` / ``0xFF`` and no Inf; E5M2 has Inf (exponent all ones,
  mantissa 0) and NaN (exponent all ones, mantissa not 0); the ``fnuz`` variants have one NaN code, ``0x80``;
- E8M0 scales (``F8_E8M0``, or ``U8`` under a scale name): byte 255 is NaN (OCP MX v1.0);
- integers, packed FP4 codes (E2M1 has no NaN or Inf): nothing to find.
"""

from __future__ import annotations

import torch

__all__ = ["has_nonfinite", "describe_nonfinite", "stored_nonfinite", "SCALE_SUFFIXES"]

_FLOAT = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# names of scale tensors: official release, Quark, DeepSeek-V3-style FP8
SCALE_SUFFIXES = (".scale", ".weight_scale", ".weight_scale_inv")


def has_nonfinite(t: torch.Tensor) -> bool:
    """True when a float tensor holds a NaN or an Inf; one pass, no temporary as large as ``t``."""
    if t.numel() == 0:
        return False
    lo, hi = torch.aminmax(t)
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def describe_nonfinite(t: torch.Tensor) -> str | None:
    """``"3 NaN, 1 +Inf of 16384 values"`` for a float tensor with non-finite values, else None."""
    if not has_nonfinite(t):
        return None
    counts = {
        "NaN": int(torch.isnan(t).sum()),
        "+Inf": int(torch.isposinf(t).sum()),
        "-Inf": int(torch.isneginf(t).sum()),
    }
    return _counts(counts, t.numel())


def _counts(counts: dict[str, int], numel: int) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) + f" of {numel} values"


def stored_nonfinite(name: str, dtype: str, data: torch.Tensor) -> str | None:
    """Non-finite values in one stored tensor, given its safetensors ``dtype`` and its raw bytes ``data``
    (uint8, any shape): a description (see :func:`describe_nonfinite`) or None when every value is finite."""
    raw = data.reshape(-1).view(torch.uint8)
    if dtype in _FLOAT:
        return describe_nonfinite(raw.view(_FLOAT[dtype]))
    if dtype == "F8_E4M3":
        return _bytes_matching(raw, 0x7F, 0x7F, "NaN")
    if dtype in ("F8_E4M3FNUZ", "F8_E5M2FNUZ"):
        return _bytes_matching(raw, 0xFF, 0x80, "NaN")
    if dtype == "F8_E5M2":
        special = (raw & 0x7C) == 0x7C
        if not bool(special.any()):
            return None
        inf = special & ((raw & 0x03) == 0)
        counts = {
            "NaN": int((special & ~inf).sum()),
            "+Inf": int((inf & (raw < 0x80)).sum()),
            "-Inf": int((inf & (raw >= 0x80)).sum()),
        }
        return _counts(counts, raw.numel())
    if dtype == "F8_E8M0" or (dtype == "U8" and name.endswith(SCALE_SUFFIXES)):
        return _bytes_matching(raw, 0xFF, 0xFF, "NaN")
    return None


def _bytes_matching(raw: torch.Tensor, mask: int, code: int, what: str) -> str | None:
    if raw.numel() == 0:
        return None
    # the common case (none) costs one reduction; counting only for a tensor that has some
    if mask == 0xFF and code == 0xFF:
        if int(raw.max()) != 0xFF:
            return None
        n = int((raw == 0xFF).sum())
    else:
        n = int(((raw & mask) == code).sum())
        if not n:
            return None
    return _counts({what: n}, raw.numel())
