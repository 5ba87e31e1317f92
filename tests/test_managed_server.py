"""How :class:`ManagedServer` finds its server's port: ``--port 0`` and the socket the server's own process
listens on, never a port found free beforehand (another process can take that one while vLLM loads, and a
``/health`` answering there would be someone else's). A stand-in server (a few lines of ``http.server``) plays
vLLM here; the real one goes through the same path in every test that uses the ``start_server`` fixture.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from vllm_dsv4_mtp.evaluate.server import (
    ManagedServer,
    ServerExitedError,
    ServerNotReadyError,
    ServerSpec,
    ServerStartError,
    bound_port,
)

# Binds --port after a delay (as vLLM does after parsing its arguments), starts a child that listens on a
# loopback port of its own (as vLLM's workers do for gloo / ZMQ), and answers /health with its own port.
# SIGINT ends it as it ends vLLM's server, which installs its own handler: a Python started with SIGINT ignored (a
# backgrounded or CI shell) would not raise KeyboardInterrupt, and each stop would wait out the 90 s stop timeout.
FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    extra = int(sys.argv[sys.argv.index("--extra-listeners") + 1]) if "--extra-listeners" in sys.argv else 0
    child = subprocess.Popen([sys.executable, "-c",
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); time.sleep(600)"])
    time.sleep(1.0)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = str(self.server.server_address[1]).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    others = [__import__("socket").create_server(("127.0.0.1", 0)) for _ in range(extra)]
    print("bound", srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    finally:
        child.kill()
""")


ON_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


class FakeSpec(ServerSpec):
    def __init__(self, *extra: str) -> None:
        super().__init__(model="fake", mtp_k=None)
        self.extra = list(extra)
        self.argv: list[str] | None = None

    def serve_argv(self, port: int) -> list[str]:
        self.argv = [sys.executable, "-c", FAKE_SERVER, "--port", str(port), *self.extra]
        return self.argv


class _Decoy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"decoy")

    def log_message(self, *a):
        pass


@pytest.fixture
def decoy():
    """An HTTP server answering 200 to everything on a loopback port (someone else's server)."""
    srv = HTTPServer(("127.0.0.1", 0), _Decoy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_managed_server_reads_the_port_its_server_bound(tmp_path, decoy):
    spec = FakeSpec()
    srv = ManagedServer(spec, log_path=tmp_path / "server.log", quiet=True, start_timeout_s=60)
    assert srv.port is None
    with pytest.raises(RuntimeError, match="known once start"):
        _ = srv.base_url
    with srv:
        assert spec.argv[spec.argv.index("--port") + 1] == "0"
        bound = int((tmp_path / "server.log").read_text().split()[1])
        assert srv.port == bound != decoy
        with urllib.request.urlopen(srv.base_url + "/health", timeout=10) as r:
            assert r.read() == str(bound).encode()
    assert srv.proc is None
    # a second start binds afresh: the port read last time is not reused
    with srv:
        assert srv.port == int((tmp_path / "server.log").read_text().split()[1])


def test_managed_server_keeps_an_explicit_port(tmp_path):
    import socket

    with socket.socket() as s:  # free now; nothing else on this test's machine is told to use it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = FakeSpec()
    with ManagedServer(spec, port=port, log_path=tmp_path / "server.log", quiet=True, start_timeout_s=60) as srv:
        assert spec.argv[spec.argv.index("--port") + 1] == str(port) and srv.port == port
        with urllib.request.urlopen(srv.base_url + "/health", timeout=10) as r:
            assert r.read() == str(port).encode()


def test_bound_port_ignores_children_and_refuses_ambiguity(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, "--port", "0", "--extra-listeners", "1"], stdout=subprocess.PIPE, text=True
    )
    try:
        # the HTTP socket and one more, both the process's own: which one serves HTTP cannot be told
        with pytest.raises(ServerStartError, match=rf"^process {proc.pid} listens on 2 loopback ports "):
            bound_port(proc, 30)
    finally:
        proc.kill()
        proc.wait()


def test_bound_port_fails_fast_on_exit_and_after_its_timeout():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    t0 = time.monotonic()
    with pytest.raises(ServerExitedError, match=rf"^process {proc.pid} exited with status 4 before listening$") as e:
        bound_port(proc, 300)
    assert e.value.status == 4 and time.monotonic() - t0 < 60
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(
            ServerNotReadyError, match=rf"^process {proc.pid} was not listening on 127.0.0.1 after 1 s$"
        ):
            bound_port(proc, 1)
    finally:
        proc.kill()
        proc.wait()


def test_managed_server_reports_a_server_that_never_listens(tmp_path):
    class Silent(FakeSpec):
        def serve_argv(self, port: int) -> list[str]:
            return [sys.executable, "-c", f"{ON_SIGINT}; print('loading'); import time; time.sleep(60)"]

    srv = ManagedServer(Silent(), log_path=tmp_path / "server.log", quiet=True, start_timeout_s=2)
    with pytest.raises(
        ServerStartError, match=r"^the MTP off server for fake was not healthy after 2 s; log .*\nloading"
    ):
        srv.start()
    assert srv.proc is None


def test_managed_server_refuses_a_server_listening_on_two_ports(tmp_path):
    srv = ManagedServer(
        FakeSpec("--extra-listeners", "1"), log_path=tmp_path / "server.log", quiet=True, start_timeout_s=60
    )
    with pytest.raises(
        ServerStartError,
        match=r"^the MTP off server for fake: process \d+ listens on 2 loopback "
        rf"ports \[\d+, \d+\], expected one \(its HTTP server's\); log "
        rf"{tmp_path / 'server.log'}:\nbound \d+",
    ):
        srv.start()
    assert srv.proc is None
