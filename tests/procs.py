"""Commands that start vLLM engines, run by tests: :func:`run` is ``subprocess.run(capture_output=True,
text=True)`` that, past its timeout, fails the test with what is needed to tell a hang from a slow machine.

``subprocess.run``'s own timeout kills the command alone, leaving its engine core and workers to spin on the
test machine's two cores and slow every later test, and its ``TimeoutExpired`` shows the first line of the
output only. Here the command starts in a session of its own; past the timeout the test fails with every
process then running on the machine (CPU time, state, command line), the last lines of the command's stdout and
stderr (vLLM's log: where it stopped), and everything the command started is killed: its session, and the
sessions of its descendants (``dsv4-mtp demo`` starts its servers in sessions of their own).
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
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                snapshot = processes()
            finally:
                kill_all(p.pid)
            out, err = _read_rest(p)
            pytest.fail(
                f"{argv[:4]}... did not finish in {timeout:.0f} s (ran {time.monotonic() - t0:.0f} s; "
                f"killed with everything it started)\nload average {os.getloadavg()}; processes at the "
                f"timeout:\n{snapshot}\n--- its stdout, last {TAIL} characters:\n{out[-TAIL:]}\n"
                f"--- its stderr, last {TAIL} characters:\n{err[-TAIL:]}",
                pytrace=False,
            )
        except BaseException:  # e.g. Ctrl-C: no engine left running either
            kill_all(p.pid)
            raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def kill_all(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and of each of its descendants (taken before any is killed)."""
    try:
        groups = {pid} | {os.getpgid(c.pid) for c in psutil.Process(pid).children(recursive=True)}
    except (psutil.Error, ProcessLookupError):  # gone, or a child gone while listing: kill what is known
        groups = {pid}
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_rest(p: subprocess.Popen) -> tuple[str, str]:
    """The killed command's output (what was read so far, if something outside its groups holds the pipes)."""
    try:
        return p.communicate(timeout=30)
    except subprocess.TimeoutExpired as e:
        return tuple(b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.output, e.stderr))


def processes() -> str:
    """One line per process on the machine: pid, parent, state, CPU seconds, resident MiB, command line."""
    lines = []
    try:
        for q in psutil.process_iter(["pid", "ppid", "status", "cpu_times", "memory_info", "cmdline", "name"]):
            i = q.info
            cpu = sum(i["cpu_times"][:2]) if i["cpu_times"] else 0.0
            rss = i["memory_info"].rss / 2**20 if i["memory_info"] else 0.0
            cmd = " ".join(i["cmdline"] or [i["name"] or "?"])[:160]
            lines.append(f"{i['pid']:>7} {i['ppid']!s:>7} {i['status'] or '?':<9} {cpu:>9.1f}s {rss:>7.0f}M  {cmd}")
    except Exception as e:  # the snapshot is evidence, never the failure itself
        lines.append(f"(process list cut short: {e!r})")
    return "\n".join(lines)
