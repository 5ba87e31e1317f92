"""The routed experts of a DeepSeek-V4 MoE layer, BF16 or OCP MXFP4 (W4A4 emulated).

    expert_e(x) = w2_e act(silu(min(w1_e act(x), L)) * clamp(w3_e act(x), -L, L))      L = swiglu_limit
    y           = sum_j weights[:, j] * expert_{ids[:, j]}(x)             (a rank's part: its experts or widths)

with ``act`` the MXFP4 rounding of each GEMM's input (dynamic, groups of 32 along K: ``mxfp4.fake_quant``, through
the kit's compiled loop on CPU) where ``activation_quant`` is set (a Quark W4A4 checkpoint), else the identity.

Weights are dense in the model dtype: a checkpoint's MXFP4 / FP4 / FP8 experts are decoded once, exactly, at load
(``vllm_dsv4_mtp.formats.dequant``), which costs ``16 / 4.25 = 3.8x`` the packed bytes in BF16 (the embedded
model's 4 x 8 experts: 1.6 MB instead of 0.4 MB) and saves a decode of every hit expert at every step.

Parameters use the names and weight-loader signature of vLLM's fused experts (``w13_weight [E, 2 I, D]`` =
[w1; w3] rows, ``w2_weight [E, D, I]``; ``weight_loader(param, w, name, shard_id, expert_id)``), so the one
checkpoint loader fills them like vLLM's own. Tensor parallelism splits the intermediate dim; expert
parallelism instead gives each rank ``E / world`` whole experts. Either way a rank returns a partial sum and
the MoE all-reduces (a float32 model's in float64: ``model/split_sums.py``). The sum itself is the CPU kit's
(``cpu/experts.py``), packed after loading by :meth:`PortableExperts.pack`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4_mtp.cpu.experts import PackedExperts
from vllm_dsv4_mtp.cpu.kit import round_to_mxfp4
from vllm_dsv4_mtp.cpu.linear import Linear, dispatched_linear
from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.model.split_sums import partial_dtype, wide_linear


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``; ``limit <= 0`` disables the clamp."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _down_linear(weight: torch.Tensor) -> Linear:
    """A down projection ``weight: [D, I]`` (a sum tensor parallelism splits): dispatched, or for a float32
    model a float64 one (``model/split_sums.py``)."""
    return wide_linear(weight) or dispatched_linear(weight)


class PortableExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``intermediate_size`` on ``hidden_size`` inputs.

    Args:
        tp_rank, tp_size: this rank's place in the MoE's parallel group.
        expert_parallel: split whole experts across ranks instead of the intermediate dim.
        activation_quant: round each GEMM's input to MXFP4 (the W4A4 scheme of a Quark checkpoint).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
        activation_quant: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        split = num_experts if expert_parallel else intermediate_size
        if split % tp_size:
            what = "n_routed_experts" if expert_parallel else "moe_intermediate_size"
            raise ValueError(f"{what} {split} not divisible by the parallel size {tp_size}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_experts = num_experts // tp_size if expert_parallel else num_experts
        self.first_expert = tp_rank * self.local_experts if expert_parallel else 0
        self.local_intermediate = intermediate_size if expert_parallel else intermediate_size // tp_size
        self.tp_rank = 0 if expert_parallel else tp_rank
        self.swiglu_limit = swiglu_limit
        self.activation_quant = activation_quant
        if activation_quant and (hidden_size % mxfp4.BLOCK_SIZE or self.local_intermediate % mxfp4.BLOCK_SIZE):
            raise ValueError(
                f"W4A4 experts need hidden_size ({hidden_size}) and the per-rank intermediate size "
                f"({self.local_intermediate}) to be multiples of {mxfp4.BLOCK_SIZE}"
            )
        dtype = dtype or torch.get_default_dtype()
        e, i = self.local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._packed: PackedExperts | None = None  # set by pack()

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Store native ``experts.{expert_id}.{shard_id}.weight`` (full ``[I, D]`` / ``[D, I]``) in this rank's
        slice; returns False (with ``return_success``) for an expert held by another expert-parallel rank."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.local_experts:
            return False if return_success else None
        i = self.local_intermediate
        rows = slice(self.tp_rank * i, self.tp_rank * i + i)
        if shard_id == "w1":
            param.data[local, :i].copy_(loaded[rows])
        elif shard_id == "w3":
            param.data[local, i:].copy_(loaded[rows])
        elif shard_id == "w2":
            param.data[local].copy_(loaded[:, rows])
        else:
            raise ValueError(f"{weight_name}: unknown expert shard {shard_id!r}")
        return True if return_success else None

    def pack(self) -> None:
        """After loading (``cpu/linear.py:prepare_weights``): the experts' GEMMs as the kit computes them."""
        self._packed = PackedExperts(
            self.w13_weight.data,
            self.w2_weight.data,
            first=self.first_expert,
            num_experts=self.num_experts,
            out_dtype=partial_dtype(self.w2_weight.dtype),
            down=_down_linear,
        )

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return round_to_mxfp4(x) if self.activation_quant else x

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """``h = w13 x: [A, 2 I]`` -> the second GEMM's input ``[A, I]``: the clamped SwiGLU, then ``act``."""
        gate, up = h.chunk(2, dim=-1)
        return self._act(swiglu_clamped(gate, up, self.swiglu_limit))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]``, ``weights: [T, k]`` float32, ``ids: [T, k]`` global expert ids -> this rank's part
        ``[T, D]`` of ``sum_j weights[:, j] * expert_{ids[:, j]}(x)``, in ``partial_dtype(x.dtype)``."""
        if self._packed is None:
            raise RuntimeError("routed experts not packed; prepare_weights(model) runs after loading")
        return self._packed(self._act(x), weights, ids, self.activation)
