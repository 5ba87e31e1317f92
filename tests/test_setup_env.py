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


@pytest.mark.parametrize("half_made_venv", [False, True])
def test_setup_stops_before_writing_when_the_disk_lacks_room(tmp_path, half_made_venv):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup_env.sh", tmp_path / "scripts" / "setup_env.sh")
    if half_made_venv:  # what `python -m venv` leaves before pip fills the disk
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").symlink_to("/bin/false")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    env = dict(os.environ, DSV4_SETUP_FREE_GB=str(10**9))  # 1 EB: more than any disk here
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "setup_env.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{tmp_path}" in run.stderr and "needs about 1000000000 GB" in run.stderr, run.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before, "nothing may be written"


def test_a_free_space_need_that_is_not_a_whole_number_is_refused(tmp_path):
    """A value like 5.5 would make the shell's integer test fail and the check silently pass."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup_env.sh", tmp_path / "scripts" / "setup_env.sh")
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "setup_env.sh")],
                         env=dict(os.environ, DSV4_SETUP_FREE_GB="5.5"), capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "DSV4_SETUP_FREE_GB must be a whole number of GB, got '5.5'" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scripts"]
