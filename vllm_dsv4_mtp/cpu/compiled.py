"""The plugin's own compiled CPU loops (``cpu/csrc/*.c``): built on first use with the machine's C compiler.

Each C file includes no header and links nothing but OpenMP, so a compiler alone builds it (no C library
headers or start files). :func:`build` compiles one with ``$CC`` (else ``cc``) and ``-O3 -march=native``
(OpenMP where the compiler has it) into ``$XDG_CACHE_HOME/vllm_dsv4_mtp`` (``~/.cache``), under a name that
hashes the source, the compiler's version, the flags and this CPU's feature flags; :func:`library` loads it with
ctypes (a call releases the GIL), once per process, or logs once why it cannot and returns None: the callers
then keep their torch path. ``scripts/setup_env.sh`` builds every one at set-up, so that a missing compiler is
named there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.dsv4_mtp.cpu_kit")

CSRC = Path(__file__).with_name("csrc")
# no C library headers, start files or libraries: the sources need none (the compiler alone builds them)
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC", "-nostdinc", "-nostdlib"]
VARIANTS = ((FLAGS + ["-fopenmp"], ["-lgomp"]), (FLAGS, []))  # OpenMP where the compiler has it
NAMES = tuple(sorted(p.stem for p in CSRC.glob("*.c")))
# the row dtypes the loops take, as their `bf16` flag
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class KernelError(RuntimeError):
    """A compiled loop refused a call (its return code, in words)."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm_dsv4_mtp"


def _cpu_flags() -> str:
    """This CPU's feature flags (``-march=native`` builds for them), or the machine name where not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: list[str], source: Path, flags: list[str], libs: list[str], dest: Path) -> None:
    """Build ``source`` into ``dest`` (written under a temporary name, then renamed: processes that build at once
    each end with a whole file)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*compiler, *flags, str(source), "-o", tmp, *libs], check=True, capture_output=True, text=True, timeout=120
        )
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache from loading it
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(name: str) -> Path:
    """``csrc/<name>.c`` as a shared library for this machine, built if not yet cached; raises ``OSError`` /
    ``subprocess.CalledProcessError`` (its ``stderr`` has the compiler's message) where it cannot be built."""
    cc = shlex.split(os.environ.get("CC") or "cc")  # CC may carry arguments ("ccache gcc")
    found = shutil.which(cc[0]) if cc else None
    if found is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    compiler = [found, *cc[1:]]
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = CSRC / f"{name}.c"
    text = source.read_bytes()
    last: subprocess.CalledProcessError | None = None
    for flags, libs in VARIANTS:
        digest = hashlib.sha256(
            b"\0".join(
                x.encode() if isinstance(x, str) else x
                for x in (text, version, " ".join(flags + libs), platform.machine(), _cpu_flags())
            )
        ).hexdigest()[:16]
        dest = _cache_dir() / f"{name}-{digest}.so"
        if dest.exists():
            return dest
        try:
            _compile(compiler, source, flags, libs, dest)
            return dest
        except subprocess.CalledProcessError as e:
            last = e
    assert last is not None
    raise last


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` loaded, or None (logged once) where it cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build(name)))
    except subprocess.CalledProcessError as e:
        why = (e.stderr or str(e)).strip().splitlines()[-1:]
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)
    logger.warning(
        "vllm-dsv4-mtp: the compiled loop %s is not available (%s); its callers keep their slower torch path", name, why
    )
    return None


@functools.cache
def function(name: str, symbol: str, argtypes: tuple, restype=ctypes.c_int):
    """The C function ``symbol`` of ``csrc/<name>.c`` with its ctypes signature, or None where :func:`library`
    is not available."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def main() -> None:
    """Build every C file (``scripts/setup_env.sh``): a missing or failing compiler stops set-up with its reason."""
    for name in NAMES:
        print(f"{name}: {build(name)}")


if __name__ == "__main__":
    main()
