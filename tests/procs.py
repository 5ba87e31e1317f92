"""Commands that start vLLM engines, run by tests: :func:`run` is ``subprocess.run(capture_output=True,
text=True)`` that, past its timeout, fails the test with what is needed to tell a hang from a slow machine.

``subprocess.run``'s own timeout kills the command alone, leaving its engine core and workers to spin on the
test machine's two cores and slow every later test, and its ``TimeoutExpired`` shows the first line of the
output only. Here the command starts in its own session; past the timeout the test fails with every process
then running on the machine (CPU time, state, command line), the last lines of the command's stdout and
stderr (vLLM's log: where it stopped), and the whole session killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

TAIL = 4000


def run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``argv`` run to completion within ``timeout`` seconds (``kw``: ``env``, ``cwd``); its CompletedProcess."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs = processes()
        _kill_session(p)
        out, err = p.communicate()
        pytest.fail(f"{argv[:4]}... did not finish in {timeout:.0f} s (ran {time.monotonic() - t0:.0f} s; killed "
                    f"with its session)\nload average {os.getloadavg()}; processes at the timeout:\n{procs}\n"
                    f"--- its stdout, last {TAIL} characters:\n{out[-TAIL:]}\n"
                    f"--- its stderr, last {TAIL} characters:\n{err[-TAIL:]}", pytrace=False)
    except BaseException:  # e.g. Ctrl-C: no engine left running either
        _kill_session(p)
        p.wait()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _kill_session(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # the session has already ended
        pass


def processes() -> str:
    """One line per process on the machine: pid, parent, state, CPU seconds, resident MiB, command line."""
    lines = []
    for q in psutil.process_iter(["pid", "ppid", "status", "cpu_times", "memory_info", "cmdline", "name"]):
        i = q.info
        cpu = sum(i["cpu_times"][:2]) if i["cpu_times"] else 0.0
        rss = i["memory_info"].rss / 2**20 if i["memory_info"] else 0.0
        cmd = " ".join(i["cmdline"] or [i["name"] or "?"])[:160]
        lines.append(f"{i['pid']:>7} {i['ppid']:>7} {i['status']:<9} {cpu:>9.1f}s {rss:>7.0f}M  {cmd}")
    return "\n".join(lines)
