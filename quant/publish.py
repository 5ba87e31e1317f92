"""Where ``dsv4-mtp quantize`` writes, and how the result replaces DST: never a moment without a complete DST.

A run writes into ``.DST.partial-PID`` next to DST, a directory it holds an exclusive ``flock`` on for as long
as it lives (the kernel drops the lock when the process dies, even by SIGKILL). Once complete, the output is
flushed to disk (fsync of every file and of the directory). Publishing, with SIGINT / SIGTERM / SIGHUP deferred
until it is done (SIGKILL cannot be deferred, and needs nothing: every step below is safe to die after):

- DST absent: one ``rename`` (atomic);
- DST present (``--force``): one ``renameat2(RENAME_EXCHANGE)`` swaps the two directories atomically (Linux
  >= 3.15; ext4, xfs, btrfs, tmpfs, ...), so DST is the old output until that call and the new one after it;
  the old output, now under the hidden name, is removed afterwards. Where the filesystem cannot exchange, a
  two-step fallback (DST -> ``.DST.old-PID``, then the new output -> DST) leaves a window without DST, which
  the next run closes (see below).

Before writing, :func:`sweep` looks at every ``.DST.partial-*`` / ``.DST.old-*`` next to DST: one still locked
belongs to a live run (an error: two runs must not write the same DST); any other is a leftover of an
interrupted run and is removed, except an ``.old-*`` while DST is missing (the fallback, or the two-rename
scheme of earlier versions, was interrupted between its renames): that is the previous output, and it is
renamed back to DST. Every such action is reported.

``DSV4_MTP_QUANTIZE_CRASH_AT=<point>`` makes the process SIGKILL itself at a named point (see
:func:`crash_point`): the crash test of ``tests/test_quantize_crash.py`` uses it to stop a run exactly between
two publishing steps, which no timing-based kill can hit reliably. Unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "Busy",
    "Interrupted",
    "WorkDir",
    "sweep",
    "sync_tree",
    "publish",
    "discard",
    "crash_point",
    "signals_interrupt",
    "signals_deferred",
    "CRASH_ENV",
]

CRASH_ENV = "DSV4_MTP_QUANTIZE_CRASH_AT"
_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV)


class Busy(RuntimeError):
    """Another live ``dsv4-mtp quantize`` is writing the same DST."""


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM / SIGHUP during a conversion; ``signum`` says which (the exit status is 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``$DSV4_MTP_QUANTIZE_CRASH_AT`` names this point (crash tests only)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# the handler's state: the signals seen, and whether they wait (publishing) or raise at once
_state = {"seen": [], "deferring": False}


@contextmanager
def signals_interrupt():
    """Within the block, SIGTERM and SIGHUP raise :class:`Interrupted` like Ctrl-C (SIGINT) does, so the
    conversion's cleanup runs; a second signal while cleaning up is ignored. Main thread only (elsewhere
    Python cannot install handlers, and the block changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        first = not _state["seen"]
        _state["seen"].append(signum)
        if first and not _state["deferring"]:
            raise Interrupted(signum)

    _state.update(seen=[], deferring=False)
    old = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def signals_deferred():
    """Within a :func:`signals_interrupt` block: a signal arriving inside this one is raised only when it ends,
    so publishing runs to completion and an interrupt never leaves its outcome in doubt. (Python runs signal
    handlers in the main thread whichever thread the kernel picked, so a flag suffices where a signal mask,
    which is per thread, would not.)"""
    _state["deferring"] = True
    try:
        yield
    finally:
        _state["deferring"] = False
    if _state["seen"]:
        raise Interrupted(_state["seen"][0])


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on directory ``path``; None when another process holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class WorkDir:
    """``.DST.partial-PID``: created empty and locked; :meth:`close` releases the lock."""

    def __init__(self, dst: Path):
        self.path = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        if self.path.exists():  # our own PID's leftover of a dead run (PIDs are reused): not locked by anyone
            shutil.rmtree(self.path)
        self.path.mkdir()
        self._fds = [_lock(self.path)]

    def hold(self, path: Path) -> None:
        """Also lock ``path`` (the old DST, which the exchange moves under our hidden name)."""
        fd = _lock(path)
        if fd is None:
            raise Busy(f"{path}: locked by another dsv4-mtp quantize, which is replacing it now")
        self._fds.append(fd)

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                os.close(fd)
        self._fds = []


def _leftover_pattern(dst: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(dst.name)}\.(partial|old)-(\d+)$")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def sweep(dst: Path) -> list[str]:
    """Deal with the leftovers of interrupted runs next to DST (see the module docstring); returns one line per
    leftover handled. Raises :class:`Busy` when a live run is writing the same DST."""
    notes: list[str] = []
    if not dst.parent.is_dir():
        return notes
    pattern = _leftover_pattern(dst)
    found = sorted((p for p in dst.parent.iterdir() if pattern.match(p.name)), key=lambda p: p.name)
    for p in found:
        kind, pid = pattern.match(p.name).groups()
        fd = _lock(p) if p.is_dir() else None
        if p.is_dir() and fd is None:
            raise Busy(
                f"{dst}: another dsv4-mtp quantize (pid {pid}) is writing it now ({p} is locked); "
                f"wait for it to finish or stop it"
            )
        try:
            if kind == "old" and not dst.exists() and p.is_dir():
                os.rename(p, dst)
                notes.append(
                    f"{dst}: restored the previous output from {p.name}, left by a run (pid {pid}) "
                    f"interrupted while replacing it"
                )
                continue
            mib = _size(p) / 2**20 if p.is_dir() else p.stat().st_size / 2**20
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            notes.append(f"{p}: removed ({mib:.1f} MiB), left by an interrupted run (pid {pid})")
        finally:
            if fd is not None:
                os.close(fd)
    return notes


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap directory entries ``a`` and ``b``; False where the system or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def sync_tree(path: Path) -> None:
    """Flush every file of ``path`` and the directory itself, so that what is published survives a power loss."""
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """``rm -r`` with a crash point after the first file (a run killed mid-removal leaves a partial tree)."""
    files = [f for f in path.iterdir() if f.is_file()]
    if files:
        files[0].unlink()
        crash_point("removing-old")
    shutil.rmtree(path, ignore_errors=True)


def publish(work: WorkDir, dst: Path) -> bool:
    """Make the finished (and :func:`sync_tree`-flushed) ``work.path`` DST. Returns True when the replacement
    was atomic (or DST was new). Run it under :func:`signals_deferred`."""
    tmp = work.path
    if not dst.exists():
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        crash_point("published")
        return True
    work.hold(dst)
    if _exchange(tmp, dst):
        _fsync_dir(dst.parent)
        crash_point("exchanged")
        _remove(tmp)  # the old output, now under the hidden name
        return True
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"  # fallback: a window the next run's sweep closes
    os.rename(dst, old)
    crash_point("moved-aside")
    os.rename(tmp, dst)
    _fsync_dir(dst.parent)
    crash_point("published")
    _remove(old)
    return False


def discard(work: WorkDir, dst: Path) -> None:
    """After a failure or an interrupt: put a moved-aside DST back if the fallback was cut between its renames,
    then remove what this run wrote (or the old output that an exchange already moved under its hidden name)."""
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if old.is_dir() and not dst.exists():
        os.rename(old, dst)
    shutil.rmtree(work.path, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    work.close()
