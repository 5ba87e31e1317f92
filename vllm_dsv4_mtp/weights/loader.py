"""The one checkpoint loader: native DeepSeek-V4 tensors into a target or a draft, strictly.

Every tensor of the model's part of the checkpoint (``scope``: the main model, or the ``mtp.*`` layer) is
loaded or refused with an error naming the checkpoint and the tensor:

1. quantized tensors are paired with their scales and decoded exactly to the model dtype
   (:mod:`vllm_dsv4_mtp.formats.dequant`); ``admit`` may refuse them first (the draft's precision policy);
2. each tensor is checked against the native layout of the config (:func:`vllm_dsv4_mtp.config.weight_slots`):
   known name, logical shape, a storage precision the slot allows, integer ids in range, finite values;
3. :mod:`vllm_dsv4_mtp.weights.names` says which parameter receives it; the parameter's own vLLM
   ``weight_loader`` (tensor-parallel slicing, stacked shards, fused experts) stores it;
4. at the end, a tensor the layout expects but the checkpoint lacks, or a parameter nothing filled, is an error.

Under expert parallelism a rank holds only some routed experts. vLLM's ``enable_ep_weight_filter`` then drops the
other ranks' expert weights before the loader sees them (their scales still arrive), so those experts' tensors
are skipped when they come and not expected when they do not (:func:`expert_owner`); the rank that holds an
expert checks it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dsv4_mtp.config import DeepseekV4Spec, WeightSlot, weight_slots
from vllm_dsv4_mtp.formats.dequant import (
    DENSE,
    FP8_BLOCK,
    MXFP4,
    Decoded,
    Dequantizer,
    is_quantized_weight,
    scale_owner,
)
from vllm_dsv4_mtp.formats.finite import has_nonfinite, stored_nonfinite
from vllm_dsv4_mtp.weights.names import ParamRef

logger = init_logger("vllm.dsv4_mtp.weights")

TARGET = "target"
DRAFT = "draft"
_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
}

# (native name, tensor) -> None, or raises: the draft's precision policy, asked before a quantized tensor is kept
Admit = Callable[[str, torch.Tensor], None]
# a routed expert's weight or scale: layers.N.ffn.experts.E.* / mtp.i.ffn.experts.E.*
_ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def expert_owner(model: nn.Module) -> Callable[[int], bool] | None:
    """``expert id -> held by this rank`` where expert parallelism splits the routed experts, else None.

    Read from the model's expert modules: the portable ``PortableExperts`` (``first_expert`` / ``local_experts``)
    or vLLM's routed experts (their ``expert_map_manager.is_local_expert``, vLLM 0.32-0.34). With EPLB
    vLLM may place any expert on any rank, so every expert is loaded everywhere (None)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and config.parallel_config.enable_eplb:
        return None
    for m in model.modules():
        if hasattr(m, "first_expert") and hasattr(m, "local_experts") and hasattr(m, "num_experts"):
            if m.local_experts < m.num_experts:
                first, n = m.first_expert, m.local_experts
                return lambda e: first <= e < first + n
            return None
        manager = getattr(m, "expert_map_manager", None)
        if manager is not None:
            if not manager.use_ep:
                return None
            return lambda e, manager=manager: bool(manager.is_local_expert(e))
    return None


class CheckpointLoader:
    """One pass over a checkpoint's ``(name, tensor)`` stream into ``model``'s parameters.

    Args:
        model: the module whose ``named_parameters()`` the mapped names refer to.
        spec: the validated config. ``scope``: ``TARGET`` (everything but ``mtp.*``) or ``DRAFT`` (``mtp.*``).
        dtype: the model's activation dtype, which quantized tensors are decoded to.
        param_for: native name -> :class:`ParamRef` (KeyError for a name outside the layout).
        source: the checkpoint path, prefixed to every error.
        admit: called with every quantized weight and scale before it is used.
        not_from_checkpoint: parameter names filled by someone else (the draft's shared embedding and head).
        owns_expert: routed expert id -> held by this rank (default: :func:`expert_owner` of ``model``).
        stored: quantized tensors go into the quant method's parameters as stored (``VLLM_DSV4_MTP_DRAFT_PRECISION
            =stored``), each checked against its parameter, instead of being decoded (:meth:`_place_stored`).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: DeepseekV4Spec,
        *,
        scope: str,
        dtype: torch.dtype,
        param_for: Callable[[str], ParamRef],
        source: str,
        admit: Admit | None = None,
        not_from_checkpoint: Iterable[str] = (),
        owns_expert: Callable[[int], bool] | None = None,
        stored: bool = False,
    ):
        self.spec = spec
        self.scope = scope
        self.param_for = param_for
        self.source = source
        self.admit = admit
        self.params = dict(model.named_parameters())
        self.not_from_checkpoint = set(not_from_checkpoint)
        self.dequantizer = Dequantizer(dtype, source)
        self.slots = {n: s for n, s in weight_slots(spec, mtp=True).items() if s.is_mtp == (scope == DRAFT)}
        self.seen: set[str] = set()
        self.loaded: set[str] = set()
        self.skipped = 0
        self.owns_expert = owns_expert if owns_expert is not None else expert_owner(model)
        self.other_ranks = 0  # routed-expert tensors of experts another expert-parallel rank holds
        self.decoded: dict[str, int] = {}
        self.stored = stored
        self.kept: dict[str, int] = {}  # quantized weights loaded as stored, by scheme

    # --------------------------------------------------------------------------------------------- stream
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            if name.startswith("mtp.") != (self.scope == DRAFT):
                self.skipped += 1  # the other model's tensors (the draft shares embed / head with the target)
                continue
            if not self._held_here(name):
                self.other_ranks += 1
                continue
            quantized = bool(scale_owner(name)) or is_quantized_weight(name, t)
            if self.admit is not None and quantized:
                self.admit(name, t)
            if self.stored and quantized:
                paired = self.dequantizer.pair(name, t)
                if paired is not None:
                    weight, w, scale_name, scale = paired
                    self._place_stored(weight, w)
                    self._place_stored(scale_name, scale)
                continue
            for d in self.dequantizer.feed(name, t):
                self._place(d)
        self.dequantizer.finish()  # a quantized weight or scale without its partner, on either path
        self._check_complete()
        return self.loaded | self.not_from_checkpoint

    def _held_here(self, name: str) -> bool:
        """False for a routed expert's tensor (weight or scale) that another expert-parallel rank holds."""
        if self.owns_expert is None:
            return True
        m = _ROUTED_EXPERT.search(name)
        return m is None or self.owns_expert(int(m[1]))

    def _err(self, msg: str) -> ValueError:
        return ValueError(f"{self.source}: {msg}")

    def _place(self, d: Decoded) -> None:
        try:
            ref = self.param_for(d.name)
        except KeyError as e:  # a name outside the layout: the map says why (layer index, prefix)
            raise self._err(str(e.args[0])) from None
        slot = self.slots.get(d.name)
        if slot is None:
            raise self._err(
                f"{d.name}: unexpected tensor for this config (no such tensor in the DeepSeek-V4 "
                f"{'MTP ' if self.scope == DRAFT else ''}layout of config.json)"
            )
        t = self._checked(slot, d)
        param = self.params.get(ref.param)
        if param is None:
            raise self._err(f"{d.name}: maps to {ref.param}, which this model does not have")
        if self.stored and param.dtype not in _DENSE_PARAMS:
            raise self._err(
                f"{d.name}: stored {d.tensor.dtype}, but the draft's {ref.param} is {param.dtype}: "
                "quantization_config declares this MTP module quantized"
            )
        _store(param, ref, t.to(param.dtype) if t.is_floating_point() else t, d.name)
        self.seen.add(d.name)
        self.loaded.add(ref.param)
        if d.stored != DENSE:
            self.decoded[d.stored] = self.decoded.get(d.stored, 0) + 1

    def _place_stored(self, name: str, t: torch.Tensor) -> None:
        """One quantized weight or scale into its quant-method parameter, bytes as stored (``stored``)."""
        owner = scale_owner(name)
        weight = owner or name
        try:
            ref = self.param_for(weight)
        except KeyError as e:
            raise self._err(str(e.args[0])) from None
        slot = self.slots.get(weight)
        if slot is None:
            raise self._err(f"{name}: unexpected tensor for this config (no {weight} in the DeepSeek-V4 layout)")
        pname = ref.param + "_scale" if owner else ref.param
        param = self.params.get(pname)
        if param is None or (not owner and param.dtype in _DENSE_PARAMS):
            raise self._err(
                f"{name}: stored quantized ({t.dtype}), but the draft's {ref.param.rsplit('.', 1)[0]} was built "
                "unquantized: quantization_config excludes this MTP module or gives it no scheme"
            )
        t = _as_stored(self._err, name, t, param, slot.shape, bool(owner))
        _store(param, ParamRef(pname, ref.kind, ref.shard, ref.expert), t, name)
        self.loaded.add(pname)
        if not owner:
            self.seen.add(weight)
            kind = FP8_BLOCK if t.dtype == torch.float8_e4m3fn else MXFP4
            self.kept[kind] = self.kept.get(kind, 0) + 1

    def _checked(self, slot: WeightSlot, d: Decoded) -> torch.Tensor:
        t, name = d.tensor, d.name
        if tuple(t.shape) != slot.shape:
            raise self._err(f"{name}: expected shape {slot.shape}, got {tuple(t.shape)}")
        if d.stored != DENSE and d.stored not in slot.quantizable:
            raise self._err(
                f"{name}: stored {d.stored}, which this tensor cannot be (allowed: "
                f"{', '.join(('bf16',) + slot.quantizable)})"
            )
        if name.endswith(".tid2eid"):
            if t.is_floating_point() or t.is_complex():
                raise self._err(f"{name}: expert ids must be integers, got {t.dtype}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.spec.n_routed_experts):
                raise self._err(f"{name}: expert ids must lie in [0, {self.spec.n_routed_experts})")
            return t
        if d.stored == DENSE and _SAFETENSORS_DTYPES.get(t.dtype) not in slot.dtypes:
            raise self._err(f"{name}: stored as {t.dtype}, expected {'/'.join(slot.dtypes)} (the DeepSeek-V4 layout)")
        if has_nonfinite(t):  # one reduction per tensor; the count only for the error
            bad = int((~torch.isfinite(t)).sum())
            raise self._err(f"{name}: {bad} non-finite value(s) (NaN or Inf); the checkpoint is corrupt")
        return t

    def _check_complete(self) -> None:
        missing = [n for n in self.slots if n not in self.seen and self._held_here(n)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise self._err(f"{missing[0]}: tensor missing from the checkpoint{more}")
        unfilled = sorted(set(self.params) - self.loaded - self.not_from_checkpoint)
        if unfilled:
            raise self._err(
                f"parameter {unfilled[0]} received no tensor from the checkpoint ({len(unfilled)} such parameter(s))"
            )
        decoded = ", ".join(f"{n} {k}" for k, n in sorted(self.decoded.items()))
        kept = ", ".join(f"{n} {k}" for k, n in sorted(self.kept.items()))
        elsewhere = f"; {self.other_ranks} of experts other expert-parallel ranks hold" if self.other_ranks else ""
        logger.info(
            "DeepSeek-V4 %s weights loaded from %s: %d tensors%s%s (+%d of the %s skipped%s)",
            self.scope,
            self.source,
            len(self.seen),
            f", decoded exactly at load: {decoded}" if decoded else "",
            f", quantized as stored: {kept}" if kept else "",
            self.skipped,
            "draft" if self.scope == TARGET else "target",
            elsewhere,
        )


_DENSE_PARAMS = (torch.bfloat16, torch.float32, torch.float16)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)
_ST_NAMES = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.uint8: "U8", torch.int8: "I8"}


def _as_stored(err, name: str, t: torch.Tensor, param: nn.Parameter, logical: tuple[int, ...], scale: bool):
    """``t`` checked against the quant method's parameter and the weight's logical ``[out, in]`` shape, and
    viewed as the parameter's dtype where only the name of the type differs (E8M0 bytes as ``uint8``)."""
    out, inp = logical
    if scale:
        fp8 = param.dtype != torch.uint8
        want = (-(-out // 128), -(-inp // 128)) if fp8 else (out, inp // 32)
        same = t.dtype == param.dtype or (t.dtype in _E8M0 and param.dtype in _E8M0)
    else:
        fp8 = param.dtype == torch.float8_e4m3fn
        want = (out, inp) if fp8 else (out, inp // 2)
        same = t.dtype == param.dtype
    if not same:
        raise err(
            f"{name}: stored {t.dtype}, but the draft's quant method holds it as {param.dtype} "
            f"({'FP8 block' if fp8 else 'MXFP4'} per quantization_config)"
        )
    if tuple(t.shape) != want:
        raise err(f"{name}: expected shape {want} ({'FP8 block' if fp8 else 'MXFP4'}), got {tuple(t.shape)}")
    bad = stored_nonfinite(name, _ST_NAMES.get(t.dtype, ""), t)
    if bad:
        raise err(f"{name}: {bad} (NaN codes); the checkpoint is corrupt")
    return t.view(param.dtype) if t.dtype != param.dtype else t


def _store(param: nn.Parameter, ref: ParamRef, t: torch.Tensor, name: str) -> None:
    """Hand one dense tensor to the parameter's vLLM weight loader (or do the sink's head split)."""
    loader = getattr(param, "weight_loader", None)
    if ref.kind == "expert":
        if loader is None:
            raise ValueError(f"{name}: {ref.param} is not a fused-experts parameter")
        # returns False for an expert that lives on another expert-parallel rank: nothing to store here
        loader(param, t, ref.param, shard_id=ref.shard, expert_id=ref.expert, return_success=True)
    elif ref.kind == "stacked":
        loader(param, t, ref.shard)
    elif ref.kind == "sink" and loader is None:
        # vLLM 0.32's in-tree sink is [padded local heads] with no loader: this rank's heads, the rest -inf
        n = t.shape[0] // get_tensor_model_parallel_world_size()
        start = get_tensor_model_parallel_rank() * n
        param.data[:n].copy_(t[start : start + n])
    else:
        (loader or default_weight_loader)(param, t)
