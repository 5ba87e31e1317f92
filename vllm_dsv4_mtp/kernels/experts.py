"""The portable routed experts of a DeepSeek-V4 MoE layer: BF16 (:class:`DenseExperts`) or OCP MXFP4
(:class:`Mxfp4Experts`).

The portable MXFP4 method decodes the packed weights exactly (``vllm_dsv4_mtp.formats.mxfp4.dequantize``)
and reproduces the W4A4 activation rounding of the Quark scheme (dynamic MXFP4 on the input of each GEMM,
``fake_quant``), in the activation dtype. The routing weight multiplies the expert output after ``w2`` (as
vLLM's ``FusedMoE`` does), so ``w2``'s input is quantized without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4_mtp.formats import mxfp4

PORTABLE_MXFP4 = "portable_mxfp4"
PORTABLE_BF16 = "portable_bf16"


def select_experts_impl(expert_format: str) -> str:
    """The routed-expert implementation for ``expert_format`` ("bf16" | "mxfp4")."""
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"unknown routed-expert format {expert_format!r}; expected 'bf16' or 'mxfp4'")
    return PORTABLE_MXFP4 if expert_format == "mxfp4" else PORTABLE_BF16


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``; ``limit <= 0`` disables the clamp."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _as_e8m0_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Raw E8M0 bytes of a stored scale (uint8 or float8_e8m0fnu): a view, never a numeric cast."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
        return t.view(torch.uint8)
    raise ValueError(f"{name}: MXFP4 scale must be uint8 or float8_e8m0fnu (raw E8M0 bytes), got {t.dtype}")


def _as_packed_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Packed E2M1 bytes (Quark uint8, official int8) as uint8, bit for bit."""
    if t.dtype in (torch.uint8, torch.int8):
        return t.view(torch.uint8)
    raise ValueError(f"{name}: packed MXFP4 weight must be uint8/int8, got {t.dtype}")


class _ExpertsBase(nn.Module):
    """Shared shapes, TP split and per-expert weight loading (native ``experts.E.w{1,2,3}``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float,
                 tp_rank: int, tp_size: int):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} not divisible by TP size {tp_size}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_intermediate = intermediate_size // tp_size
        self.tp_rank = tp_rank
        self.swiglu_limit = swiglu_limit

    def _rows(self, shard: str) -> slice:
        """Rows of this rank's part of ``w1``/``w3`` (or columns of ``w2``) in the full intermediate dim."""
        start = self.tp_rank * self.local_intermediate
        return slice(start, start + self.local_intermediate)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]``, ``weights: [T, k]`` float32, ``ids: [T, k]`` -> ``[T, D]`` (this rank's partial sum)."""
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.expert(e, x[token])
            out.index_add_(0, token, (y.float() * weights[token, slot].unsqueeze(-1)).to(x.dtype))
        return out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class DenseExperts(_ExpertsBase):
    """BF16 (or float32) experts: ``w13_weight [E, 2 I_local, D]``, ``w2_weight [E, D, I_local]``."""

    def __init__(self, num_experts, hidden_size, intermediate_size, swiglu_limit, tp_rank=0, tp_size=1,
                 dtype: torch.dtype | None = None):
        super().__init__(num_experts, hidden_size, intermediate_size, swiglu_limit, tp_rank, tp_size)
        dtype = dtype or torch.get_default_dtype()
        i = self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i, dtype=dtype), requires_grad=False)

    def load(self, name: str, e: int, shard: str, part: str, t: torch.Tensor) -> None:
        """Load native ``experts.{e}.{shard}.{part}`` (part ``weight``) into this rank's slice."""
        if part != "weight":
            raise ValueError(f"{name}: BF16 experts have no '{part}' tensor (is the checkpoint quantized?)")
        full = (self.intermediate_size, self.hidden_size) if shard != "w2" else (self.hidden_size, self.intermediate_size)
        if tuple(t.shape) != full:
            raise ValueError(f"{name}: expected shape {full}, got {tuple(t.shape)}")
        if t.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"{name}: stored as {t.dtype} but this model was built for BF16 experts")
        rows = self._rows(shard)
        i = self.local_intermediate
        if shard == "w1":
            self.w13_weight.data[e, :i].copy_(t[rows])
        elif shard == "w3":
            self.w13_weight.data[e, i:].copy_(t[rows])
        else:
            self.w2_weight.data[e].copy_(t[:, rows])

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13_weight[e]).chunk(2, dim=-1)
        return F.linear(swiglu_clamped(gate, up, self.swiglu_limit), self.w2_weight[e])


class Mxfp4Experts(_ExpertsBase):
    """OCP MXFP4 experts, W4A4 emulated: packed ``w13_weight [E, 2 I_local, D/2]`` uint8 +
    ``w13_weight_scale [E, 2 I_local, D/32]`` uint8 E8M0, ``w2_weight [E, D, I_local/2]`` +
    ``w2_weight_scale [E, D, I_local/32]``.

    ``activation_quant=False`` gives weight-only rounding (W4A16), used to compare against a model run on the
    dequantized weights exactly.
    """

    def __init__(self, num_experts, hidden_size, intermediate_size, swiglu_limit, tp_rank=0, tp_size=1,
                 activation_quant: bool = True):
        super().__init__(num_experts, hidden_size, intermediate_size, swiglu_limit, tp_rank, tp_size)
        g = mxfp4.BLOCK_SIZE
        i = self.local_intermediate
        if hidden_size % g or i % g:
            raise ValueError(f"MXFP4 experts need hidden_size ({hidden_size}) and the per-rank intermediate size "
                             f"({i}) to be multiples of {g}")
        u8 = torch.uint8
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size // 2, dtype=u8), requires_grad=False)
        self.w13_weight_scale = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size // g, dtype=u8),
                                             requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i // 2, dtype=u8), requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.empty(num_experts, hidden_size, i // g, dtype=u8),
                                            requires_grad=False)
        self.activation_quant = activation_quant

    def load(self, name: str, e: int, shard: str, part: str, t: torch.Tensor) -> None:
        """Load native ``experts.{e}.{shard}.weight`` (packed) or ``.weight_scale`` / ``.scale`` (E8M0)."""
        g = mxfp4.BLOCK_SIZE
        if part == "weight":
            t = _as_packed_bytes(t, name)
            div = 2
        elif part in ("weight_scale", "scale"):
            t = _as_e8m0_bytes(t, name)
            div = g
        else:
            raise ValueError(f"{name}: unexpected MXFP4 expert tensor '{part}'")
        full = (self.intermediate_size, self.hidden_size // div) if shard != "w2" else (
            self.hidden_size, self.intermediate_size // div)
        if tuple(t.shape) != full:
            raise ValueError(f"{name}: expected shape {full}, got {tuple(t.shape)}")
        rows = self._rows(shard)
        i = self.local_intermediate
        w13 = self.w13_weight if part == "weight" else self.w13_weight_scale
        w2 = self.w2_weight if part == "weight" else self.w2_weight_scale
        if shard == "w1":
            w13.data[e, :i].copy_(t[rows])
        elif shard == "w3":
            w13.data[e, i:].copy_(t[rows])
        else:
            cols = slice(rows.start // div, rows.stop // div)
            w2.data[e].copy_(t[:, cols])

    def dequantized(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact decode of expert ``e``: ``(w13 [2 I_local, D], w2 [D, I_local])`` in ``dtype``."""
        w13 = mxfp4.dequantize(self.w13_weight[e], self.w13_weight_scale[e], dtype=torch.float32)
        w2 = mxfp4.dequantize(self.w2_weight[e], self.w2_weight_scale[e], dtype=torch.float32)
        return w13.to(dtype), w2.to(dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.dequantized(e, x.dtype)
        if self.activation_quant:
            x = mxfp4.fake_quant(x)
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        h = swiglu_clamped(gate, up, self.swiglu_limit)
        if self.activation_quant:
            h = mxfp4.fake_quant(h)
        return F.linear(h, w2)


def make_routed_experts(impl: str, *, num_experts: int, hidden_size: int, intermediate_size: int,
                        swiglu_limit: float, tp_rank: int, tp_size: int, activation_quant: bool = True) -> nn.Module:
    """Build the routed experts for an implementation chosen by :func:`select_experts_impl`."""
    common = dict(num_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  swiglu_limit=swiglu_limit, tp_rank=tp_rank, tp_size=tp_size)
    if impl == PORTABLE_MXFP4:
        return Mxfp4Experts(**common, activation_quant=activation_quant)
    if impl == PORTABLE_BF16:
        return DenseExperts(**common)
    raise ValueError(f"unknown routed-expert implementation {impl!r}")
