"""vLLM's CPU GEMM dispatch for the model's matrices that are not vLLM linear layers (expert and group slices).

vLLM's own linears on CPU go through ``dispatch_cpu_unquantized_gemm`` once loaded: a prepacked AMX kernel
where the CPU has one, else oneDNN or torch. The routed experts (``[E, N, K]``) and the grouped ``wo_a``
(``[G, N, K]``) are batched parameters, whose batched bf16 matmuls cost 40-70 us a call on the CPUs measured
against about 10 us for one packed slice; :func:`pack_weights` gives their modules one dispatched linear per
slice after loading (a float32 model's down projections get float64 linears instead: ``model/split_sums.py``).
Packing keeps the parameters (the packed copies add their bytes once more on CPU; the routed experts'
all-expert pass, where a model takes it, one more packed copy of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Linear = Callable[[torch.Tensor], torch.Tensor]


def cpu_linear(weight: torch.Tensor) -> Linear:
    """``x -> x @ weight.T`` for ``weight: [N, K]`` on CPU, through vLLM's CPU GEMM dispatch.

    The dispatch drops its reference to ``weight`` when it packed a copy (its torch fallback keeps it), so a
    ``weight`` made only for this linear (a concatenation) is freed, and a parameter's slice stays its module's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = nn.Module()
    holder.weight = nn.Parameter(weight, requires_grad=False)
    del weight
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    return lambda x: holder.cpu_linear(x, holder.weight, None)


def plain_linears(weight: torch.Tensor) -> list[Linear]:
    """One ``F.linear`` per slice ``weight[i]: [N, K]`` of ``weight: [S, N, K]`` (before packing, off CPU)."""
    return [lambda x, w=w: F.linear(x, w) for w in weight]


def dispatched_linear(weight: torch.Tensor) -> Linear:
    """One linear of ``weight: [N, K]`` (made contiguous): dispatched on CPU, else ``F.linear``."""
    weight = weight.contiguous()
    return cpu_linear(weight) if weight.device.type == "cpu" else (lambda x: F.linear(x, weight))


def slice_linears(weight: torch.Tensor) -> list[Linear]:
    """One :func:`dispatched_linear` per slice ``weight[i]: [N, K]`` of ``weight: [S, N, K]``."""
    return [dispatched_linear(w) for w in weight.data]


def pack_weights(model: nn.Module) -> None:
    """Call ``pack()`` on every module of ``model`` that has one (once its weights are loaded)."""
    for m in model.modules():
        pack = getattr(m, "pack", None)
        if callable(pack) and m is not model:
            pack()
