"""``dsv4-mtp quantize --force`` over a good output, killed with SIGKILL at every step: DST is always a complete
checkpoint (the old one, or the complete new one), and the next run leaves nothing behind.

How a run is stopped exactly between two publishing steps: ``$DSV4_MTP_QUANTIZE_CRASH_AT`` names a point at which
the process SIGKILLs itself (quant/publish.py, ``crash_point``). A kill timed from outside cannot land reliably
between two syscalls a few microseconds apart, and a debugger (gdb / strace syscall injection) would stop at
syscalls, not at the named steps, and add a tool the tests depend on. The timed kills below complement it with
points nobody chose.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader, validate_shard_headers
from vllm_dsv4_mtp.quant.publish import CRASH_ENV
from vllm_dsv4_mtp.quant.quantize import quantize_checkpoint
from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
# the old output keeps the shared experts BF16; the new one quantizes them: two different complete checkpoints
NEW_ARGS = ["--shared-experts", "mxfp4"]


def _fingerprint(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".dst."))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    w = tmp_path_factory.mktemp("crash-refs")
    src = build_tiny_checkpoint(w / "src", seed=5, max_shard_bytes=2**20)
    quantize_checkpoint(src, w / "old", progress=False)
    quantize_checkpoint(src, w / "new", shared_experts="mxfp4", progress=False)
    old, new = _fingerprint(w / "old"), _fingerprint(w / "new")
    assert old != new
    return {"src": src, "old_dir": w / "old", "old": old, "new": new, "n_tensors": len(CheckpointReader(src))}


def _run(
    refs,
    parent: Path,
    *,
    crash_at: str | None = None,
    no_exchange: bool = False,
    kill_after: float = None,
    signal_at: tuple[str, int] | None = None,
) -> tuple[int, str]:
    """One ``dsv4-mtp quantize --force SRC parent/dst`` in a subprocess; returns its exit status and stderr.

    ``signal_at=(point, signum)``: the process sends itself that signal at that crash point (a test-side patch,
    so the signal arrives at a known step while the tool's real handlers run)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    prelude = ""
    if no_exchange:  # a filesystem without RENAME_EXCHANGE, forced by the test, not by a switch in the tool
        prelude += "import vllm_dsv4_mtp.quant.publish as p; p._exchange = lambda a, b: False\n"
    if signal_at:
        prelude += (
            f"import os, vllm_dsv4_mtp.quant.publish as p, vllm_dsv4_mtp.quant.quantize as q\n"
            f"def at(name):\n    if name == {signal_at[0]!r}: os.kill(os.getpid(), {int(signal_at[1])})\n"
            f"p.crash_point = q.crash_point = at\n"
        )
    code = prelude + "import sys; from vllm_dsv4_mtp.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [
        sys.executable,
        "-c",
        code,
        "quantize",
        str(refs["src"]),
        str(parent / "dst"),
        "--force",
        "--no-progress",
        *NEW_ARGS,
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    if crash_at:
        assert proc.returncode == -signal.SIGKILL, err  # the crash point was reached
    return proc.returncode, err


def _assert_complete(dst: Path, refs) -> str:
    """DST is one of the two complete checkpoints, and loads: headers, reader, inspect, every tensor's data."""
    fp = _fingerprint(dst)
    which = "old" if fp == refs["old"] else "new" if fp == refs["new"] else None
    assert which, sorted(fp)
    validate_shard_headers(dst)
    assert inspect_checkpoint(dst).ok
    r = CheckpointReader(dst)
    for name in r:
        r.get(name)
    return which


def _next_run_cleans_up(parent: Path, refs, left: list[str]) -> None:
    report = quantize_checkpoint(refs["src"], parent / "dst", shared_experts="mxfp4", force=True, progress=False)
    assert _leftovers(parent) == []
    assert _fingerprint(parent / "dst") == refs["new"]
    for name in left:  # every leftover was reported, none silently removed
        assert any(name in w for w in report.warnings), (name, report.warnings)


def _fresh(tmp_path: Path, refs) -> Path:
    parent = tmp_path / "out"
    shutil.rmtree(parent, ignore_errors=True)
    parent.mkdir()
    shutil.copytree(refs["old_dir"], parent / "dst")
    return parent


# (crash point, what DST must be right after the kill, whether the run's hidden work directory is left behind)
POINTS = [
    ("swept", "old", False),
    ("tensor:0", "old", True),
    ("tensor:MID", "old", True),
    ("tensor:LAST", "old", True),
    ("written", "old", True),
    ("verified", "old", True),
    ("synced", "old", True),
    ("exchanged", "new", True),
    ("removing-old", "new", True),
    ("done", "new", False),
]


@pytest.mark.parametrize("point,expected,leaves", POINTS)
def test_sigkill_at_each_step_leaves_a_complete_dst(tmp_path, refs, point, expected, leaves):
    n = refs["n_tensors"]
    point = point.replace("MID", str(n // 2)).replace("LAST", str(n - 1))
    parent = _fresh(tmp_path, refs)
    _run(refs, parent, crash_at=point)
    assert _assert_complete(parent / "dst", refs) == expected
    left = _leftovers(parent)
    assert [n.split("-")[0] for n in left] == ([".dst.partial"] if leaves else []), left
    _next_run_cleans_up(parent, refs, left)


def test_sigkill_at_random_times(tmp_path, refs):
    """Kills at moments nobody chose (seeded fractions of an uninterrupted run's wall time): whatever the run was
    doing, DST is old or new, never broken, and the next run cleans up."""
    parent = _fresh(tmp_path, refs)
    t0 = time.monotonic()
    _run(refs, parent, crash_at="done")
    duration = time.monotonic() - t0
    rng = random.Random(11)
    seen = []
    for frac in sorted(rng.uniform(0.4, 1.0) for _ in range(5)):
        parent = _fresh(tmp_path, refs)
        rc, _ = _run(refs, parent, kill_after=frac * duration)
        seen.append(_assert_complete(parent / "dst", refs) if rc else "finished")
        _next_run_cleans_up(parent, refs, _leftovers(parent))
    print(f"\nkills at random times over a {duration:.1f} s run found DST: {seen}")


def test_without_atomic_exchange_the_next_run_restores_dst(tmp_path, refs):
    """A filesystem without RENAME_EXCHANGE: the two-rename fallback has a window without DST; a kill inside it
    leaves the previous output under a hidden name, and the next run puts it back before doing anything else."""
    parent = _fresh(tmp_path, refs)
    _run(refs, parent, crash_at="moved-aside", no_exchange=True)
    assert not (parent / "dst").exists()
    left = _leftovers(parent)
    assert sorted(n.split("-")[0] for n in left) == [".dst.old", ".dst.partial"], left
    _next_run_cleans_up(parent, refs, left)
    # killed after the second rename: DST is already the new output
    parent = _fresh(tmp_path, refs)
    _run(refs, parent, crash_at="published", no_exchange=True)
    assert _assert_complete(parent / "dst", refs) == "new"
    _next_run_cleans_up(parent, refs, _leftovers(parent))


def test_leftovers_of_the_old_two_rename_scheme_are_recovered(tmp_path, refs, capsys):
    """What earlier versions left after a kill between their two renames (the issue's state): no DST, the good
    output in .dst.old-PID, the finished new one in .dst.partial-PID. The previous output comes back, even on a
    run that then refuses to replace it (no --force), and both leftovers are reported."""
    from vllm_dsv4_mtp.quant.quantize import QuantizeError

    parent = tmp_path / "out"
    parent.mkdir()
    shutil.copytree(refs["old_dir"], parent / ".dst.old-4194301")
    shutil.copytree(refs["old_dir"], parent / ".dst.partial-4194301")
    with pytest.raises(QuantizeError, match=r"dst: already exists and is not empty; pass --force"):
        quantize_checkpoint(refs["src"], parent / "dst", progress=False)
    assert _fingerprint(parent / "dst") == refs["old"]
    assert _leftovers(parent) == []
    mib = sum(f.stat().st_size for f in refs["old_dir"].iterdir()) / 2**20
    assert capsys.readouterr().err.splitlines() == [
        f"dsv4-mtp quantize: {parent / 'dst'}: restored the previous output from .dst.old-4194301, left by a run "
        f"(pid 4194301) interrupted while replacing it",
        f"dsv4-mtp quantize: {parent / '.dst.partial-4194301'}: removed ({mib:.1f} MiB), left by an interrupted run "
        f"(pid 4194301)",
    ]


@pytest.mark.parametrize(
    "sig,point,expected",
    [
        (signal.SIGTERM, "tensor:MID", "old"),
        (signal.SIGINT, "tensor:MID", "old"),
        (signal.SIGHUP, "written", "old"),
        (signal.SIGTERM, "exchanged", "new"),
        (signal.SIGTERM, "removing-old", "new"),
    ],
)
def test_sigterm_is_handled_like_sigint(tmp_path, refs, sig, point, expected):
    """SIGTERM / SIGHUP clean up like Ctrl-C: no leftover, DST as it was, exit status 128 + signal, one line.
    A signal during publishing waits until DST is the complete new output, and the message says so."""
    parent = _fresh(tmp_path, refs)
    rc, err = _run(refs, parent, signal_at=(point.replace("MID", str(refs["n_tensors"] // 2)), sig))
    assert rc == 128 + sig, err
    assert _assert_complete(parent / "dst", refs) == expected
    assert _leftovers(parent) == []
    name = signal.Signals(sig).name
    state = (
        f"the partial output was removed, {parent / 'dst'} is unchanged"
        if expected == "old"
        else f"the conversion had finished: {parent / 'dst'} is the complete new output"
    )
    assert err.strip().splitlines() == [f"dsv4-mtp quantize: interrupted by {name}: {state}"]
