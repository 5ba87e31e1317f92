"""Weight bytes per GPU of a DeepSeek-V4 deployment, counted as they sit in GPU memory on each platform.

What runs, and so what is counted (:class:`Runs`):

* target, ``platform.IN_TREE`` (gfx950): vLLM's own ``DeepseekV4ForCausalLM`` keeps the checkpoint's
  quantization (AITER MoE on the MXFP4 experts, Quark / DeepSeek FP8 block linears; preshuffling in
  ``process_weights_after_loading`` keeps the sizes), so its bytes are the **stored** bytes;
* target, ``platform.PORTABLE`` (everywhere else): the plugin's model decodes every quantized weight to the
  model dtype at load (``vllm_dsv4_mtp/portable_quant_config.py``), so every tensor is **dense** in the model
  dtype, except the float32 tensors (hyper-connection mixes, sinks, router bias) and integer ``tid2eid``
  tables, which stay as they are;
* draft ``PLUGIN_DRAFT`` (both platforms): the plugin's MTP layer is BF16 by design (``draft_policy.py``
  decodes quantized MTP tensors at load), counted dense like the portable target;
* draft ``PLUGIN_STORED_DRAFT``: the plugin's draft under ``VLLM_DSV4_MTP_DRAFT_PRECISION=stored``. On gfx950
  it keeps the checkpoint's quantized weights as vLLM's own quant methods hold them, so its bytes are the
  **stored** bytes; the portable draft decodes its weights either way (only its activations are rounded),
  so there it is counted dense like ``PLUGIN_DRAFT``;
* draft ``VLLM_DRAFT``: vLLM's (or ATOM's) own MTP draft at its **stored** precision. The plugin never runs
  it; it is here to model the public measurements the runtime reserve is derived from (``reserve.py``).

Bytes come from the checkpoint itself: the safetensors headers of a local directory (actual dtypes), or,
without shards, :func:`vllm_dsv4_mtp.config.expected_tensors` for its config.json; for a published checkpoint
that is not local, its known config and storage layout (:data:`~vllm_dsv4_mtp.serve.profiles.KNOWN_CHECKPOINTS`).

Sharding follows vLLM's DeepSeek-V4 layers: routed experts are split over every GPU of the TP x DP group
(vLLM's ``FusedMoEParallelConfig`` flattens TP across DP; expert parallelism changes how they are split, not
how much each GPU holds); shared experts, ``wq_b``/``wo_a``/``wo_b`` and the vocab-parallel embedding and head
over TP; ``wq_a``, ``wkv``, compressors, indexers, router, norms and hyper-connection tensors, and the MTP
``e_proj``/``h_proj`` are replicated on every GPU of a TP group; pipeline parallelism divides the layers.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dsv4_mtp import platform
from vllm_dsv4_mtp.serve.profiles import KNOWN_CHECKPOINTS

PLUGIN_DRAFT = "plugin"
PLUGIN_STORED_DRAFT = "plugin-stored"
VLLM_DRAFT = "vllm"

TARGET_LABELS = {
    platform.IN_TREE: "vLLM's in-tree DeepseekV4ForCausalLM (AITER) at the checkpoint's stored precision",
    platform.PORTABLE: "the plugin's portable DeepseekV4ForCausalLM, every quantized weight decoded to {dtype}",
}
DRAFT_LABELS = {
    PLUGIN_DRAFT: "the plugin's BF16 MTP draft (DeepSeekV4MTPModel)",
    PLUGIN_STORED_DRAFT: "the plugin's MTP draft at the checkpoint's stored precision (DeepSeekV4MTPModel)",
    VLLM_DRAFT: "vLLM's own MTP draft at the checkpoint's stored precision",
}
_DTYPE_NAMES = {2: "bf16", 4: "fp32"}


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_ways(self) -> int:
        """GPUs the routed experts are split over (per pipeline stage): TP x DP, with or without EP."""
        return self.tp * self.dp


@dataclass(frozen=True)
class Runs:
    """What runs on the GPUs: the target implementation, the MTP draft (None: no MTP), the model dtype width."""

    target: str = platform.IN_TREE
    draft: str | None = PLUGIN_DRAFT
    dtype_bytes: int = 2

    @property
    def dtype(self) -> str:
        return _DTYPE_NAMES.get(self.dtype_bytes, f"{self.dtype_bytes}-byte")

    def target_label(self) -> str:
        return TARGET_LABELS[self.target].format(dtype=self.dtype)

    def draft_label(self) -> str:
        return "none (no speculative config)" if self.draft is None else DRAFT_LABELS[self.draft]

    @property
    def draft_stored(self) -> bool:
        """Does the draft hold the MTP layer's stored bytes (rather than every tensor decoded dense)?"""
        if self.draft == PLUGIN_STORED_DRAFT:
            return self.target == platform.IN_TREE
        return self.draft == VLLM_DRAFT


# Parts of the model, in report order: (label, name test, how it is split).
_PARTS: tuple[tuple[str, Callable[[str], bool], str], ...] = (
    ("routed experts", lambda n: ".ffn.experts." in n, "experts"),
    ("shared experts", lambda n: ".ffn.shared_experts." in n, "tp"),
    ("attention wq_b/wo_a/wo_b", lambda n: re.search(r"\.attn\.(wq_b|wo_a|wo_b)\.", n) is not None, "tp"),
    ("attention wq_a/wkv", lambda n: re.search(r"\.attn\.(wq_a|wkv)\.", n) is not None, "replicated"),
    ("compressors + indexers", lambda n: ".attn.compressor." in n or ".attn.indexer." in n, "replicated"),
    ("router", lambda n: ".ffn.gate." in n, "replicated"),
    ("embed + head", lambda n: n in ("embed.weight", "head.weight"), "tp"),
    ("e_proj/h_proj", lambda n: re.search(r"^mtp\.\d+\.[eh]_proj\.", n) is not None, "replicated"),
    ("norms, sinks, hyper-connections", lambda n: True, "replicated"),
)
PART_ORDER = tuple(label for label, _, _ in _PARTS)


def part_of(name: str) -> tuple[str, str]:
    """``(part label, split)`` of a native tensor name (weights and their scales alike)."""
    for label, test, split in _PARTS:
        if test(name):
            return label, split
    raise AssertionError("unreachable: the last part matches everything")


@dataclass
class PartBytes:
    """One part of the model: its logical parameters, its stored bytes, and what it takes decoded.

    Decoded (dense) bytes = ``dense_params`` x the model dtype width + ``fixed_bytes`` (float32 and integer
    tensors, which keep their dtype)."""

    label: str
    split: str
    precision: set[str] = field(default_factory=set)  # stored precisions of its weights
    params: int = 0
    stored_bytes: float = 0.0
    dense_params: int = 0
    fixed_bytes: float = 0.0
    fixed_precision: set[str] = field(default_factory=set)

    def nbytes(self, stored: bool, dtype_bytes: int = 2) -> float:
        return self.stored_bytes if stored else self.dense_params * dtype_bytes + self.fixed_bytes

    def precision_label(self, stored: bool, dtype_bytes: int = 2) -> str:
        if stored:
            return "+".join(sorted(self.precision))
        dense = {_DTYPE_NAMES.get(dtype_bytes, "dense")} if self.dense_params else set()
        return "+".join(sorted(dense | self.fixed_precision))

    def ways(self, par: Parallelism) -> int:
        layers = par.pp  # every part is spread over the pipeline stages (embed/head approximately)
        if self.split == "experts":
            return par.expert_ways * layers
        if self.split == "tp":
            return par.tp * layers
        return layers


@dataclass
class WeightTable:
    """Bytes of the target model by part, and of the MTP layer by part, with where they came from."""

    source: str
    target: dict[str, PartBytes]
    mtp: dict[str, PartBytes]

    def parts(self, runs: Runs) -> list[tuple[str, PartBytes, bool]]:
        """``(component, part, stored?)`` for every part that runs, target first, in report order."""
        out = [("target", p, runs.target == platform.IN_TREE) for p in _ordered(self.target)]
        if runs.draft is not None:
            out += [("draft", p, runs.draft_stored) for p in _ordered(self.mtp)]
        return out

    def per_gpu(self, par: Parallelism, runs: Runs) -> float:
        """Bytes per GPU of everything that runs."""
        return sum(p.nbytes(stored, runs.dtype_bytes) / p.ways(par) for _, p, stored in self.parts(runs))

    def draft_bytes(self, par: Parallelism, runs: Runs) -> tuple[float, float]:
        """The draft's ``(bytes in all, bytes per GPU)``; zeros without a draft."""
        draft = [(p, s) for comp, p, s in self.parts(runs) if comp == "draft"]
        return (
            sum(p.nbytes(s, runs.dtype_bytes) for p, s in draft),
            sum(p.nbytes(s, runs.dtype_bytes) / p.ways(par) for p, s in draft),
        )


def _ordered(parts: Mapping[str, PartBytes]) -> list[PartBytes]:
    return sorted(parts.values(), key=lambda p: PART_ORDER.index(p.label))


def _precision_of(dtype: str) -> str:
    """Storage precision of a weight tensor's safetensors dtype."""
    return {
        "U8": "mxfp4",
        "I8": "fp4",
        "F8_E4M3": "fp8",
        "BF16": "bf16",
        "F32": "fp32",
        "F16": "fp16",
        "I64": "int64",
        "I32": "int32",
    }.get(dtype, dtype.lower())


def _is_scale(name: str) -> bool:
    """A quantization scale (official ``.scale``, Quark ``.weight_scale``), not an ``hc_*_scale`` parameter."""
    return re.search(r"\.(weight_)?scale$", name) is not None


def weight_table(spec, *, storage: Mapping[str, Any] | None = None, reader=None, source: str) -> WeightTable:
    """Bytes per part. ``reader`` (a CheckpointReader) wins over ``storage`` (expected_tensors arguments)."""
    from vllm_dsv4_mtp.config import expected_tensors, weight_slots
    from vllm_dsv4_mtp.formats.checkpoint import DTYPE_BYTES

    tables: dict[bool, dict[str, PartBytes]] = {False: {}, True: {}}  # is_mtp -> parts

    def slot(name: str) -> PartBytes:
        label, split = part_of(name)
        return tables[name.startswith("mtp.")].setdefault(label, PartBytes(label, split))

    # Logical parameters and the decoded (dense) bytes: from the spec, whatever the storage.
    for s in weight_slots(spec, mtp=True).values():
        numel = math.prod(s.shape)
        p = slot(s.name)
        p.params += numel
        kind = s.dtypes[0]
        if kind == "F32" or kind.startswith("I"):  # float32 mixes / sinks / bias, integer tid2eid
            p.fixed_bytes += numel * DTYPE_BYTES[kind]
            p.fixed_precision.add(_precision_of(kind))
        else:
            p.dense_params += numel

    if reader is not None:
        for name in reader.names():
            info = reader.info(name)
            p = slot(name)
            p.stored_bytes += info.nbytes
            if not _is_scale(name):
                p.precision.add(_precision_of(info.dtype))
    else:
        for name, exp in expected_tensors(spec, mtp=True, **(storage or {})).items():
            p = slot(name)
            p.stored_bytes += math.prod(exp.shape) * DTYPE_BYTES[exp.dtypes[0]]
            if exp.role == "weight":
                p.precision.add(
                    exp.precision.replace("-block", "").replace("-official", "")
                    if exp.precision != "bf16"
                    else _precision_of(exp.dtypes[0])
                )
    return WeightTable(source=source, target=tables[False], mtp=tables[True])


def storage_from_spec(spec) -> dict[str, str]:
    """expected_tensors arguments for a config.json without weights, from its quantization_config.

    The official release's routed experts follow ``spec.official_expert_dtype`` (FP4 when the config has no
    ``expert_dtype``, as the published configs do not, and as vLLM assumes)."""
    q = spec.quantization_config or {}
    method = q.get("quant_method")
    if method == "quark":
        return {"experts": "mxfp4", "linears": "bf16"}
    if method in ("fp8", "deepseek_v4_fp8"):
        experts = {"fp4": "fp4-official", "fp8": "fp8-block", "bf16": "bf16"}[spec.official_expert_dtype]
        return {"experts": experts, "linears": "fp8"}
    return {"experts": "bf16", "linears": "bf16"}


def load_weight_table(model: str) -> WeightTable | None:
    """The weight table for ``model``: a local checkpoint directory or a known published checkpoint id.

    Returns None when ``model`` is neither (nothing to compute from).
    """
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    path = Path(model)
    if path.is_dir():
        spec = DeepseekV4Spec.from_dir(path)
        if any(path.glob("*.safetensors")):
            from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

            return weight_table(
                spec, reader=CheckpointReader(path), source=f"{path}: safetensors headers + config.json"
            )
        return weight_table(
            spec,
            storage=storage_from_spec(spec),
            source=f"{path / 'config.json'} (no weights: layout from its quantization_config)",
        )
    return known_weight_table(model)


@functools.cache
def known_weight_table(repo_id: str) -> WeightTable | None:
    """The table of a published checkpoint, built once per process (~1 s for Pro's 70k tensors); the cached
    table is shared, and nothing mutates a table after :func:`weight_table` returns it."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    known = KNOWN_CHECKPOINTS.get(repo_id)
    if known is None:
        return None
    spec = DeepseekV4Spec.from_dict(known.config, source=f"{known.repo_id} (known config)")
    storage = {
        "experts": known.experts,
        "linears": known.linears,
        "shared_experts": known.shared_experts,
        "mtp_linears": known.mtp_linears,
    }
    return weight_table(spec, storage=storage, source=f"{known.repo_id}: known config; {known.source}")
