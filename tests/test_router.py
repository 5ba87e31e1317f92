"""Two plugin servers (embedded model, MTP K=2) behind vLLM's router, ``vllm-router`` from PyPI (issue 49).

The router runs with the flags the project ships (``vllm_dsv4_mtp/serve/router.py``, also in
docker/compose.router.yaml): ``consistent_hash``, ``/health`` every 2 s, two failures drop a replica, 3 retries.
Requests carry ``X-Session-ID``, the key the router hashes. Which replica served what is read from each server's
own ``vllm:request_success_total``.

* requests spread over both replicas, and a conversation's turns land on one;
* greedy outputs through the router equal one server's, asked directly;
* one replica killed (SIGKILL to its process group) under load: the router marks it unhealthy within
  ``DETECT_BOUND_S`` s (router.py), and every request sent after that succeeds on the other. What clients in
  flight on the killed replica see is printed (and stated in docs/scale-out.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers import get

from vllm_dsv4_mtp.evaluate.server import free_port, wait_healthy
from vllm_dsv4_mtp.serve.metrics import parse_prometheus_text
from vllm_dsv4_mtp.serve.router import DETECT_BOUND_S, router_argv

pytestmark = pytest.mark.engine

MODEL = "dsv4-tiny"
PROMPTS = [f"Question: Tom has {a} apples and buys {b} more. How many apples does Tom have?\nAnswer:" for a, b in
           [(3, 4), (12, 9), (7, 30), (41, 5), (8, 8), (19, 23), (2, 60), (33, 14)]]  # fmt: skip


def router_binary() -> str:
    exe = Path(sys.executable).with_name("vllm-router")
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    assert found, "vllm-router is not installed (pyproject.toml's test extra pins it)"
    return found


def complete(base: str, prompt: str, session: str, max_tokens: int = 8, timeout: float = 120) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Session-ID": session},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]
    except OSError as e:
        return 0, repr(e)


def served(base: str) -> float:
    """Requests the server finished (``vllm:request_success_total``, every finish reason)."""
    text = get(base + "/metrics", timeout=10).decode()
    return sum(s.value for s in parse_prometheus_text(text) if s.name == "vllm:request_success_total")


@pytest.fixture(scope="module")
def cluster(embedded_mxfp4, start_server, tmp_path_factory):
    a = start_server(embedded_mxfp4, mtp_k=2, extra_args=["--seed", "0"])
    b = start_server(embedded_mxfp4, mtp_k=2, extra_args=["--seed", "0"])
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    argv = router_argv(router_binary(), [a.base_url, b.base_url], host="127.0.0.1", port=port)
    argv += ["--worker-startup-check-interval", "1", "--log-level", "warning"]  # the servers are up already
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # not its fixed default port
    with open(log, "w") as out:
        router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 120, poll_s=0.5, exit_status=router.poll, progress=False)
        yield {"router": base, "a": a, "b": b, "proc": router, "log": log}
    finally:
        router.send_signal(signal.SIGINT)
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)


def workers_healthy(base: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in json.loads(get(base + "/workers"))["workers"]}


def test_requests_spread_over_both_replicas_and_a_conversation_stays_on_one(cluster):
    a, b, router = cluster["a"], cluster["b"], cluster["router"]
    before = (served(a.base_url), served(b.base_url))
    for i in range(24):
        status, text = complete(router, PROMPTS[i % len(PROMPTS)], f"user-{i}", max_tokens=4)
        assert status == 200, text
    spread = (served(a.base_url) - before[0], served(b.base_url) - before[1])
    print(f"24 sessions: {spread[0]:.0f} on replica a, {spread[1]:.0f} on replica b")
    assert sum(spread) == 24 and min(spread) > 0, spread
    before = (served(a.base_url), served(b.base_url))
    prompt = PROMPTS[0]
    for _ in range(4):  # each turn's prompt is the conversation so far
        status, text = complete(router, prompt, "conversation-1", max_tokens=6)
        assert status == 200, text
        prompt += text + "\nQuestion: and then?\nAnswer:"
    turns = sorted((served(a.base_url) - before[0], served(b.base_url) - before[1]))
    assert turns == [0, 4], turns


def test_greedy_outputs_through_the_router_equal_one_servers(cluster):
    direct = [complete(cluster["a"].base_url, p, "direct", max_tokens=24) for p in PROMPTS]
    routed = [complete(cluster["router"], p, f"routed-{i}", max_tokens=24) for i, p in enumerate(PROMPTS)]
    assert all(s == 200 for s, _ in direct + routed)
    assert routed == direct


def test_a_killed_replica_is_dropped_and_later_requests_succeed_on_the_other(cluster):
    router, b = cluster["router"], cluster["b"]
    results: list[tuple[float, float, int, str]] = []  # (sent, answered, status, text), monotonic seconds
    stop = threading.Event()

    def client(w: int) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            status, text = complete(router, PROMPTS[i % len(PROMPTS)], f"load-{w}-{i}", max_tokens=32)
            results.append((t0, time.monotonic(), status, text))
            i += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(8)
    killed = time.monotonic()
    os.killpg(b.proc.pid, signal.SIGKILL)
    dropped = None
    while time.monotonic() - killed < 30:
        if not workers_healthy(router)[b.base_url]:
            dropped = time.monotonic()
            break
        time.sleep(0.1)
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join(180)
    assert dropped is not None, "the router never marked the killed replica unhealthy"
    before = [r for r in results if r[1] < killed]
    in_flight = [r for r in results if r[0] < killed <= r[1]]
    between = [r for r in results if killed <= r[0] < dropped]
    after = [r for r in results if r[0] >= dropped]

    def failed(rs):
        return [r for r in rs if r[2] != 200]

    print(
        f"kill at t=0; router marked the replica unhealthy at t={dropped - killed:.2f} s. Requests answered before "
        f"the kill: {len(before)} ({len(failed(before))} failed); in flight at the kill: {len(in_flight)} "
        f"({len(failed(in_flight))} failed: {sorted({(r[2], r[3][:80]) for r in failed(in_flight)})}); sent "
        f"between kill and drop: {len(between)} ({len(failed(between))} failed); sent after the drop: "
        f"{len(after)} ({len(failed(after))} failed)"
    )
    assert dropped - killed <= DETECT_BOUND_S
    assert not failed(before)
    assert after and not failed(after), failed(after)[:3]
    assert workers_healthy(router)[cluster["a"].base_url]
