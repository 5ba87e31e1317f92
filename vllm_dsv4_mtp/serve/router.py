"""vLLM's router (``vllm-router``, PyPI) in front of N plugin servers: the flags the project ships and tests.

More DeepSeek-V4 throughput on MI355X means more TP8 replicas behind a router (docs/scale-out.md). The router
hashes ``X-Session-ID`` (or the user, or the request) to a replica (``consistent_hash``), so a conversation's
prefix cache stays on one, checks each replica's ``/health`` every :data:`HEALTH_INTERVAL_S` s and drops one after
:data:`HEALTH_FAILURES` failed checks, and retries a failed request. ``docker/compose.router.yaml`` runs it with
these flags (a test holds the two equal); ``tests/test_router.py`` runs it in front of two CPU servers.
"""

from __future__ import annotations

from collections.abc import Sequence

ROUTER_VERSION = "0.1.17"
HEALTH_INTERVAL_S = 2
HEALTH_TIMEOUT_S = 2
HEALTH_FAILURES = 2
#: a killed replica is out of the rotation within this many seconds: the failed checks' intervals, a timeout, 1 s
DETECT_BOUND_S = HEALTH_INTERVAL_S * HEALTH_FAILURES + HEALTH_TIMEOUT_S + 1
RETRIES = 3


def router_flags() -> list[str]:
    """The routing and health flags, without the replicas and the address."""
    return [
        "--policy", "consistent_hash",
        "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
        "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--health-success-threshold", "1",
        "--health-check-endpoint", "/health",
        "--retry-max-retries", str(RETRIES),
        "--worker-startup-timeout-secs", "3600",  # DeepSeek-V4-Pro loads for tens of minutes
        "--worker-startup-check-interval", "10",
    ]  # fmt: skip


def router_argv(binary: str, worker_urls: Sequence[str], host: str = "0.0.0.0", port: int = 8000) -> list[str]:
    return [binary, "--worker-urls", *worker_urls, "--host", host, "--port", str(port), *router_flags()]
