"""``tests/procs.py``: an engine command past its timeout fails the test with where it stopped, and leaves no
process of its session behind (``subprocess.run`` kills the command alone)."""

from __future__ import annotations

import sys

import psutil
import pytest
import procs

HANG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", child.pid, flush=True)
print("stuck here", file=sys.stderr, flush=True)
time.sleep(600)
"""


def test_a_hang_fails_with_its_output_and_processes_and_kills_its_session():
    with pytest.raises(pytest.fail.Exception) as e:
        procs.run([sys.executable, "-c", HANG], timeout=5)
    msg = str(e.value)
    assert "did not finish in 5 s" in msg
    assert "stuck here" in msg  # the stderr tail: where it stopped
    pid = int(msg.split("grandchild ", 1)[1].split()[0])
    assert f"{pid} " in msg.split("processes at the timeout:", 1)[1]  # the snapshot was taken before the kill
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=10)  # gone (or reaped) with its session, not left to spin
        psutil.Process(pid).status()


def test_a_finished_command_is_returned_whole():
    r = procs.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                  timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
