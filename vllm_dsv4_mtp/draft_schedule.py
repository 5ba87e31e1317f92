"""The draft's view of vLLM's K-per-batch-size schedule: which steps ask it for no draft token at all.

vLLM 0.32-0.34 read ``speculative_config.num_speculative_tokens_per_batch_size`` (``[[start, end, K], ...]``,
inclusive, K = 0 allowed) in ``Scheduler.schedule``: a step's K is ``lookup[number of scheduled requests]``, with
the dense table of ``vllm/v1/spec_decode/dynamic/utils.py:build_dynamic_sd_schedule_lookup``. At K = 0 vLLM still
runs the draft's forward over the step's tokens, to keep the draft's KV cache in sync, and then asks for no
logits. Only the MTP layer's attention-cache rows written there are ever read again, so at such a step the draft
writes them and computes nothing else::

    K = lookup[num_reqs]                 # num_reqs: the requests of the draft's first pass (the scheduler's count)
    K == 0  ->  X = h_proj(hnorm(H)) + e_proj(enorm(E));  u = hc_attn.pre(X);  write kv(attn_norm(u))
    K >= 1  ->  the whole MTP layer

The same table and the same count as the scheduler's (the draft's first pass carries every scheduled request, on
Model Runner V1 and V2 alike), read at forward time from the step's attention metadata. The decision is checked
afterwards: a step that asks for logits was not a K = 0 step, and :meth:`StepK.logits_asked` then fails loudly,
naming the counts, instead of sampling from a state that was never computed. Under data parallelism vLLM clears
the schedule before the workers start (static K, vllm#45963); the draft then sees no schedule and always runs whole.

``VLLM_DSV4_MTP_K0_CACHE_ONLY=0`` makes the draft run its whole layer at K = 0 too, as vLLM would without the
plugin: the A/B of what the cache-only step buys (docs/benchmarks.md), and a way out should the check above fire.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

logger = init_logger("vllm.dsv4_mtp.schedule")

#: "0": at K = 0 the draft runs its whole layer (vLLM's own behaviour); "1" (the default): its cache write only
CACHE_ONLY_ENV = "VLLM_DSV4_MTP_K0_CACHE_ONLY"


def cache_only_enabled() -> bool:
    value = os.environ.get(CACHE_ONLY_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(
            f"{CACHE_ONLY_ENV}={value!r}: expected 1 (K = 0 steps write the cache only) or 0 (whole layer)"
        )
    return value == "1"


def describe(schedule) -> str:
    """``[[1, 2, 2], [3, 64, 0]]`` -> ``K=2 at 1-2 requests, K=0 at 3-64``."""
    return ", ".join(f"K={k} at {a}-{b} requests" if a != b else f"K={k} at {a} request(s)" for a, b, k in schedule)


class StepK:
    """K per step from the draft's own copy of vLLM's lookup (None: no schedule, every step drafts)."""

    def __init__(self, vllm_config):
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        spec = vllm_config.speculative_config
        schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None) if spec is not None else None
        self.schedule = schedule
        self.lookup: list[int] | None = None
        self.last_cache_only: tuple[int, int] | None = None  # (num_reqs, K) of the last forward, if cache-only
        if schedule:
            cache_only = cache_only_enabled()
            if cache_only:
                self.lookup = build_dynamic_sd_schedule_lookup(
                    schedule, vllm_config.scheduler_config.max_num_seqs, spec.num_speculative_tokens
                )
            logger.info(
                "vllm-dsv4-mtp: MTP K schedule (num_speculative_tokens_per_batch_size): %s, at most K=%d; at K=0 "
                "the draft %s",
                describe(schedule),
                spec.num_speculative_tokens,
                "writes its attention cache only"
                if cache_only
                else f"runs its whole layer ({CACHE_ONLY_ENV}=0, as vLLM would without the plugin)",
            )

    def k(self, num_reqs: int | None) -> int | None:
        """The step's K by the scheduler's table (None: no schedule, or no metadata: a dummy or profile run)."""
        if self.lookup is None or num_reqs is None or not 0 < num_reqs < len(self.lookup):
            return None
        return self.lookup[num_reqs]

    def cache_only(self, num_reqs: int | None) -> bool:
        """Is this forward a K = 0 step's (write the attention cache, nothing else)? Remembered for the check."""
        k = self.k(num_reqs)
        self.last_cache_only = (num_reqs, k) if k == 0 else None
        return k == 0

    def logits_asked(self) -> None:
        """vLLM asks for logits: the last forward must have computed the whole layer."""
        if self.last_cache_only is not None:
            num_reqs, _ = self.last_cache_only
            raise RuntimeError(
                f"vllm-dsv4-mtp: the MTP draft took a step of {num_reqs} requests for K=0 by "
                f"num_speculative_tokens_per_batch_size {self.schedule} and wrote only its attention cache, but "
                "vLLM then asked it for logits: vLLM's scheduler chose K > 0 for that step. The draft's view of "
                "the schedule disagrees with vLLM's; serve without the schedule and report this"
            )
