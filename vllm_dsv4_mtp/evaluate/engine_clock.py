"""Request timings on the engine's own clock, read from a vLLM server's ``/metrics``.

Why not the client's clock: a streamed answer's chunks reach the client when the API server process and the
client get the CPU, not when the engine produced the tokens. On a loaded machine (two cores shared with the
engine's busy loop and other jobs) a whole answer can arrive in one burst after a stall, so "time after the
first chunk" shrinks to ~0.1 ms and a decode rate computed from it explodes (``make demo`` once printed
26431.8 tokens/s for MTP off, 0.00x). The engine stamps every output batch with its own monotonic clock
(``EngineCoreOutputs.timestamp``), and when a request finishes vLLM adds its intervals to histograms
(``vllm/v1/metrics/stats.py``, ``update_from_finished_request``):

- ``vllm:request_decode_time_seconds``  = last token - first token (engine timestamps)
- ``vllm:request_prefill_time_seconds`` = first token - scheduled
- ``vllm:request_queue_time_seconds``   = scheduled - queued
- ``vllm:e2e_request_latency_seconds``  = finish - arrival (API server clock)
- ``vllm:request_generation_tokens``    = tokens the engine generated (including any stop-string tokens
  that the API drops from the answer)
- ``vllm:request_success_total``        = finished requests, by finish reason

With one request in flight at a time, the growth of each ``_sum`` between two scrapes is that request's value.
The scrape after a request must wait until ``request_success_total`` has grown: vLLM records the finished
request's statistics after it has already queued the last chunk for the client (``AsyncLLM.output_handler``
awaits the stop-string abort in between).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from vllm_dsv4_mtp.serve.metrics import (
    SpecDecodeMetrics,
    fetch_metrics_text,
    parse_prometheus_text,
    spec_decode_metrics,
)

_HISTOGRAM_SUMS = {
    "vllm:request_decode_time_seconds_sum": "decode_s",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:e2e_request_latency_seconds_sum": "server_e2e_s",
    "vllm:request_generation_tokens_sum": "generation_tokens",
}
FINISHED = "vllm:request_success_total"


class EngineClockError(RuntimeError):
    """The server's ``/metrics`` lacks the request histograms, or a request never showed up as finished."""


@dataclass(frozen=True)
class RequestTotals:
    """Cumulative per-request statistics of one server (summed over engines, models and finish reasons)."""

    finished: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    queue_s: float = 0.0
    server_e2e_s: float = 0.0
    generation_tokens: float = 0.0

    def since(self, earlier: RequestTotals) -> RequestTotals:
        """What the requests finished after ``earlier`` was scraped added."""
        return RequestTotals(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


def request_totals(text: str, *, source: str = "/metrics") -> RequestTotals:
    """Parse ``/metrics`` text; raises :class:`EngineClockError` naming what is missing."""
    acc = {name: 0.0 for name in _HISTOGRAM_SUMS.values()}
    seen: set[str] = set()
    finished = 0.0
    for s in parse_prometheus_text(text):
        if s.name in _HISTOGRAM_SUMS:
            acc[_HISTOGRAM_SUMS[s.name]] += s.value
            seen.add(s.name)
        elif s.name == FINISHED:
            finished += s.value
            seen.add(s.name)
    missing = sorted((set(_HISTOGRAM_SUMS) | {FINISHED}) - seen)
    if missing:
        raise EngineClockError(
            f"{source} has no {', '.join(missing)} (is this a vLLM server with stats logging "
            "on, i.e. without --disable-log-stats?)"
        )
    return RequestTotals(finished=finished, **acc)


@dataclass(frozen=True)
class Snapshot:
    """One scrape of ``/metrics``: the request totals and the spec-decode counters (None with MTP off)."""

    totals: RequestTotals
    spec: SpecDecodeMetrics | None


def snapshot(base_url: str, timeout: float = 10.0) -> Snapshot:
    from .server import server_root

    root = server_root(base_url)
    text = fetch_metrics_text(root, timeout)
    return Snapshot(request_totals(text, source=f"{root}/metrics"), spec_decode_metrics(text))


def wait_finished(
    base_url: str, before: Snapshot, n: int = 1, timeout_s: float = 10.0, poll_s: float = 0.02
) -> Snapshot:
    """Scrape until ``n`` more requests than in ``before`` have finished; returns that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot(base_url)
        if now.totals.finished >= before.totals.finished + n:
            return now
        if time.monotonic() > deadline:
            raise EngineClockError(
                f"{base_url}/metrics: {now.totals.finished - before.totals.finished:.0f} of "
                f"{n} requests finished after {timeout_s:.0f} s"
            )
        time.sleep(poll_s)
