"""Will this DeepSeek-V4 deployment fit? Weights per GPU, then the KV / activation headroom that is left.

The arithmetic, per GPU, in GB (1e9 bytes)::

    budget   = gpu-memory-utilization x GPU memory (the total vLLM sees: 287.98 GiB on an MI355X)
    weights  = sum over what runs of  its bytes in GPU memory / ways it is split      (serve/weight_bytes.py)
    reserve  = activation peak + workspaces + graph pools + collectives, per topology,
               derived from public measurements with this same arithmetic            (serve/reserve.py)
    kv_need  = KV cache for one max-model-len sequence (vLLM refuses to start with less)   (serve/kv.py)
    fits    <=> budget - weights - reserve >= kv_need

What runs is counted per platform: on MI355X vLLM's in-tree target at the checkpoint's stored precision and
the plugin's MTP draft (only when the speculative config asks for MTP; otherwise the target drops the
``mtp.*`` tensors), BF16 or stored as ``VLLM_DSV4_MTP_DRAFT_PRECISION`` selects; on other platforms the plugin's
portable target with every weight decoded to the model dtype. The report prints each part, the reserve with its
derivation and source, and what would fit instead; with the plugin's draft, both precisions' bytes per GPU and
what the BF16 one costs in KV-cache tokens (the difference per GPU / the KV bytes per token per GPU).
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
    PLUGIN_STORED_DRAFT,
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
    "PLUGIN_STORED_DRAFT",
    "PRECISION_DRAFTS",
    "VLLM_DRAFT",
    "check_capacity",
    "kv_bytes_per_token",
    "kv_row_bytes_per_token",
    "load_weight_table",
    "part_of",
    "weight_table",
]

_DRAFT_ROWS = {
    PLUGIN_DRAFT: "MTP layer (plugin's BF16 draft)",
    PLUGIN_STORED_DRAFT: "MTP layer (plugin's, stored)",
    VLLM_DRAFT: "MTP layer (vLLM's draft, stored)",
}
#: VLLM_DSV4_MTP_DRAFT_PRECISION's values -> the plugin draft each one runs
PRECISION_DRAFTS = {"bf16": PLUGIN_DRAFT, "stored": PLUGIN_STORED_DRAFT}
_PRECISION_NOTES = {"bf16": "every MTP tensor upcast", "stored": "as the checkpoint stores it"}


class CapacityError(RuntimeError):
    """The deployment cannot fit; ``str()`` is the full arithmetic."""


@dataclass
class CapacityReport:
    text: str
    fits: bool
    left_gb: float
    kv_budget_gb: float  # budget - weights - reserve
    draft_gb: dict[str, float] | None = None  # the plugin draft's GB per GPU per precision ("bf16", "stored")
    bf16_kv_tokens: float | None = None  # the KV-cache tokens per GPU the BF16 draft costs over the stored one


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


def draft_trade(table: WeightTable, par: Parallelism, runs: Runs, kv_tok: float, kv_cache_dtype: str):
    """Both plugin drafts' bytes per GPU and what BF16 costs in KV-cache tokens: ``(lines, {precision: bytes per
    GPU}, tokens)``. The KV of one sequence is on every GPU of its TP group, so a GPU's bytes buy tokens at the
    per-GPU rate ``kv_tok``."""
    selected = next(k for k, v in PRECISION_DRAFTS.items() if v == runs.draft)
    per_gpu, lines = {}, []
    params = sum(p.params for p in table.mtp.values())
    lines.append(
        f"  MTP draft precision (VLLM_DSV4_MTP_DRAFT_PRECISION={selected}), the MTP layer's {_fmt_params(params)} "
        f"parameters, per GPU at TP={par.tp}" + (f" PP={par.pp}" if par.pp > 1 else "") + ":"
    )
    for precision, draft in PRECISION_DRAFTS.items():
        r = Runs(runs.target, draft, runs.dtype_bytes)
        total, per_gpu[precision] = table.draft_bytes(par, r)
        prec = "+".join(sorted({x for p in table.mtp.values() for x in p.precision_label(r.draft_stored).split("+")}))
        tag = f"{precision}{' (selected)' if precision == selected else ''}"
        lines.append(
            _row(
                f"  {tag:<17} {_PRECISION_NOTES[precision]:<28} {prec:<24} {total / GB:8.2f} GB in all",
                per_gpu[precision],
            )
        )
    cost = per_gpu["bf16"] - per_gpu["stored"]
    tokens = cost / kv_tok
    lines.append(
        f"  bf16 draft costs {cost / GB:.2f} GB per GPU = {tokens:,.0f} KV-cache tokens "
        f"({cost / GB:.2f} GB / {kv_tok:,.0f} B per token per GPU, {kv_cache_dtype} KV)"
    )
    return lines, per_gpu, tokens


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

    ``draft`` is the plugin's, BF16 (``PLUGIN_DRAFT``) or stored (``PLUGIN_STORED_DRAFT``): what ``dsv4-mtp serve``
    starts under ``VLLM_DSV4_MTP_DRAFT_PRECISION``; ``VLLM_DRAFT`` models vLLM's own draft."""
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
    report = CapacityReport(text="", fits=fits, left_gb=left / GB, kv_budget_gb=kv_budget / GB)
    if runs.draft in PRECISION_DRAFTS.values():
        lines, per_gpu, report.bf16_kv_tokens = draft_trade(table, par, runs, kv_tok, kv_cache_dtype)
        out += lines
        report.draft_gb = {k: v / GB for k, v in per_gpu.items()}
    report.text = "\n".join(out)
    return report


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
