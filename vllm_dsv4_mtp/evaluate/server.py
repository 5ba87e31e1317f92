"""A vLLM server started through ``dsv4-mtp serve`` for a run of eval / bench / demo, stopped when the run ends.

One server at a time: :class:`ManagedServer` is a context manager that starts
``python -m vllm_dsv4_mtp.serve.cli --profile PROFILE MODEL --port P [overrides]`` (the same wrapper an operator
runs, so the profile's flags and environment apply), waits for ``/health``, and on exit stops it with SIGINT
(vLLM's clean shutdown; the serve wrapper has exec'd into vLLM's server, so the PID is the server's) and, if it
does not exit in time, kills its process group (started in its own session for exactly that).

Without a port given, the server is started with ``--port 0`` and its port is read from the socket it listens
on (:func:`bound_port`): a port found free here and released would be open to any other process during the
10-40 s before vLLM binds it, and ``/health`` answering on it could then be a different server's.

Speculative decoding is chosen per server: ``mtp_k=None`` -> ``--speculative-config null`` (off);
``mtp_k=K`` -> the profile's MTP config with ``num_speculative_tokens`` K.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with the tail of its log."""


class ServerNotReadyError(ServerStartError):
    """A server given by URL did not answer ``/health`` with 200 in the time allowed."""


class ServerExitedError(ServerStartError):
    """The server's process exited before ``/health`` answered 200; ``status`` is its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def free_port() -> int:
    """A loopback port free now (for a URL where no server is meant to answer; a server gets ``--port 0``)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def bound_port(proc: subprocess.Popen, timeout_s: float, poll_s: float = 0.2) -> int:
    """The loopback TCP port that ``proc`` itself listens on, once it listens on exactly one.

    vLLM binds its HTTP socket (``--port 0``: the kernel's choice) before it builds the engine, and the engine's
    workers are other processes whose listening sockets (gloo, ZMQ) are theirs, not ``proc``'s. Raises
    :class:`ServerExitedError` at once if ``proc`` exits, :class:`ServerNotReadyError` after ``timeout_s``
    without a listening socket, :class:`ServerStartError` if it listens on more than one (which one is HTTP
    cannot be told from here).
    """
    import psutil  # a dependency of vLLM, so present wherever a server is started

    t0 = time.monotonic()
    while True:
        status = proc.poll()
        if status is not None:
            raise ServerExitedError(f"process {proc.pid} exited with status {status} before listening", status)
        try:
            ports = sorted(
                {
                    c.laddr.port
                    for c in psutil.Process(proc.pid).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.ip == LOOPBACK
                }
            )
        except psutil.NoSuchProcess:
            ports = []
        if len(ports) == 1:
            return ports[0]
        if len(ports) > 1:
            raise ServerStartError(
                f"process {proc.pid} listens on {len(ports)} loopback ports {ports}, expected one (its HTTP server's)"
            )
        if time.monotonic() - t0 >= timeout_s:
            raise ServerNotReadyError(f"process {proc.pid} was not listening on {LOOPBACK} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def spec_label(mtp_k: int | None) -> str:
    return "MTP off" if mtp_k is None else f"MTP K={mtp_k}"


@dataclass
class ServerSpec:
    """What to serve: a checkpoint directory, MTP off (None) or K draft tokens, and extra vLLM flags.

    ``served_model_name=None`` keeps the profile's (``cpu-tiny``: ``dsv4-tiny``; the MI355X profiles: the
    model id); read the name a server answers to with :func:`served_model_name`.
    """

    model: str
    mtp_k: int | None = None
    profile: str = "cpu-tiny"
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def serve_argv(self, port: int) -> list[str]:
        spec = (
            ["--speculative-config", "null"]
            if self.mtp_k is None
            else ["--speculative-config.num_speculative_tokens", str(self.mtp_k)]
        )
        name = [] if self.served_model_name is None else ["--served-model-name", self.served_model_name]
        return [
            sys.executable,
            "-m",
            "vllm_dsv4_mtp.serve.cli",
            "--profile",
            self.profile,
            str(self.model),
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            *name,
            *spec,
            *self.extra_args,
        ]


class ManagedServer:
    """``with ManagedServer(spec) as srv: srv.base_url ...`` (see the module docstring)."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 90.0,
        quiet: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.env = dict(env or {})  # on top of this process's environment, for the server only
        self.given_port = port
        self.port = port  # None until start() reads the port the server bound (see the module docstring)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="dsv4-serve-")) / "server.log"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.quiet = quiet
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (append ``/v1`` for the OpenAI API, ``/metrics`` for Prometheus)."""
        if self.port is None:
            raise RuntimeError("the server's port is known once start() has returned")
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> ManagedServer:
        self.port = self.given_port
        argv = self.spec.serve_argv(self.port or 0)
        env = dict(os.environ) | self.env
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        if not self.quiet:
            print(
                f"# starting {spec_label(self.spec.mtp_k)} server: {' '.join(argv[1:])}\n#   log: {self.log_path}",
                file=sys.stderr,
                flush=True,
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.monotonic()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        if not self.quiet:
            print(f"# server ready on {self.base_url} after {self.startup_s:.0f} s", file=sys.stderr, flush=True)
        return self

    def _wait_healthy(self) -> None:
        what = f"the {spec_label(self.spec.mtp_k)} server for {self.spec.model}"
        t0 = time.monotonic()
        try:
            if self.port is None:
                self.port = bound_port(self.proc, self.start_timeout_s)
            wait_healthy(
                self.base_url,
                max(0.0, self.start_timeout_s - (time.monotonic() - t0)),
                poll_s=1.0,
                exit_status=self.proc.poll,
                progress=False,
            )
        except ServerExitedError as e:
            raise ServerStartError(
                f"{what} exited with status {e.status} before becoming healthy; log {self.log_path}:\n{self.log_tail()}"
            ) from None
        except ServerNotReadyError:
            raise ServerStartError(
                f"{what} was not healthy after {self.start_timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
            ) from None
        except ServerStartError as e:  # bound_port found more than one listening socket
            raise ServerStartError(f"{what}: {e}; log {self.log_path}:\n{self.log_tail()}") from None

    def stop(self) -> int | None:
        """SIGINT, then SIGKILL to the process group if it does not exit within ``stop_timeout_s``."""
        p, self.proc = self.proc, None
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # vLLM's engine-core child shares the session; make sure none is left behind
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(
    base_url: str,
    timeout_s: float = 0.0,
    poll_s: float = 2.0,
    *,
    exit_status: Callable[[], int | None] | None = None,
    progress: bool = True,
) -> None:
    """Return once ``GET /health`` answers 200; try once (``timeout_s=0``) or keep trying for ``timeout_s``
    seconds (a server still loading its model), saying every minute that it is waiting (``progress``).

    ``exit_status`` (e.g. ``Popen.poll``: None while the server's process runs, its exit status once it has
    exited) makes a server that crashed while loading fail at once with :class:`ServerExitedError` instead of
    after the whole timeout; otherwise :class:`ServerNotReadyError` once the time is up.
    """
    url = server_root(base_url) + "/health"
    t0 = said = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        status = None if exit_status is None else exit_status()
        if status is not None:
            raise ServerExitedError(f"the server for {url} exited with status {status} before becoming healthy", status)
        now = time.monotonic()
        if now - t0 >= timeout_s:
            waited = f" after waiting {timeout_s:.0f} s" if timeout_s else ""
            raise ServerNotReadyError(f"cannot reach {url}{waited}: {last}")
        if progress and now - said >= 60:
            print(f"# waiting for {url} ({now - t0:.0f} of {timeout_s:.0f} s): {last}", file=sys.stderr, flush=True)
            said = now
        time.sleep(poll_s)


def served_model_name(base_url: str, timeout: float = 10.0) -> str:
    """The first model id ``/v1/models`` lists."""
    with urllib.request.urlopen(api_root(base_url) + "/models", timeout=timeout) as r:
        data = json.loads(r.read())
    models = [m["id"] for m in data.get("data", [])]
    if not models:
        raise RuntimeError(f"{api_root(base_url)}/models lists no model")
    return models[0]


def api_root(base_url: str) -> str:
    """``http://host:port/v1`` from ``http://host:port``, ``.../v1`` or ``.../v1/completions``."""
    url = base_url.rstrip("/")
    for suffix in ("/completions", "/chat/completions"):
        if url.endswith("/v1" + suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


def server_root(base_url: str) -> str:
    """``http://host:port`` from any of the forms :func:`api_root` accepts."""
    return api_root(base_url)[: -len("/v1")]
