"""Will this DeepSeek-V4 deployment fit? Weights per GPU, then the KV / activation headroom that is left.

The arithmetic, per GPU, in GB (1e9 bytes)::

    budget   = gpu-memory-utilization x GPU memory
    weights  = sum over parts of  stored bytes / ways the part is split
    reserve  = activation peak + graph pools + collective buffers (measured, per hardware)
    kv_need  = KV cache for one max-model-len sequence (vLLM refuses to start with less)
    fits    <=> budget - weights - reserve >= kv_need

Weights come from the checkpoint itself: the safetensors headers of a local directory (actual dtypes), or,
without shards, :func:`vllm_dsv4_mtp.config.expected_tensors` for its config.json; for a published checkpoint
that is not local, its known config and storage layout (:data:`~vllm_dsv4_mtp.serve.profiles.KNOWN_CHECKPOINTS`).
The MTP layer is counted in BF16 whatever its storage (the plugin's precision policy), and only when the
speculative config asks for MTP (otherwise the target drops the ``mtp.*`` tensors).

Sharding follows vLLM's DeepSeek-V4 layers: routed experts are split over tensor parallelism (over TP x DP
with expert parallelism), shared experts, ``wq_b``/``wo_a``/``wo_b`` and the vocab-parallel embedding and head
over TP; ``wq_a``, ``wkv``, compressors, indexers, router, norms and hyper-connection tensors, and the MTP
``e_proj``/``h_proj`` are replicated on every GPU; pipeline parallelism divides the layers.

KV per token: DeepSeek-V4 keeps one compressed row per ``compress_ratio`` tokens on compressed layers (584 B in
vLLM's fp8 layout: 448 B NoPE + 128 B RoPE + 8 B scales; 2 x head_dim in bf16) plus one 132-B indexer row per
4 tokens on C4 layers; sliding-window rings are bounded and not counted. vLLM's paged allocator needs more
than the rows: the one measurement (InferenceX#2540: 14.88 GiB for a 1,048,576-token sequence of
DeepSeek-V4-Pro with fp8 KV and MTP) is used as the scale, and other configs, lengths and KV dtypes are scaled
by their row bytes per token relative to it.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from vllm_dsv4_mtp.serve.profiles import HARDWARE, KNOWN_CHECKPOINTS, PRO_CONFIG, Hardware

GB = 1e9
GIB = 2**30

#: InferenceX#2540: vLLM needed 14.88 GiB of KV for one 1,048,576-token DeepSeek-V4-Pro sequence (fp8, MTP).
KV_MEASURED_BYTES = 14.88 * GIB
KV_MEASURED_TOKENS = 1_048_576
KV_MEASURED_SOURCE = "InferenceX#2540: 14.88 GiB for one 1,048,576-token DeepSeek-V4-Pro sequence, fp8 KV"


class CapacityError(RuntimeError):
    """The deployment cannot fit; ``str()`` is the full arithmetic."""


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
        return self.tp * self.dp if self.expert_parallel else self.tp


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


def part_of(name: str) -> tuple[str, str]:
    """``(part label, split)`` of a native tensor name (weights and their scales alike)."""
    for label, test, split in _PARTS:
        if test(name):
            return label, split
    raise AssertionError("unreachable: the last part matches everything")


@dataclass
class PartBytes:
    label: str
    split: str
    precision: set[str] = field(default_factory=set)
    params: int = 0
    nbytes: float = 0.0

    def ways(self, par: Parallelism) -> int:
        layers = par.pp  # every part is spread over the pipeline stages (embed/head approximately)
        if self.split == "experts":
            return par.expert_ways * layers
        if self.split == "tp":
            return par.tp * layers
        return layers

    def per_gpu(self, par: Parallelism) -> float:
        return self.nbytes / self.ways(par)


@dataclass
class WeightTable:
    """Bytes of the target model by part, and of the MTP layer (BF16) by part, with where they came from."""

    source: str
    target: dict[str, PartBytes]
    mtp: dict[str, PartBytes]

    def per_gpu(self, par: Parallelism, *, with_mtp: bool) -> float:
        parts = list(self.target.values()) + (list(self.mtp.values()) if with_mtp else [])
        return sum(p.per_gpu(par) for p in parts)


def _precision_of(dtype: str, kind: str) -> str:
    if dtype in ("U8", "I8") and kind == "weight":
        return "mxfp4" if dtype == "U8" else "fp4"
    return {"F8_E4M3": "fp8", "BF16": "bf16", "F32": "fp32", "F16": "fp16", "I64": "int64",
            "I32": "int32"}.get(dtype, dtype.lower())


def weight_table(spec, *, storage: Mapping[str, Any] | None = None, reader=None, source: str) -> WeightTable:
    """Bytes per part. ``reader`` (a CheckpointReader) wins over ``storage`` (expected_tensors arguments)."""
    from vllm_dsv4_mtp.config import expected_tensors, weight_slots
    from vllm_dsv4_mtp.formats.checkpoint import DTYPE_BYTES

    target: dict[str, PartBytes] = {}
    mtp: dict[str, PartBytes] = {}

    def slot(table, name) -> PartBytes:
        label, split = part_of(name)
        return table.setdefault(label, PartBytes(label, split))

    # Logical parameter counts, and the MTP layer in BF16 (fp32 tensors stay fp32): the policy, not the storage.
    for s in weight_slots(spec, mtp=True).values():
        numel = math.prod(s.shape)
        if s.is_mtp:
            p = slot(mtp, s.name)
            p.params += numel
            width = 4 if s.dtypes[0] == "F32" else 2
            p.nbytes += numel * width
            p.precision.add("fp32" if width == 4 else "bf16")
        else:
            slot(target, s.name).params += numel

    if reader is not None:
        for name in reader.names():
            if name.startswith("mtp."):
                continue
            info = reader.info(name)
            p = slot(target, name)
            p.nbytes += info.nbytes
            if not re.search(r"(\.scale|_scale)$", name):
                p.precision.add(_precision_of(info.dtype, "weight"))
    else:
        for name, exp in expected_tensors(spec, mtp=False, **(storage or {})).items():
            p = slot(target, name)
            p.nbytes += math.prod(exp.shape) * DTYPE_BYTES[exp.dtypes[0]]
            if exp.role == "weight":
                p.precision.add(exp.precision if exp.precision != "bf16" else _precision_of(exp.dtypes[0], "x"))
    return WeightTable(source=source, target=target, mtp=mtp)


def _storage_from_config(cfg: Mapping[str, Any]) -> dict[str, str]:
    """expected_tensors arguments for a config.json without weights: read the quantization config."""
    q = cfg.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == "quark":
        return {"experts": "mxfp4", "linears": "bf16"}
    if method == "fp8":
        return {"experts": "fp4-official" if cfg.get("expert_dtype") == "fp4" else "fp8-block", "linears": "fp8"}
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

            return weight_table(spec, reader=CheckpointReader(path),
                                source=f"{path}: safetensors headers + config.json")
        import json

        cfg = json.loads((path / "config.json").read_text())
        return weight_table(spec, storage=_storage_from_config(cfg),
                            source=f"{path / 'config.json'} (no weights: layout from its quantization_config)")
    return _known_weight_table(model)


@functools.lru_cache(maxsize=None)
def _known_weight_table(repo_id: str) -> WeightTable | None:
    """The table of a published checkpoint, built once per process (~1 s for Pro's 70k tensors); the cached
    table is shared, and nothing mutates a table after :func:`weight_table` returns it."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    known = KNOWN_CHECKPOINTS.get(repo_id)
    if known is None:
        return None
    spec = DeepseekV4Spec.from_dict(known.config, source=f"{known.repo_id} (known config)")
    storage = {"experts": known.experts, "linears": known.linears, "shared_experts": known.shared_experts}
    return weight_table(spec, storage=storage, source=f"{known.repo_id}: known config; {known.source}")


# ------------------------------------------------------------------------------------------------- KV cache
def kv_row_bytes_per_token(spec, kv_cache_dtype: str) -> float:
    """Compressed-row bytes per token summed over the main layers (see the module docstring)."""
    fp8 = kv_cache_dtype.startswith("fp8")
    row = (spec.head_dim - spec.qk_rope_head_dim) + 2 * spec.qk_rope_head_dim + 8 if fp8 else 2 * spec.head_dim
    index_row = spec.index_head_dim + 4  # fp8 keys + one fp32 scale; vLLM keeps the indexer cache in fp8
    total = 0.0
    for lid in range(spec.num_hidden_layers):
        r = spec.compress_ratio(lid)
        if r > 1:
            total += row / r + (index_row / r if spec.has_indexer(lid) else 0.0)
    return total


def kv_bytes_per_token(spec, kv_cache_dtype: str) -> float:
    """KV bytes per token of one sequence, scaled from the measured DeepSeek-V4-Pro figure."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    pro = DeepseekV4Spec.from_dict(PRO_CONFIG, source="DeepSeek-V4-Pro")
    scale = KV_MEASURED_BYTES / KV_MEASURED_TOKENS / kv_row_bytes_per_token(pro, "fp8")
    return kv_row_bytes_per_token(spec, kv_cache_dtype) * scale


# ------------------------------------------------------------------------------------------------- the check
@dataclass
class CapacityReport:
    text: str
    fits: bool
    left_gb: float


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M"


def check_capacity(
    model: str,
    *,
    hardware: str | Hardware,
    par: Parallelism,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    kv_cache_dtype: str,
    mtp: bool,
    gpu_memory_gb: float | None = None,
    table: WeightTable | None = None,
) -> CapacityReport | None:
    """The arithmetic for ``model`` on ``hardware``; None when there is no config to compute from."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    table = table or load_weight_table(model)
    if table is None:
        return None
    mem = gpu_memory_gb if gpu_memory_gb is not None else hw.gpu_memory_gb
    spec = (DeepseekV4Spec.from_dir(model) if Path(model).is_dir()
            else DeepseekV4Spec.from_dict(KNOWN_CHECKPOINTS[model].config, source=model))
    length = max_model_len or spec.max_position_embeddings

    budget = gpu_memory_utilization * mem * GB
    split = {"experts": f"/ {par.expert_ways * par.pp} ({'TPxDP, EP' if par.expert_parallel else 'TP'})",
             "tp": f"/ {par.tp * par.pp} (TP)", "replicated": "replicated" if par.pp == 1 else f"/ {par.pp} (PP)"}
    out = [f"capacity check: {model} on {hw.name} ({mem:g} GB per GPU), TP={par.tp}"
           + (f" PP={par.pp}" if par.pp > 1 else "") + (f" DP={par.dp}" if par.dp > 1 else "")
           + (" EP" if par.expert_parallel else "") + f", MTP draft {'on (BF16)' if mtp else 'off'}",
           f"  weights: {table.source}",
           f"  {'part':<32} {'precision':<20} {'params':>12} {'bytes':>11}  {'split':<16}{'per GPU':>12}"]

    def row(text: str, nbytes: float) -> str:
        return f"  {text:<96}{nbytes / GB:9.2f} GB"

    weights = 0.0
    order = [label for label, _, _ in _PARTS]
    for p in sorted(table.target.values(), key=lambda p: order.index(p.label)):
        if p.nbytes:
            per = p.per_gpu(par)
            weights += per
            out.append(row(f"{p.label:<32} {'+'.join(sorted(p.precision)):<20} {_fmt_params(p.params):>12} "
                           f"{p.nbytes / GB:8.2f} GB  {split[p.split]:<16}", per))
    if mtp:
        mtp_params = sum(p.params for p in table.mtp.values())
        mtp_bytes = sum(p.nbytes for p in table.mtp.values())
        per = sum(p.per_gpu(par) for p in table.mtp.values())
        weights += per
        prec = "+".join(sorted(set().union(*(p.precision for p in table.mtp.values()))))
        out.append(row(f"{'MTP layer (BF16 by policy)':<32} {prec:<20} {_fmt_params(mtp_params):>12} "
                       f"{mtp_bytes / GB:8.2f} GB  {'split as above':<16}", per))
    out.append(row("= weights per GPU", weights))
    reserve = hw.runtime_reserve_gb * GB
    kv_tok = kv_bytes_per_token(spec, kv_cache_dtype) / par.pp
    kv_need = kv_tok * length
    left = budget - weights - reserve - kv_need
    out.append(row(f"budget per GPU = gpu-memory-utilization {gpu_memory_utilization:g} x {mem:g} GB", budget))
    out.append(row("runtime reserve: activations, graph pools, collectives", reserve))
    out.append(f"    ({hw.reserve_source})")
    out.append(row(f"KV cache for one {length:,}-token sequence, {kv_cache_dtype} KV, {kv_tok:,.0f} B/token", kv_need))
    out.append(f"    (scaled by compressed-row bytes from {KV_MEASURED_SOURCE})")
    out.append(row(f"left = {budget / GB:.2f} - {weights / GB:.2f} - {reserve / GB:.2f} - {kv_need / GB:.2f}", left))
    fits = left >= 0
    if fits:
        extra = (budget - weights - reserve) / kv_tok
        out.append(f"  fits: the KV cache holds about {extra:,.0f} tokens ({extra / length:.1f} sequences of "
                   f"{length:,})")
    else:
        out.append(f"  does not fit: {-left / GB:.2f} GB per GPU short")
        out += _suggestions(table, par, mem, gpu_memory_utilization, reserve, kv_tok, length, mtp, hw)
    return CapacityReport(text="\n".join(out), fits=fits, left_gb=left / GB)


def _suggestions(table, par, mem, util, reserve, kv_tok, length, mtp, hw) -> list[str]:
    """What would make it fit, each computed with the same arithmetic."""
    out = []
    weights = table.per_gpu(par, with_mtp=mtp)
    room = util * mem * GB - weights - reserve
    if room > kv_tok * 1024:
        out.append(f"    --max-model-len {int(room / kv_tok)} (the longest sequence that fits)")
    need_util = (weights + reserve + kv_tok * length) / (mem * GB)
    if need_util < 1:
        out.append(f"    --gpu-memory-utilization {math.ceil(need_util * 100) / 100:.2f} (the smallest that fits)")
    for tp in (2, 4, 8, 16):
        if tp <= par.tp or tp * par.pp * par.dp > hw.gpus_per_node:
            continue
        p2 = Parallelism(tp, par.pp, par.dp, par.expert_parallel)
        if util * mem * GB - table.per_gpu(p2, with_mtp=mtp) - reserve - kv_tok * length >= 0:
            out.append(f"    --tensor-parallel-size {tp}")
            break
    if mtp and room + table.per_gpu(par, with_mtp=True) - table.per_gpu(par, with_mtp=False) >= kv_tok * length:
        out.append("    --speculative-config null (no MTP draft: its BF16 weights no longer need room)")
    return (["  any one of these fits:"] + out) if out else []
