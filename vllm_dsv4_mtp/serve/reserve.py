"""The runtime reserve: the memory per GPU vLLM needs besides weights and KV cache, per topology, derived
from public measurements with the capacity check's own arithmetic.

vLLM sizes its KV cache as ``gpu-memory-utilization x total - weights - (activation peak of the profiling run
at --max-num-batched-tokens + memory that is not torch's: collectives, AITER workspaces)`` and then captures
graphs. Everything besides weights and KV is the reserve. It is not computed from first principles: a
measured run gives ``reserve = budget - weights - KV budget``, where ``weights`` is this check's own count for
that run (:mod:`vllm_dsv4_mtp.serve.weight_bytes`: the checkpoint at its stored precision, the engine's own draft
at its stored precision), so that the check reproduces the measurement exactly.

Topologies (:func:`topology`): ``tp`` (data-parallel-size 1: attention split over TP) and ``dp``
(data-parallel-size > 1, or ATOM's DP attention: attention, dense weights and their activations per rank).
A topology's reserve is the largest one derived from its measurements: the check must not call a deployment
fit that a measurement saw fail. On MI355X (:data:`~vllm_dsv4_mtp.serve.profiles.MI355X_MEASUREMENTS`):

* ``tp``: InferenceX#2540 started vLLM 0.26 at TP4 with MTP and a 1,048,576-token model length, so its
  reserve was at most ``0.90 x total - weights - KV(one 1,048,576-token sequence)``; that bound is used, the
  largest reserve the measurement allows (about 43 GB);
* ``dp``: InferenceX#2540's DP4+EP4 (vLLM, 12.09 GiB of KV left: about 27 GB) and ATOM's TP4 with DP
  attention (KV budget -10.98 GB at 0.90: about 51 GB, InferenceX amd-master.yaml run 30277221626); the ATOM
  figure is the larger, so it is used. It includes ATOM's own per-request state, sized by max-num-seqs
  (https://github.com/ROCm/ATOM/pull/1164), so it overstates vLLM's.

Is 40-50 GB plausible? vLLM's DeepSeek-V4 keeps large sparse-attention / indexer workspaces per rank
(https://github.com/SemiAnalysisAI/InferenceX/pull/3337 budgets a 32 GiB "indexer buffer" per rank at TP4 and
TP8 for V4.1-Flash on vLLM), the profiling run's activation peak at 8192 batched tokens (four hyper-connection
streams of 8192 x 7168, MoE intermediates, indexer scores over the compressed context) is several GB, and
FULL_AND_PIECEWISE graph pools and RCCL buffers add a few GB: yes. The old single figure (4.82 GB, from the
DP4+EP4 run) took the MI355X as 288 GB (1e9) instead of the 287.98 GiB vLLM sees. The MI355X carveout (~32 GiB
per GPU in use before vLLM starts, InferenceX#2381) is not part of the reserve: vLLM's budget is a fraction of
the total, and memory already in use only makes vLLM refuse to start when the budget exceeds what is free
(0.95 x 287.98 GiB > ~256 GiB), which the check reports separately. The measurements ran K = 3 drafts and the
profiles run K = 2, at --max-num-batched-tokens 8192 like the profiles; the reserve is not rescaled, and the
Pro figures serve Flash too (its hidden size, heads and vocabulary shards are smaller: conservative).

What is uncertain: #2540 does not print its utilisation. 0.90 is assumed (the larger reserves); at 0.86 (its
successor script's value, and below the ~0.888 the carveout leaves) every vLLM-derived reserve is 12.4 GB
smaller, and Pro TP4 with the plugin's BF16 draft would fit at 0.90 by about 3 GB, where vLLM would refuse to
start on a carveout node anyway. A review thread of InferenceX#2522 quotes ~23.9 GiB of KV at 0.85 on an
earlier nightly, which would imply a reserve near 100 GB; its topology is not stated, so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsv4_mtp import platform
from vllm_dsv4_mtp.serve.kv import kv_bytes_per_token
from vllm_dsv4_mtp.serve.profiles import KNOWN_CHECKPOINTS, Hardware, Measurement
from vllm_dsv4_mtp.serve.weight_bytes import VLLM_DRAFT, Parallelism, Runs, known_weight_table

GB = 1e9
TP = "tp"
DP = "dp"
TOPOLOGY_LABELS = {TP: "TP topologies (data-parallel-size 1)", DP: "DP topologies (data-parallel-size > 1)"}


def topology(par: Parallelism) -> str:
    """``dp`` when attention is data parallel (weights and activations of attention per rank), else ``tp``."""
    return DP if par.dp > 1 else TP


@dataclass(frozen=True)
class DerivedReserve:
    """The reserve one measurement implies, with the numbers it was computed from (GB)."""

    measurement: Measurement
    par: Parallelism
    budget_gb: float
    weights_gb: float
    kv_gb: float  # the measured KV budget, or the KV of one fits_length sequence for a bound
    reserve_gb: float

    def formula(self) -> str:
        m = self.measurement
        kv = (
            f"+ {-self.kv_gb:.2f} GB (KV budget {self.kv_gb:.2f} GB)"
            if self.kv_gb < 0
            else f"- {self.kv_gb:.2f} GB KV"
            + (f" (one {m.fits_length:,}-token sequence fitted)" if m.kv_gb is None else " left")
        )
        return (
            f"{m.gpu_memory_utilization:g} x total = {self.budget_gb:.2f} GB - {self.weights_gb:.2f} GB "
            f"weights {kv} = {self.reserve_gb:.2f} GB"
        )


def derive(m: Measurement, hw: Hardware) -> DerivedReserve:
    """``reserve = budget - weights - KV`` for one measurement, on the measured machine's memory."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    par = Parallelism(tp=m.tp, dp=m.dp, expert_parallel=m.expert_parallel)
    table = known_weight_table(m.model)
    # the measured engines ran the checkpoint as stored, target and draft alike
    weights = table.per_gpu(par, Runs(target=platform.IN_TREE, draft=VLLM_DRAFT))
    budget = m.gpu_memory_utilization * hw.gpu_memory_gb * GB
    if m.kv_gb is not None:
        kv = m.kv_gb * GB
    else:
        spec = DeepseekV4Spec.from_dict(KNOWN_CHECKPOINTS[m.model].config, source=m.model)
        kv = kv_bytes_per_token(spec, "fp8") * m.fits_length
    return DerivedReserve(m, par, budget / GB, weights / GB, kv / GB, (budget - weights - kv) / GB)


@dataclass(frozen=True)
class Reserve:
    """The reserve the check assumes for a topology, and every derivation behind it."""

    topology: str
    gb: float
    used: DerivedReserve
    derived: tuple[DerivedReserve, ...]

    def lines(self) -> list[str]:
        """The derivation as printed under the reserve line: the one used first, then the others."""
        out = []
        for d in (self.used, *[d for d in self.derived if d is not self.used]):
            m = d.measurement
            tag = "used" if d is self.used else "not used (smaller)"
            out.append(f"    {tag}: {m.engine}, {m.model}, {_layout(d.par)}: {d.formula()}")
            out.append(f"      source: {m.source}")
            if m.note:
                out.append(f"      note: {m.note}")
        return out


def _layout(par: Parallelism) -> str:
    if par.dp > 1:
        return f"DP{par.dp}" + (f"+EP{par.dp * par.tp}" if par.expert_parallel else f" (experts / {par.dp})")
    return f"TP{par.tp}"


def reserve_for(hw: Hardware, par: Parallelism) -> Reserve:
    """The largest reserve derived from ``hw``'s measurements of ``par``'s topology (of all of them when that
    topology has none)."""
    if not hw.measurements:
        raise ValueError(f"{hw.name}: no measurement to derive the runtime reserve from")
    derived = tuple(derive(m, hw) for m in hw.measurements)
    same = tuple(d for d in derived if topology(d.par) == topology(par)) or derived
    used = max(same, key=lambda d: d.reserve_gb)
    return Reserve(topology(par), used.reserve_gb, used, same)
