"""End to end: `dsv4-mtp serve --profile cpu-tiny` serves a tiny DeepSeek-V4 on CPU through vLLM's OpenAI server,
answers /v1/completions, exports /metrics, and stops cleanly on SIGINT and on SIGTERM with no process left.

The model is the embedded model in MXFP4: the shipped MXFP4 checkpoint when it is built, else the shipped BF16
checkpoint quantized here by ``quant/`` (what ``make demo`` serves), else, on a checkout that does not carry
the embedded assets yet, a random tiny MXFP4 checkpoint from the tiny builder. The profile's MTP speculative
config is always kept: the server must draft with the plugin's ``DeepSeekV4MTPModel`` and export spec-decode
counters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_dsv4_mtp.evaluate.server import free_port
from vllm_dsv4_mtp.serve.metrics import spec_decode_metrics

pytestmark = pytest.mark.engine

START_TIMEOUT_S = 420  # engine start on 2 shared cores (measured ~70 s alone)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR

    if (MXFP4_CHECKPOINT_DIR / "config.json").is_file():
        return str(MXFP4_CHECKPOINT_DIR)
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    if (BF16_CHECKPOINT_DIR / "config.json").is_file():
        from vllm_dsv4_mtp.quant.quantize import quantize_checkpoint

        quantize_checkpoint(BF16_CHECKPOINT_DIR, out, progress=False)
        return str(out)
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(out, experts="mxfp4"))


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _start(model: str, port: int, log: Path) -> subprocess.Popen:
    # `python -m vllm_dsv4_mtp.serve.cli` is `dsv4-mtp serve` without the top-level dispatch (tested separately
    # in test_dsv4_mtp_serve_console_script), so a sub-command of another issue cannot block this test.
    argv = [sys.executable, "-m", "vllm_dsv4_mtp.serve.cli", "--profile", "cpu-tiny", model, "--port", str(port)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} before becoming healthy:\n{log.read_text()[-6000:]}")
        try:
            if _get(f"http://127.0.0.1:{port}/health", timeout=2) is not None:
                return
        except OSError:
            time.sleep(2)
    proc.kill()
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cpu_tiny_serves_completions_and_stops_cleanly(tiny_model, tmp_path, sig):
    import psutil

    port = free_port()
    log = tmp_path / "server.log"
    proc = _start(tiny_model, port, log)
    try:
        _wait_healthy(proc, port, log)
        text = log.read_text()
        # the wrapper printed the command it ran, and this process became vLLM's server (exec, same PID)
        assert "-m vllm.entrypoints.launchers.api_server.entry \\\n" in text
        assert f"(APIServer pid={proc.pid})" in text
        server = psutil.Process(proc.pid)
        assert "vllm.entrypoints.launchers.api_server.entry" in " ".join(server.cmdline())
        children = server.children(recursive=True)
        assert any("EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()) for c in children), \
            [(c.pid, c.name()) for c in children]

        models = json.loads(_get(f"http://127.0.0.1:{port}/v1/models"))
        assert [m["id"] for m in models["data"]] == ["dsv4-tiny"]
        out = _post(f"http://127.0.0.1:{port}/v1/completions",
                    {"model": "dsv4-tiny", "prompt": "Tom has 3 apples and buys 4 more.", "max_tokens": 8,
                     "temperature": 0})
        choice = out["choices"][0]
        assert isinstance(choice["text"], str)
        assert out["usage"]["completion_tokens"] == 8 or choice["finish_reason"] == "stop"
        assert out["usage"]["prompt_tokens"] > 0

        # the profile's MTP speculative config reached vLLM, and the draft really proposed tokens
        assert '--speculative-config \'{"method":"mtp","num_speculative_tokens":2}\'' in text
        m = spec_decode_metrics(_get(f"http://127.0.0.1:{port}/metrics").decode())
        assert m is not None and m.num_drafts > 0 and m.mean_acceptance_length >= 1.0
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
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], \
        f"left behind after {sig.name}: {[(p.pid, p.name()) for p in alive]}"
    assert rc == 0, f"exit status {rc} after {sig.name}:\n{log.read_text()[-4000:]}"
    assert "Traceback" not in log.read_text().split("Shutting down")[-1]
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and f"--port {port}" in " ".join(p.info["cmdline"])]
    assert not leftovers


def test_dsv4_mtp_serve_console_script(tmp_path):
    """The installed `dsv4-mtp` console script dispatches `serve` (dry run: prints, starts nothing)."""
    exe = Path(sys.executable).parent / "dsv4-mtp"
    r = subprocess.run([str(exe), "serve", "--profile", "cpu-tiny", str(tmp_path), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"  --model {tmp_path} \\\n" in r.stdout
