"""``make test``'s two workers (``tests/conftest.py:pytest_xdist_make_scheduler``): whole modules each, and the
real-class harness modules one unit, so that no two of them ever run at once."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import procs
from conftest import IN_TREE_HARNESS

TESTS = Path(__file__).parent

MODULE = """
import os, time

def test_{i}a(): _record("a")
def test_{i}b(): _record("b")

def _record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}} {{start}} {{time.monotonic()}}\\n")
"""


def test_the_harness_list_names_every_module_that_runs_the_harness():
    uses = {p.name for p in TESTS.glob("test_*.py") if re.search(r"\brun_worker\(", p.read_text())}
    assert uses == set(IN_TREE_HARNESS)


def _run(tmp_path: Path, schedule: bool) -> dict[str, set[str]]:
    """Two ordinary modules and the harness modules' names, each two 0.3 s tests, on two workers; which workers
    ran each module."""
    for i, name in enumerate([*IN_TREE_HARNESS, "test_plain_one.py", "test_plain_two.py"]):
        (tmp_path / name).write_text(MODULE.format(i=i))
    if schedule:  # the project's hook, nothing else of its conftest
        hook = (
            "import importlib.util, sys\n"
            f"sys.path.insert(0, {str(TESTS)!r})\n"
            f"spec = importlib.util.spec_from_file_location('project_conftest', {str(TESTS / 'conftest.py')!r})\n"
            "project = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(project)\n"
            "pytest_xdist_make_scheduler = project.pytest_xdist_make_scheduler\n"
        )
        (tmp_path / "conftest.py").write_text(hook)
    record = tmp_path / "record.txt"
    p = procs.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", "."],
        env={**os.environ, "RECORD": str(record)},
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    workers: dict[str, set[str]] = {}
    for line in record.read_text().splitlines():
        module, worker, _, _ = line.split()
        workers.setdefault(module + ".py", set()).add(worker)
    return workers


def test_one_worker_runs_the_harness_modules_and_the_other_keeps_working(tmp_path):
    workers = _run(tmp_path, schedule=True)
    harness = set().union(*(workers[m] for m in IN_TREE_HARNESS))
    assert len(harness) == 1, workers
    plain = workers["test_plain_one.py"] | workers["test_plain_two.py"]
    assert plain - harness, f"the other worker ran nothing: {workers}"


def test_without_the_hook_the_harness_modules_spread_over_both_workers(tmp_path):
    """The control: plain ``--dist loadfile`` hands the harness modules to both workers."""
    workers = _run(tmp_path, schedule=False)
    assert len(set().union(*(workers[m] for m in IN_TREE_HARNESS))) == 2, workers
