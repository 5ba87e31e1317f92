"""Speculative-decoding acceptance from a vLLM server's ``/metrics`` (Prometheus text format).

vLLM exports four counters when speculative decoding is on (``vllm/v1/spec_decode/metrics.py``):
``vllm:spec_decode_num_drafts_total`` (verify steps that carried drafts), ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``, each labelled
by model and engine. From them, as vLLM's own documentation of those counters defines it:

- acceptance rate          = accepted tokens / draft tokens
- mean acceptance length   = 1 + accepted tokens / drafts   (the bonus token counted, as in vLLM/ATOM/InferenceX)
- acceptance at position i = accepted at position i / drafts

Counters are cumulative since the server started; :meth:`SpecDecodeMetrics.since` gives the numbers for the
requests between two scrapes (what a benchmark wants). Library use::

    before = scrape(url); ...run requests...; m = scrape(url).since(before)
    m.mean_acceptance_length, m.per_position

The plugin adds one sample of its own, ``dsv4_mtp_draft_precision{precision="bf16"} 1`` (or ``stored``): the
``VLLM_DSV4_MTP_DRAFT_PRECISION`` the server's processes run the draft with, exported by the API server process
(which reads the same environment the engine's processes inherit), so a client comparing servers can tell which
draft each one runs without being told. Its name has no ``vllm:`` prefix: vLLM unregisters every collector named
so when it builds its own. With ``--api-server-count`` > 1 vLLM serves ``/metrics`` from a multiprocess registry
and the sample is absent.

``dsv4-mtp metrics URL [--json]`` prints them. No dependency beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from dataclasses import asdict, dataclass, field

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts_total"
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


DRAFT_PRECISION_METRIC = "dsv4_mtp_draft_precision"

_exported = False


class _DraftPrecisionCollector:
    """Read at every scrape, so the sample is the environment's value, never a copy taken at import."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from vllm_dsv4_mtp.draft_policy import MtpPrecisionError, draft_precision

        try:
            precision = draft_precision()
        except MtpPrecisionError:  # the draft refuses to start with it: no precision to report
            return
        g = GaugeMetricFamily(
            DRAFT_PRECISION_METRIC,
            "VLLM_DSV4_MTP_DRAFT_PRECISION of the plugin's MTP draft (1 for the value in use)",
            labels=["precision"],
        )
        g.add_metric([precision], 1.0)
        yield g


def export_draft_precision() -> bool:
    """Add the draft-precision sample to this process's default Prometheus registry, once; False without
    prometheus_client (a process that serves no ``/metrics``)."""
    global _exported
    if _exported:
        return True
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    REGISTRY.register(_DraftPrecisionCollector())
    _exported = True
    return True


def draft_precision_from_metrics(text: str) -> str | None:
    """The draft precision a server's ``/metrics`` reports, or None when it exports none."""
    found = {s.labels.get("precision") for s in parse_prometheus_text(text) if s.name == DRAFT_PRECISION_METRIC}
    found.discard(None)
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


class MetricsFormatError(ValueError):
    """A line of the exposition text that is not a valid sample; the message quotes it."""


def _unescape(s: str) -> str:
    return s.replace(r"\\", "\0").replace(r"\"", '"').replace(r"\n", "\n").replace("\0", "\\")


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (``# HELP``/``# TYPE`` comments skipped)."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise MetricsFormatError(f"line {lineno}: not a Prometheus sample: {line!r}")
        labels = {}
        rest = m.group("labels") or ""
        pos = 0
        while pos < len(rest):
            lm = _LABEL.match(rest, pos)
            if lm is None:
                raise MetricsFormatError(f"line {lineno}: bad labels {rest!r}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        try:
            value = float(m.group("value"))
        except ValueError:
            raise MetricsFormatError(f"line {lineno}: bad value {m.group('value')!r}") from None
        out.append(Sample(m.group("name"), labels, value))
    return out


@dataclass
class SpecDecodeMetrics:
    """The spec-decode counters, summed over engines (and models, unless filtered)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position(self) -> list[float] | None:
        """Acceptance at each draft position (position 0 first)."""
        if not self.num_drafts:
            return None
        return [self.accepted_per_position[i] / self.num_drafts for i in sorted(self.accepted_per_position)]

    def __add__(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        """Two servers' counters together (replicas behind a router)."""
        per = dict(self.accepted_per_position)
        for p, v in other.accepted_per_position.items():
            per[p] = per.get(p, 0.0) + v
        return SpecDecodeMetrics(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            per,
        )

    def since(self, earlier: SpecDecodeMetrics) -> SpecDecodeMetrics:
        """The counters accumulated after ``earlier`` was scraped."""
        return SpecDecodeMetrics(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            {p: v - earlier.accepted_per_position.get(p, 0.0) for p, v in self.accepted_per_position.items()},
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accepted_per_position"] = {str(k): v for k, v in self.accepted_per_position.items()}
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            per_position_acceptance=self.per_position,
        )
        return d

    def summary(self) -> str:
        if not self.num_drafts:
            return f"spec decoding: {self.num_drafts:.0f} drafts so far (no acceptance to report yet)"
        pos = " ".join(f"{i}:{a:.3f}" for i, a in enumerate(self.per_position))
        return (
            f"spec decoding: {self.num_drafts:.0f} drafts, {self.num_draft_tokens:.0f} draft tokens, "
            f"{self.num_accepted_tokens:.0f} accepted\n"
            f"  acceptance rate        {self.acceptance_rate:.4f}\n"
            f"  mean acceptance length {self.mean_acceptance_length:.4f}\n"
            f"  per-position acceptance {pos}"
        )


def spec_decode_metrics(text: str, model_name: str | None = None) -> SpecDecodeMetrics | None:
    """Parse ``/metrics`` text; None when the server exports no spec-decode counters (speculation off)."""
    m = SpecDecodeMetrics()
    seen = False
    for s in parse_prometheus_text(text):
        if not s.name.startswith(PREFIX) or (model_name and s.labels.get("model_name") != model_name):
            continue
        if s.name == DRAFTS:
            m.num_drafts += s.value
        elif s.name == DRAFT_TOKENS:
            m.num_draft_tokens += s.value
        elif s.name == ACCEPTED:
            m.num_accepted_tokens += s.value
        elif s.name == ACCEPTED_PER_POS:
            if "position" not in s.labels:
                raise MetricsFormatError(f"{ACCEPTED_PER_POS} sample without a position label: {s.labels}")
            p = int(s.labels["position"])
            m.accepted_per_position[p] = m.accepted_per_position.get(p, 0.0) + s.value
        else:
            continue
        seen = True
    return m if seen else None


def metrics_url(url: str) -> str:
    """Accept ``http://host:port``, ``.../v1`` or the ``/metrics`` URL itself."""
    url = url.rstrip("/")
    if url.endswith("/metrics"):
        return url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url + "/metrics"


def fetch_metrics_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as r:  # noqa: S310 (operator-given URL)
        return r.read().decode("utf-8")


def scrape(url: str, model_name: str | None = None, timeout: float = 10.0) -> SpecDecodeMetrics | None:
    return spec_decode_metrics(fetch_metrics_text(url, timeout), model_name)


def spec_decode_from_llm(metrics) -> SpecDecodeMetrics | None:
    """``LLM.get_metrics()`` -> :class:`SpecDecodeMetrics`, or None when the engine has no spec-decode counters."""
    m = SpecDecodeMetrics()
    seen = False
    for x in metrics:
        if x.name == "vllm:spec_decode_num_drafts":
            m.num_drafts += x.value
        elif x.name == "vllm:spec_decode_num_draft_tokens":
            m.num_draft_tokens += x.value
        elif x.name == "vllm:spec_decode_num_accepted_tokens":
            m.num_accepted_tokens += x.value
        elif x.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for p, v in enumerate(x.values):
                m.accepted_per_position[p] = m.accepted_per_position.get(p, 0.0) + v
        else:
            continue
        seen = True
    return m if seen else None


def engine_steps(metrics) -> int | None:
    """Engine steps that produced tokens: vLLM's ``vllm:iteration_tokens_total`` histogram count."""
    for x in metrics:
        if x.name == "vllm:iteration_tokens_total":
            return int(x.count)
    return None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "metrics", help="spec-decode acceptance from running servers' /metrics: each replica's, and all together"
    )
    p.add_argument("url", nargs="+", help="server URL (http://HOST:PORT, .../v1 or .../metrics); several: replicas")
    p.add_argument("--model-name", help="count only this served model's samples")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_run)


def _read(url: str, args) -> SpecDecodeMetrics | str:
    """The server's counters, or why there are none."""
    try:
        m = scrape(url, args.model_name, args.timeout)
    except OSError as e:
        return f"cannot read {metrics_url(url)}: {e}"
    return (
        m
        if m is not None
        else f"{metrics_url(url)} has no {PREFIX}* counters: speculative decoding is off on this server"
    )


def _run(args) -> int:
    """One URL: its counters. Several (replicas behind a router): each one's, then their sum; a replica that cannot
    be read or has no spec-decode counters is named, the others still reported, and the exit status is 1."""
    read = {url: _read(url, args) for url in args.url}
    found = {u: m for u, m in read.items() if isinstance(m, SpecDecodeMetrics)}
    problems = [m for m in read.values() if isinstance(m, str)]
    if len(args.url) == 1 and problems:
        (msg,) = problems
        if msg.startswith("cannot read"):
            print(f"dsv4-mtp metrics: error: {msg}", file=sys.stderr)
        else:
            print(json.dumps({"spec_decoding": False, "message": msg}) if args.json else msg)
        return 1
    if len(args.url) == 1:
        (m,) = found.values()
        print(json.dumps(m.to_dict(), indent=1) if args.json else m.summary())
        return 0
    for msg in problems:
        print(f"dsv4-mtp metrics: error: {msg}", file=sys.stderr)
    total = sum(found.values(), SpecDecodeMetrics())
    if args.json:
        print(json.dumps({"replicas": {u: m.to_dict() for u, m in found.items()}, "total": total.to_dict()}, indent=1))
    else:
        for url, m in found.items():
            print(f"{url}:\n{m.summary()}")
        print(f"all {len(found)} of {len(args.url)} replicas:\n{total.summary()}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4-mtp metrics")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["metrics", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
