"""The portable model's CPU GEMMs, and the one stage after loading that prepares them (:func:`prepare_weights`).

vLLM's own linears on CPU go through ``dispatch_cpu_unquantized_gemm`` once loaded: a prepacked AMX kernel
where the CPU has one, else oneDNN or torch. The routed experts (``[E, N, K]``) and the grouped ``wo_a``
(``[G, N, K]``) are batched parameters, whose batched bf16 matmuls cost several times what a call on one packed
slice costs (docs/benchmarks.md); their modules' ``pack()`` gives them one dispatched linear per slice
(a float32 model's down projections get float64 linears instead: ``model/split_sums.py``).

On a CPU without a 16-bit dot-product instruction (x86 without AVX512-BF16 or AMX, e.g. an AVX2-only EPYC) vLLM's
dispatch cannot build its oneDNN bf16 matmul and falls back to torch's bf16 ``F.linear``, an order of magnitude
slower there than a float32 GEMM of the same values (docs/benchmarks.md). There :func:`cpu_linear` keeps a float32
copy of a 16-bit weight and computes ``x.float() @ w32.T`` (torch's float32 ``F.linear``) rounded once to the
activation dtype, which is what a bf16 GEMM with float32 accumulation computes, up to the order of its sums (an
element in ~10,000 differs by one bf16 ulp). On such a CPU the verify window's 3 rows a request had made a batch-64
K=2 step cost several MTP-off steps (``docs/benchmarks.md``).

The model's vLLM linear layers (the attention projections, the compressor, the indexer, the shared expert, the MTP
layer's ``e_proj`` / ``h_proj``) are vLLM's classes with vLLM's weight loaders; :func:`prepared_linear` only moves
their CPU post-load processing into :func:`prepare_weights`, which gives every prepared GEMM and pack its place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.platforms import current_platform

from vllm_dsv4_mtp.cpu.kit import HALF_DTYPES, KIT

Linear = Callable[[torch.Tensor], torch.Tensor]
logger = init_logger("vllm.dsv4_mtp.cpu_kit")


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
        return float32_linear(weight.float(), weight.dtype)

    holder = nn.Module()
    holder.weight = nn.Parameter(weight, requires_grad=False)
    del weight
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    return lambda x: holder.cpu_linear(x, holder.weight, None)


def float32_linear(wide: torch.Tensor, dtype: torch.dtype) -> Linear:
    """``x -> (x.float() @ wide.T).to(dtype)`` for the float32 copy ``wide: [N, K]`` of a ``dtype`` weight."""
    return lambda x: F.linear(x.float(), wide).to(dtype)


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


class PreparedGemmMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear method (its weights and weight loaders), with its CPU post-load processing left
    to :func:`prepare_weights`: the weight stays as loaded (vLLM's own CPU method packs it away), and the layer
    computes through the GEMM the stage made for it, ``layer.gemm``. Off CPU it is vLLM's method unchanged."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not current_platform.is_cpu():
            super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [..., K]`` -> ``[..., N]``."""
        if not current_platform.is_cpu():
            return super().apply(layer, x, bias)
        gemm = getattr(layer, "gemm", None)
        if gemm is None:
            raise RuntimeError(f"{layer.prefix}: no GEMM prepared; prepare_weights(model) runs after loading")
        out = gemm(x)
        return out if bias is None else out + bias


def prepared_linear(layer: LinearBase) -> LinearBase:
    """One of the model's vLLM linears (built with ``quant_config=None``), its post-load processing moved to
    :func:`prepare_weights` (:class:`PreparedGemmMethod`). The method replaces vLLM's unquantized one after
    construction: the two create the same weights, and vLLM chose the weight loaders by the first. Returns
    ``layer``."""
    if type(layer.quant_method) is not UnquantizedLinearMethod:
        raise TypeError(f"{layer.prefix}: {type(layer.quant_method).__name__}, expected vLLM's unquantized method")
    layer.quant_method = PreparedGemmMethod()
    return layer


def prepare_weights(model: nn.Module) -> None:
    """The one stage after loading that turns the loaded weights into what the model computes with:

    * on CPU, the kit answers what the model asks (``model.kit_questions``: :meth:`CpuKit.report
      <vllm_dsv4_mtp.cpu.kit.CpuKit.report>`, one log line per process);
    * every linear of :func:`prepared_linear` gets its GEMM (:func:`prepare_linears`);
    * every module with a ``pack()`` packs (the routed experts' slices and all-expert pass, ``wo_a``'s groups,
      a float32 model's float64 copies of the sums TP splits: ``model/split_sums.py``).

    Loaded weights are never changed or dropped (the prepared copies add their bytes once more: a 16-bit weight's
    float32 copy twice its bytes), so the stage may read any of them, in any order, and can run again. The model
    runs it once per load: from vLLM's model-level post-load hook (``process_weights_after_loading``) after a
    first load (the dummy one too), and at the end of its ``load_weights`` on vLLM's in-place ``reload_weights``,
    which calls no hook and processes each layer as its tensors arrive (the layers' tensors must keep the shapes
    they had: it copies the new values into them). A kernel-format reload calls neither: :func:`ensure_prepared`."""
    if current_platform.is_cpu() and hasattr(model, "kit_questions"):
        KIT.report(**model.kit_questions)
    prepare_linears(model)
    packers = [m for m in model.modules() if m is not model and callable(getattr(m, "pack", None))]
    for m in packers:
        m.pack()
    # what the stage read, with torch's count of in-place writes to each (ensure_prepared)
    read = [m.weight for m in _prepared_linears(model)] + [p for m in packers for p in m.parameters(recurse=False)]
    model.prepared_from = [(p, p._version) for p in read]


def _prepared_linears(model: nn.Module) -> list[LinearBase]:
    """The linears of :func:`prepared_linear` in ``model``."""
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), PreparedGemmMethod)]


def ensure_prepared(model: nn.Module) -> None:
    """Before a forward: :func:`prepare_weights` again, with one warning, where a weight it read was written in
    place since (torch counts each in-place write). vLLM's ``reload_weights(is_checkpoint_format=False)`` copies the
    new tensors straight into the parameters and calls nothing of the model; without this the prepared GEMMs and
    packs would go on computing with the old weights."""
    if any(p._version != v for p, v in getattr(model, "prepared_from", ())):
        logger.warning(
            "vllm-dsv4-mtp: %s: weights written in place since they were prepared (a kernel-format "
            "reload_weights); preparing them again",
            type(model).__name__,
        )
        prepare_weights(model)


def prepare_linears(model: nn.Module) -> None:
    """Each linear of :func:`prepared_linear` in ``model`` gets its GEMM on CPU, ``layer.gemm``
    (:func:`cpu_linear`: vLLM's CPU dispatch, or the float32 route, whose copy is ``layer.float32_weight``)."""
    if not current_platform.is_cpu():
        return
    for m in _prepared_linears(model):
        w = m.weight.data
        if w.is_meta:
            raise RuntimeError(f"{m.prefix}: its weight was never loaded (still on the meta device)")
        m.float32_weight = w.float() if float32_route(w) else None
        m.gemm = cpu_linear(w) if m.float32_weight is None else float32_linear(m.float32_weight, w.dtype)


# wo_a as one block-diagonal linear while that matrix has at most this many elements (the embedded model's:
# 2 x 64 x 2 x 256: one call instead of one per group and a concatenation, faster on CPU: docs/benchmarks.md);
# DeepSeek-V4's own groups stay one call each
BLOCK_DIAGONAL_MAX = 1 << 20


def grouped_linears(w: torch.Tensor) -> list[Linear]:
    """Linears of a block-diagonal weight ``w [G, n, k]``: one per group or, while the whole matrix is small
    (``BLOCK_DIAGONAL_MAX``), one over all groups (the zero blocks add exact zeros)."""
    g, n, k = w.shape
    if g > 1 and g * n * g * k <= BLOCK_DIAGONAL_MAX:
        return [dispatched_linear(torch.block_diag(*w.data))]
    return slice_linears(w)


class GroupedLinear(nn.Module):
    """Block-diagonal ``wo_a``: group ``g`` maps its ``(H/G) d`` inputs to ``o_lora`` outputs. ``weight:
    [G_local * o_lora, (H/G) d]`` (this rank's groups' rows), a plain parameter: the kit runs the groups."""

    def __init__(self, in_per_group: int, out_per_group: int, n_groups: int, n_local_groups: int):
        super().__init__()
        self.out_per_group = out_per_group
        self.n_groups = n_groups
        self.n_local_groups = n_local_groups
        self.weight = nn.Parameter(torch.empty(n_local_groups * out_per_group, in_per_group), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self._linears: list[Linear] | None = None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Native ``wo_a [G * o_lora, (H/G) d]`` -> this rank's groups' rows."""
        full = (self.n_groups * self.out_per_group, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"wo_a: expected shape {full}, got {tuple(loaded.shape)}")
        rows = param.shape[0]
        start = get_tensor_model_parallel_rank() * rows
        param.data.copy_(loaded[start : start + rows])

    def _grouped_weight(self) -> torch.Tensor:
        return self.weight.view(self.n_local_groups, self.out_per_group, -1)

    def pack(self) -> None:
        """After loading: the groups' linears as the kit runs them (:func:`grouped_linears`)."""
        self._linears = grouped_linears(self._grouped_weight())

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """``o: [T, G_local, (H/G) d]`` -> ``[T, G_local * o_lora]`` (groups side by side)."""
        linears = self._linears if self._linears is not None else plain_linears(self._grouped_weight())
        if len(linears) == 1:
            return linears[0](o.reshape(o.shape[0], -1))
        return torch.cat([lin(o[:, g]) for g, lin in enumerate(linears)], dim=-1)
