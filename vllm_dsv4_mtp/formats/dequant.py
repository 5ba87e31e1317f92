"""Quantized checkpoint tensors decoded exactly to a dense dtype, as they stream past.

A quantized linear is stored as two tensors that may arrive in either order (they often sit in different
shards): the weight (``float8_e4m3fn`` for FP8; packed E2M1 bytes, ``uint8`` Quark / ``int8`` official,
for FP4) and its scale (``<module>.scale`` in the official release, ``.weight_scale`` in a Quark export,
``.weight_scale_inv`` in older FP8 checkpoints). :class:`Dequantizer` pairs them by name and yields one dense
tensor per weight, with the precision it was stored in. Both decodes are exact: an FP8 value or an E2M1
value times an E8M0 power of two is representable in BF16 and float32 (saturating to inf only past 2**128).

Everything else passes through untouched, tagged ``"dense"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")
DENSE = "dense"
FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"  # Quark: uint8 packed + uint8 E8M0 .weight_scale
FP4_OFFICIAL = "fp4-official"  # official release: int8 packed + F8_E8M0 .scale
_PACKED = (torch.uint8, torch.int8)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class Decoded:
    """One logical tensor: ``name`` (the weight's name for a quantized pair), its values, how it was stored."""

    name: str
    tensor: torch.Tensor
    stored: str  # DENSE | FP8_BLOCK | MXFP4 | FP4_OFFICIAL


def scale_owner(name: str) -> str | None:
    """``x.scale`` / ``x.weight_scale`` / ``x.weight_scale_inv`` -> ``x.weight``; None for any other name."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    """An FP8 weight, or packed FP4 bytes under a ``.weight`` name (``tid2eid`` is an integer table, not one)."""
    return t.dtype == torch.float8_e4m3fn or (t.dtype in _PACKED and name.endswith(".weight"))


class Dequantizer:
    """Streams ``(name, tensor)`` pairs into :class:`Decoded` tensors in ``dtype``; ``source`` prefixes errors.

    Call :meth:`finish` after the last tensor: a weight without its scale (or a scale without its weight) is an
    error naming the first of them.
    """

    def __init__(self, dtype: torch.dtype, source: str):
        self.dtype = dtype
        self.source = source
        self._pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}

    def feed(self, name: str, t: torch.Tensor) -> Iterator[Decoded]:
        if scale_owner(name) is None and not is_quantized_weight(name, t):
            yield Decoded(name, t, DENSE)
            return
        paired = self.pair(name, t)
        if paired is not None:
            yield self._decode(*paired)

    def pair(self, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor, str, torch.Tensor] | None:
        """Hold a quantized weight or its scale until the other arrives; then ``(weight name, weight, scale name,
        scale)``. :meth:`finish` names what never found its partner."""
        owner = scale_owner(name)
        key = owner or name
        entry = self._pending.setdefault(key, {})
        entry["scale" if owner else "weight"] = (name, t)
        if len(entry) < 2:
            return None
        del self._pending[key]
        return key, entry["weight"][1], *entry["scale"]

    def finish(self) -> None:
        if not self._pending:
            return
        key, entry = next(iter(self._pending.items()))
        if "weight" in entry:
            what = f"{key}: quantized weight ({entry['weight'][1].dtype}) without its scale (.scale / .weight_scale)"
        else:
            what = f"{entry['scale'][0]}: scale without its quantized weight {key}"
        raise ValueError(f"{self.source}: {what} in the checkpoint ({len(self._pending)} unpaired)")

    def _decode(self, name: str, w: torch.Tensor, scale_name: str, s: torch.Tensor) -> Decoded:
        try:
            if w.dtype == torch.float8_e4m3fn:
                return Decoded(name, dequantize_block_fp8(w, s, dtype=self.dtype, name=name), FP8_BLOCK)
            if w.dtype in _PACKED:
                if s.dtype not in _E8M0:
                    raise ValueError(
                        f"{scale_name}: an FP4 scale must be raw E8M0 bytes (uint8 / float8_e8m0fnu), got {s.dtype}"
                    )
                stored = FP4_OFFICIAL if w.dtype == torch.int8 else MXFP4
                values = mxfp4.dequantize(w.view(torch.uint8), s.view(torch.uint8), dtype=self.dtype)
                return Decoded(name, values, stored)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise ValueError(f"{self.source}: {msg if msg.startswith(name) else f'{name}: {msg}'}") from None
        raise ValueError(
            f"{self.source}: {scale_name}: a scale came with a {w.dtype} weight; expected FP8 "
            "(float8_e4m3fn) or packed FP4 (uint8 / int8)"
        )
