"""The sums tensor parallelism splits, in float64 for float32 models: ``wo_b`` and the MoE's down projections.

A row-parallel GEMM sums over its input features. Under tensor (or expert) parallelism each rank sums a part and the
all-reduce adds the parts: the same additions in another order than one rank's GEMM makes them. In float32 that
moves results by float32 ulps per layer, and the layers add them up (the embedded model's TP2 against TP1:
docs/benchmarks.md). For a float32 model, the dtype parity is measured in, these GEMMs therefore run in float64 on a
float64 copy of their weights; the parts are all-reduced in float64 and rounded to float32 once, after the sum, so
the order of the parts no longer shows (TP2 an order of magnitude closer to TP1). Models in other dtypes keep vLLM's
kernels and all-reduce: a BF16 part's own rounding is far coarser than the order of its additions.

Cost, float32 models only (TP1 included): these GEMMs run as plain float64 ``F.linear`` calls, and under TP each
layer's two all-reduces go through gloo. Memory: the routed experts' float64 ``w2`` copies replace their packed
float32 ones (their bytes once more); ``wo_b`` and the shared expert's ``down_proj`` keep their loaded weight and
their prepared float32 GEMM, unused, beside the float64 one (their bytes three times more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group, tensor_model_parallel_all_reduce

from vllm_dsv4_mtp.cpu.linear import Linear

WIDE = torch.float64


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a rank's part of a split sum is kept in until the all-reduce: float64 for float32, else
    ``dtype``."""
    return WIDE if dtype == torch.float32 else dtype


def wide_linear(weight: torch.Tensor) -> Linear | None:
    """``x -> x @ weight.T`` in float64 (the result stays float64) for a float32 ``weight: [N, K]``; None for
    other dtypes, whose linears keep their prepared GEMM (``cpu/linear.py``)."""
    if weight.dtype != torch.float32:
        return None
    wide = weight.detach().to(WIDE)
    return lambda x: F.linear(x.to(WIDE), wide)


def wide_layer(layer: torch.nn.Module) -> Linear | None:
    """:func:`wide_linear` of a row-parallel vLLM linear of the model (``wo_b``, the shared expert's
    ``down_proj``), from its weight as loaded: float32 layers only."""
    return wide_linear(layer.weight.data)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over the tensor-parallel group (``t`` itself on one rank). A float64 part goes through
    torch.distributed on the group's own process groups (gloo on CPU, which sums float64), not through vLLM's
    CPU communicator: that may use its shared-memory kernel, made for the model dtypes, and one of four TP2
    runs that all-reduced float64 through it stopped the engine here (its cause not traced)."""
    if get_tensor_model_parallel_world_size() == 1:
        return t
    if t.dtype != WIDE:
        return tensor_model_parallel_all_reduce(t)
    group = get_tp_group()
    torch.distributed.all_reduce(t, group=group.cpu_group if t.device.type == "cpu" else group.device_group)
    return t
