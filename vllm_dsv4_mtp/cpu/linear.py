"""The portable model's CPU GEMMs: vLLM's dispatch for its own matrices, and a float32 route for 16-bit weights.

vLLM's own linears on CPU go through ``dispatch_cpu_unquantized_gemm`` once loaded: a prepacked AMX kernel
where the CPU has one, else oneDNN or torch. The routed experts (``[E, N, K]``) and the grouped ``wo_a``
(``[G, N, K]``) are batched parameters, whose batched bf16 matmuls cost several times what a call on one packed
slice costs (docs/benchmarks.md); :func:`pack_weights` gives their modules one dispatched linear per
slice after loading (a float32 model's down projections get float64 linears instead: ``model/split_sums.py``).
Packing keeps the parameters (the packed copies add their bytes once more on CPU; the routed experts'
all-expert pass, where a model takes it, one more packed copy of them).

On a CPU without a 16-bit dot-product instruction (x86 without AVX512-BF16 or AMX, e.g. an AVX2-only EPYC) vLLM's
dispatch cannot build its oneDNN bf16 matmul and falls back to torch's bf16 ``F.linear``, an order of magnitude
slower there than a float32 GEMM of the same values (docs/benchmarks.md). There :func:`cpu_linear` keeps a float32
copy of a 16-bit weight and computes ``x.float() @ w32.T`` (torch's float32 ``F.linear``) rounded once to the
activation dtype, which is what a bf16 GEMM with float32 accumulation computes, up to the order of its sums (an
element in ~10,000 differs by one bf16 ulp); the copy takes twice the weight's bytes. The model's vLLM linear layers
(the attention projections, the compressor, the indexer, the shared expert, the MTP layer's ``e_proj`` / ``h_proj``)
take the same route through :data:`LINEARS`, the ``quant_config`` they are built with: it gives them
:class:`Float32RouteLinearMethod`, which is vLLM's ``UnquantizedLinearMethod`` (its weight loaders included)
wherever the route does not apply. On such a CPU the verify window's 3 rows a request had made a batch-64 K=2 step
cost several MTP-off steps (``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import (
    LinearBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.platforms import current_platform

from vllm_dsv4_mtp.cpu.kit import HALF_DTYPES, KIT
from vllm_dsv4_mtp.portable_quant_config import PortableConfigBase

Linear = Callable[[torch.Tensor], torch.Tensor]


def float32_route(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is multiplied through a float32 copy: a 16-bit CPU tensor on a CPU without
    :meth:`CpuKit.native_gemm <vllm_dsv4_mtp.cpu.kit.CpuKit.native_gemm>` for its dtype."""
    return weight.device.type == "cpu" and weight.dtype in HALF_DTYPES and not KIT.native_gemm(weight.dtype)


def cpu_linear(weight: torch.Tensor) -> Linear:
    """``x -> x @ weight.T`` for ``weight: [N, K]`` on CPU, through vLLM's CPU GEMM dispatch; a 16-bit ``weight``
    on a CPU without a native 16-bit GEMM (``KIT.native_gemm``) through a float32 copy instead (module docstring),
    the result in ``weight.dtype``.

    The dispatch drops its reference to ``weight`` when it packed a copy (its torch fallback keeps it), so a
    ``weight`` made only for this linear (a concatenation) is freed, and a parameter's slice stays its module's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    if float32_route(weight):
        # torch's float32 F.linear, not vLLM's float32 dispatch: its oneDNN handle costs more a call at 1-16 rows
        # on an AVX2 EPYC, the same at 64+ rows (docs/benchmarks.md)
        dtype, wide = weight.dtype, weight.float()
        return lambda x: F.linear(x.float(), wide).to(dtype)

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


@register_weight_loader_v2_supported_method  # vLLM picks its linears' loader by the method's class name
class Float32RouteLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear method, except that a weight that takes :func:`float32_route` is multiplied
    through a float32 copy, ``layer.float32_weight``, made after loading. ``layer.weight`` is then emptied, as
    vLLM's own dispatch empties it when it packs a copy: the copy costs twice the 16-bit bytes, not three times.
    A layer marked by :func:`keep_loaded_weight` keeps its weight beside the copy. vLLM's in-place reload
    (``reload_weights``) restores the layer's weight from its recorded shape, loads it and processes the layer
    again, so the copy is made anew from the new weights (``tests/test_weight_reload.py``)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        keep = getattr(layer, "keeps_loaded_weight", False)
        if not keep and getattr(layer, "float32_weight", None) is not None and layer.weight.numel() == 0:
            return  # processed already: the copy stays (a second copy would be of the emptied weight)
        if float32_route(layer.weight):
            w = layer.weight
            layer.float32_weight = w.detach().float()
            if not keep:
                layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
        elif keep and current_platform.is_cpu():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)  # vLLM's packed copy beside the weight
        else:
            super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [..., K]`` -> ``[..., N]``; on the route the float32 product rounded once to ``x.dtype``."""
        wide = getattr(layer, "float32_weight", None)
        if wide is None:
            return super().apply(layer, x, bias)
        return F.linear(x.float(), wide, None if bias is None else bias.float()).to(x.dtype)


def keep_loaded_weight(layer: LinearBase) -> LinearBase:
    """Mark one of the model's vLLM linears (built with :data:`LINEARS`) whose weight a pack of the model reads
    after loading (a shared expert that joins the routed experts' pass; a float32 model's float64 copies,
    ``model/split_sums.py``): its method processes it as any other (vLLM's packed copy, or the float32 route's)
    but leaves the loaded weight in place, at the cost of its bytes once more. vLLM's in-place reload
    (``reload_weights``) processes each layer as soon as its tensors are in, before the model's ``load_weights``
    packs, and a weight packed away would leave that pack nothing to read. Returns ``layer``."""
    layer.keeps_loaded_weight = True
    return layer


def loaded_weight(layer: LinearBase) -> torch.Tensor:
    """The weight ``[N, K]`` of one of the model's vLLM linears as loaded, for a pack that reads it; the layer
    must be marked by :func:`keep_loaded_weight`, and an unmarked one is an error naming it by its ``prefix``
    (its weight may be packed away once vLLM has processed it)."""
    if not getattr(layer, "keeps_loaded_weight", False):
        raise RuntimeError(
            f"{layer.prefix}: a pack reads this layer's loaded weight, which vLLM's CPU dispatch "
            "may pack away after loading: build the layer with keep_loaded_weight"
        )
    if layer.weight.numel() == 0:
        raise RuntimeError(
            f"{layer.prefix}: marked to keep its loaded weight, but the weight is empty (something "
            "other than this layer's method processed it)"
        )
    return layer.weight.data


class PortableLinearConfig(PortableConfigBase):
    """Not a quantization: how the portable model hands its vLLM linear layers :class:`Float32RouteLinearMethod`
    (a ``quant_config`` is the one argument vLLM's linears take their method from). Not registered: no
    checkpoint names it; the model passes :data:`LINEARS` itself."""

    def get_name(self) -> str:
        return "dsv4_mtp_linears"

    @classmethod
    def from_config(cls, config: dict) -> PortableLinearConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Float32RouteLinearMethod | None:
        return Float32RouteLinearMethod() if isinstance(layer, LinearBase) else None


LINEARS = PortableLinearConfig()
