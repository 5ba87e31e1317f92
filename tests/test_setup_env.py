"""scripts/setup_env.sh refuses to set up a .venv on a disk without room for it, naming the folder and the need.

A CI run once ended in pip's bare "No space left on device" half-way through installing torch; the check runs
before anything is written, also when such a run left a .venv without its ``.setup-done`` stamp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_of_the_script(tmp_path) -> Path:
    (tmp_path / "scripts").mkdir()
    return Path(shutil.copy(ROOT / "scripts" / "setup_env.sh", tmp_path / "scripts" / "setup_env.sh"))


def _run(script: Path, free_gb: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script)],
        env=dict(os.environ, DSV4_SETUP_FREE_GB=free_gb),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("half_made_venv", [False, True])
def test_setup_stops_before_writing_when_the_disk_lacks_room(tmp_path, half_made_venv):
    script = _copy_of_the_script(tmp_path)
    if half_made_venv:  # what `python -m venv` leaves before pip fills the disk
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").symlink_to("/bin/false")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    run = _run(script, str(10**9))  # 1 EB: more than any disk here
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{tmp_path}" in run.stderr and "needs about 1000000000 GB" in run.stderr, run.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before, "nothing may be written"


def test_a_free_space_need_that_is_not_a_whole_number_is_refused(tmp_path):
    """A value like 5.5 would make the shell's integer test fail and the check silently pass."""
    run = _run(_copy_of_the_script(tmp_path), "5.5")
    assert run.returncode == 1 and "DSV4_SETUP_FREE_GB must be a whole number of GB, got '5.5'" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scripts"]
