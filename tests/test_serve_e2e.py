"""End to end: `dsv4-mtp serve --profile cpu-tiny` serves a tiny DeepSeek-V4 on CPU through vLLM's OpenAI server,
answers /v1/completions, exports /metrics, and stops cleanly on SIGINT and on SIGTERM with no process left.

The model is the shipped MXFP4 checkpoint (what ``make demo`` serves). The profile's MTP speculative config is
kept: the server must draft with the plugin's ``DeepSeekV4MTPModel`` and export spec-decode counters. This test
starts the server itself rather than through ``ManagedServer``: what it checks is the launcher's own process
(exec into vLLM's server, its engine-core children, the exit on each signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from servers import get, post_json

from vllm_dsv4_mtp.evaluate.server import ServerExitedError, ServerNotReadyError, bound_port, wait_healthy
from vllm_dsv4_mtp.serve.metrics import draft_precision_from_metrics, spec_decode_metrics

pytestmark = pytest.mark.engine

START_TIMEOUT_S = 420  # engine start on 2 shared cores (measured ~70 s alone)


def _start(model: str, log: Path, marker: str) -> subprocess.Popen:
    # `python -m vllm_dsv4_mtp.serve.cli` is `dsv4-mtp serve` without the top-level dispatch (tested separately
    # in test_dsv4_mtp_serve_console_script), so a sub-command of another issue cannot block this test. Port 0:
    # the kernel picks a free one as vLLM binds it, read back by bound_port (nothing can take it in between).
    # ``marker`` goes into the environment, which every process the server starts inherits.
    argv = [sys.executable, "-m", "vllm_dsv4_mtp.serve.cli", "--profile", "cpu-tiny", model, "--port", "0"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", DSV4_E2E_MARKER=marker)
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait_healthy(proc: subprocess.Popen, log: Path) -> int:
    """The server's port, once /health answers 200 there."""
    try:
        port = bound_port(proc, START_TIMEOUT_S)
        wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S, exit_status=proc.poll, progress=False)
        return port
    except ServerExitedError as e:
        pytest.fail(f"server exited with {e.status} before becoming healthy:\n{log.read_text()[-6000:]}")
    except ServerNotReadyError:
        proc.kill()
        pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cpu_tiny_serves_completions_and_stops_cleanly(embedded_mxfp4, tmp_path, sig):
    import psutil

    log = tmp_path / "server.log"
    marker = f"{os.getpid()}-{tmp_path.name}"
    proc = _start(str(embedded_mxfp4), log, marker)
    try:
        port = _wait_healthy(proc, log)
        text = log.read_text()
        # the wrapper printed the command it ran, and this process became vLLM's server (exec, same PID)
        assert "-m vllm.entrypoints.launchers.api_server.entry \\\n" in text
        assert f"(APIServer pid={proc.pid})" in text
        server = psutil.Process(proc.pid)
        assert "vllm.entrypoints.launchers.api_server.entry" in " ".join(server.cmdline())
        children = server.children(recursive=True)
        assert any("EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()) for c in children), [
            (c.pid, c.name()) for c in children
        ]

        models = json.loads(get(f"http://127.0.0.1:{port}/v1/models"))
        assert [m["id"] for m in models["data"]] == ["dsv4-tiny"]
        out = post_json(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": "dsv4-tiny", "prompt": "Tom has 3 apples and buys 4 more.", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        choice = out["choices"][0]
        assert isinstance(choice["text"], str)
        assert out["usage"]["completion_tokens"] == 8 or choice["finish_reason"] == "stop"
        assert out["usage"]["prompt_tokens"] > 0

        # the profile's MTP speculative config reached vLLM, and the draft really proposed tokens
        assert '--speculative-config \'{"method":"mtp","num_speculative_tokens":2}\'' in text
        metrics = get(f"http://127.0.0.1:{port}/metrics").decode()
        m = spec_decode_metrics(metrics)
        assert m is not None and m.num_drafts > 0 and m.mean_acceptance_length >= 1.0
        assert draft_precision_from_metrics(metrics) == "bf16"  # the plugin says which draft it runs
    except BaseException:
        proc.kill()
        raise

    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"server did not exit within 90 s of {sig.name}:\n{log.read_text()[-4000:]}")
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], (
        f"left behind after {sig.name}: {[(p.pid, p.name()) for p in alive]}"
    )
    assert rc == 0, f"exit status {rc} after {sig.name}:\n{log.read_text()[-4000:]}"
    assert "Traceback" not in log.read_text().split("Shutting down")[-1]
    leftovers = [
        p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("DSV4_E2E_MARKER") == marker
    ]
    assert not leftovers, [(p.pid, p.name()) for p in leftovers]


def test_dsv4_mtp_serve_console_script(tmp_path):
    """The installed `dsv4-mtp` console script dispatches `serve` (dry run: prints, starts nothing)."""
    exe = Path(sys.executable).parent / "dsv4-mtp"
    r = subprocess.run(
        [str(exe), "serve", "--profile", "cpu-tiny", str(tmp_path), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"  --model {tmp_path} \\\n" in r.stdout
