"""``tests/procs.py``: an engine command past its timeout fails the test with where it stopped, and leaves no
process it started behind, in its session or in one a descendant started (``subprocess.run`` kills the command
alone)."""

from __future__ import annotations

import re
import sys

import procs
import psutil
import pytest

# a command that hangs, with one child in its session and one in a session of its own (as ManagedServer starts a
# server); it says so before hanging
HANG = """
import subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
a = subprocess.Popen(sleep)
b = subprocess.Popen(sleep, start_new_session=True)
print("children", a.pid, b.pid, flush=True)
print("stuck here", file=sys.stderr, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Killed: no such process, or a zombie left for init to reap (``wait`` on a process that is not this one's
    child returns once its pid no longer exists, and a zombie's still does)."""
    try:
        psutil.Process(pid).wait(timeout=10)
        return True
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_hang_fails_with_its_output_and_processes_and_kills_all_it_started():
    with pytest.raises(pytest.fail.Exception) as e:
        procs.run([sys.executable, "-c", HANG], timeout=8)
    msg = str(e.value)
    assert "did not finish in 8 s" in msg
    assert "stuck here" in msg  # the stderr tail: where it stopped
    pids = [int(x) for x in re.search(r"children (\d+) (\d+)", msg).groups()]
    snapshot = msg.split("processes at the timeout:", 1)[1].split("--- its stdout", 1)[0]
    for pid in pids:
        assert re.search(rf"^\s*{pid}\s", snapshot, re.M), pid  # the snapshot was taken before the kill
        assert _gone(pid), pid  # not left to spin


def test_a_finished_command_is_returned_whole():
    r = procs.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], timeout=60
    )
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
