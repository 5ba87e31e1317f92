"""Will this DeepSeek-V4 deployment fit? Weights per GPU, then the KV / activation headroom that is left.

The arithmetic, per GPU, in GB (1e9 bytes)::

    budget   = gpu-memory-utilization x GPU memory (the total vLLM sees: 287.98 GiB on an MI355X)
    weights  = sum over what runs of  its bytes in GPU memory / ways it is split      (serve/weight_bytes.py)
    reserve  = activation peak + workspaces + graph pools + collectives, per topology,
               derived from public measurements with this same arithmetic            (serve/reserve.py)
    kv_need  = KV cache for one max-model-len sequence (vLLM refuses to start with less)   (serve/kv.py)
    fits    <=> budget - weights - reserve >= kv_need

What runs is counted per platform: on MI355X vLLM's in-tree target at the checkpoint's stored precision and
the plugin's BF16 MTP draft (only when the speculative config asks for MTP; otherwise the target drops the
``mtp.*`` tensors); on other platforms the plugin's portable target with every weight decoded to the model
dtype. The report prints each part, the reserve with its derivation and source, and what would fit instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from vllm_dsv4_mtp.serve.kv import GIB, KV_MEASURED_SOURCE, kv_bytes_per_token, kv_row_bytes_per_token
from vllm_dsv4_mtp.serve.profiles import GIB_IN_GB, HARDWARE, KNOWN_CHECKPOINTS, Hardware
from vllm_dsv4_mtp.serve.reserve import TOPOLOGY_LABELS, reserve_for
from vllm_dsv4_mtp.serve.weight_bytes import (
    PLUGIN_DRAFT,
    VLLM_DRAFT,
    Parallelism,
    Runs,
    WeightTable,
    load_weight_table,
    part_of,
    weight_table,
)

GB = 1e9

__all__ = [
    "GB",
    "GIB",
    "CapacityError",
    "CapacityReport",
    "Parallelism",
    "Runs",
    "WeightTable",
    "PLUGIN_DRAFT",
    "VLLM_DRAFT",
    "check_capacity",
    "kv_bytes_per_token",
    "kv_row_bytes_per_token",
    "load_weight_table",
    "part_of",
    "weight_table",
]

_DRAFT_ROWS = {PLUGIN_DRAFT: "MTP layer (plugin's BF16 draft)", VLLM_DRAFT: "MTP layer (vLLM's draft, stored)"}


class CapacityError(RuntimeError):
    """The deployment cannot fit; ``str()`` is the full arithmetic."""


@dataclass
class CapacityReport:
    text: str
    fits: bool
    left_gb: float
    kv_budget_gb: float  # budget - weights - reserve


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M"


def _row(text: str, nbytes: float) -> str:
    return f"  {text:<96}{nbytes / GB:9.2f} GB"


def _weight_rows(table: WeightTable, par: Parallelism, runs: Runs) -> tuple[list[str], float]:
    """One row per target part, one for the MTP layer; and the weights per GPU (bytes)."""
    split = {
        "experts": f"/ {par.expert_ways * par.pp} (TPxDP{', EP' if par.expert_parallel else ''})"
        if par.dp > 1
        else f"/ {par.expert_ways * par.pp} ({'EP' if par.expert_parallel else 'TP'})",
        "tp": f"/ {par.tp * par.pp} (TP)",
        "replicated": "replicated" if par.pp == 1 else f"/ {par.pp} (PP)",
    }
    rows, weights = [], 0.0
    parts = list(table.parts(runs))
    draft = [(p, stored) for comp, p, stored in parts if comp == "draft"]
    for comp, p, stored in parts:
        nbytes = p.nbytes(stored, runs.dtype_bytes)
        if comp != "target" or not nbytes:
            continue
        per_gpu = nbytes / p.ways(par)
        weights += per_gpu
        rows.append(
            _row(
                f"{p.label:<32} {p.precision_label(stored, runs.dtype_bytes):<20} "
                f"{_fmt_params(p.params):>12} {nbytes / GB:8.2f} GB  {split[p.split]:<16}",
                per_gpu,
            )
        )
    if draft:
        nbytes = sum(p.nbytes(s, runs.dtype_bytes) for p, s in draft)
        per = sum(p.nbytes(s, runs.dtype_bytes) / p.ways(par) for p, s in draft)
        weights += per
        prec = "+".join(sorted({x for p, s in draft for x in p.precision_label(s, runs.dtype_bytes).split("+")}))
        rows.append(
            _row(
                f"{_DRAFT_ROWS[runs.draft]:<32} {prec:<20} {_fmt_params(sum(p.params for p, _ in draft)):>12}"
                f" {nbytes / GB:8.2f} GB  {'split as above':<16}",
                per,
            )
        )
    return rows, weights


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
    draft: str = PLUGIN_DRAFT,
    dtype_bytes: int = 2,
) -> CapacityReport | None:
    """The arithmetic for ``model`` on ``hardware``; None when there is no config to compute from.

    ``draft`` is the plugin's (what ``dsv4-mtp serve`` starts); ``VLLM_DRAFT`` models vLLM's own draft."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    table = table or load_weight_table(model)
    if table is None:
        return None
    mem = gpu_memory_gb if gpu_memory_gb is not None else hw.gpu_memory_gb
    spec = (
        DeepseekV4Spec.from_dir(model)
        if Path(model).is_dir()
        else DeepseekV4Spec.from_dict(KNOWN_CHECKPOINTS[model].config, source=model)
    )
    length = max_model_len or spec.max_position_embeddings
    runs = Runs(target=hw.implementation, draft=draft if mtp else None, dtype_bytes=dtype_bytes)

    out = [
        f"capacity check: {model} on {hw.name} ({mem / GIB_IN_GB:.2f} GiB = {mem:.2f} GB per GPU), TP={par.tp}"
        + (f" PP={par.pp}" if par.pp > 1 else "")
        + (f" DP={par.dp}" if par.dp > 1 else "")
        + (" EP" if par.expert_parallel else "")
        + f", MTP draft {'on' if mtp else 'off'}",
        f"  target: {runs.target_label()}",
        f"  draft:  {runs.draft_label()}",
        f"  weights: {table.source}",
        f"  {'part':<32} {'precision':<20} {'params':>12} {'bytes':>11}  {'split':<16}{'per GPU':>12}",
    ]
    rows, weights = _weight_rows(table, par, runs)
    out += rows + [_row("= weights per GPU", weights)]
    budget = gpu_memory_utilization * mem * GB
    reserve = reserve_for(hw, par)
    kv_tok = kv_bytes_per_token(spec, kv_cache_dtype) / par.pp
    kv_need = kv_tok * length
    kv_budget = budget - weights - reserve.gb * GB
    left = kv_budget - kv_need
    out.append(_row(f"budget per GPU = gpu-memory-utilization {gpu_memory_utilization:g} x {mem:.2f} GB", budget))
    out.append(
        _row(
            f"runtime reserve, {TOPOLOGY_LABELS[reserve.topology]}: activations, workspaces, graphs, collectives",
            reserve.gb * GB,
        )
    )
    out += reserve.lines()
    out.append(_row("KV budget = budget - weights - reserve", kv_budget))
    out.append(_row(f"KV cache for one {length:,}-token sequence, {kv_cache_dtype} KV, {kv_tok:,.0f} B/token", kv_need))
    out.append(f"    (scaled by compressed-row bytes from {KV_MEASURED_SOURCE})")
    out.append(_row(f"left = {budget / GB:.2f} - {weights / GB:.2f} - {reserve.gb:.2f} - {kv_need / GB:.2f}", left))
    fits = left >= 0
    if fits:
        out.append(
            f"  fits: the KV cache holds about {kv_budget / kv_tok:,.0f} tokens "
            f"({kv_budget / kv_tok / length:.1f} sequences of {length:,})"
        )
    else:
        out.append(f"  does not fit: {-left / GB:.2f} GB per GPU short")
        out += _suggestions(table, par, mem, gpu_memory_utilization, reserve.gb * GB, kv_tok, length, runs, hw)
    out += _startup_note(hw, budget, gpu_memory_gb)
    return CapacityReport(text="\n".join(out), fits=fits, left_gb=left / GB, kv_budget_gb=kv_budget / GB)


def _startup_note(hw: Hardware, budget: float, gpu_memory_gb: float | None) -> list[str]:
    """vLLM refuses to start when its budget exceeds the memory free at start-up (a fast failure, not an OOM
    after loading: reported, not refused)."""
    if hw.startup_free_gb is None or gpu_memory_gb is not None or budget <= hw.startup_free_gb * GB:
        return []
    return [
        f"  note: the budget is more than the {hw.startup_free_gb:.2f} GB ({hw.startup_free_gb / GIB_IN_GB:.0f} "
        f"GiB) measured free at start-up ({hw.startup_source}); vLLM refuses to start on such a node "
        f"above gpu-memory-utilization {math.floor(hw.startup_free_gb / hw.gpu_memory_gb * 1000) / 1000:.3f}"
    ]


def _suggestions(table, par, mem, util, reserve, kv_tok, length, runs, hw) -> list[str]:
    """What would make it fit, each computed with the same arithmetic."""
    out = []
    weights = table.per_gpu(par, runs)
    room = util * mem * GB - weights - reserve
    if room > kv_tok * 1024:
        out.append(f"    --max-model-len {int(room / kv_tok)} (the longest sequence that fits)")
    need_util = math.ceil((weights + reserve + kv_tok * length) / (mem * GB) * 100) / 100
    free = hw.startup_free_gb / hw.gpu_memory_gb if hw.startup_free_gb and mem == hw.gpu_memory_gb else 1
    if need_util <= free:  # above it vLLM refuses to start on a node with the carveout
        out.append(f"    --gpu-memory-utilization {need_util:.2f} (the smallest that fits)")
    for tp in (2, 4, 8, 16):
        if tp <= par.tp or tp * par.pp * par.dp > hw.gpus_per_node:
            continue
        p2 = Parallelism(tp, par.pp, par.dp, par.expert_parallel)
        if util * mem * GB - table.per_gpu(p2, runs) - reserve - kv_tok * length >= 0:
            out.append(f"    --tensor-parallel-size {tp}")
            break
    no_draft = Runs(runs.target, None, runs.dtype_bytes)
    if runs.draft is not None and util * mem * GB - table.per_gpu(par, no_draft) - reserve >= kv_tok * length:
        out.append("    --speculative-config null (no MTP draft: its weights no longer need room)")
    return (["  any one of these fits:"] + out) if out else []
