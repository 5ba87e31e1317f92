"""Shared test settings and fixtures.

Environment defaults are set before any test imports vllm: vLLM's CPU KV cache otherwise takes a large
slice of RAM, and nothing may reach a model hub. Every other environment change goes through pytest's
``monkeypatch`` (or ``tests/engines.py`` for what an engine needs), so none outlives its test or module.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from engines import vllm_engine

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _one_core_per_worker() -> None:
    """Under ``pytest -n N`` (``make test`` runs two workers), worker ``gwI``'s engines run on core ``I mod cores``.

    Why: vLLM's CPU worker binds its OpenMP threads to every core of the node by default, so two engines started
    by two workers would each spin two threads on the same two cores; one core each kept both busy without that
    contention (docs/benchmarks.md, "make test"). A test that binds its own (tensor parallel: ``0|1``) still can.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        cores = sorted(os.sched_getaffinity(0))  # the cores this process may use, not every core of the machine
        core = cores[int(worker.removeprefix("gw")) % len(cores)]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
        os.environ.setdefault("OMP_NUM_THREADS", "1")


_one_core_per_worker()


#: the modules that run vLLM's real in-tree classes in subprocesses of their own (``run_worker``), with forked
#: tensor-parallel ranks, up to 8 a case
IN_TREE_HARNESS = (
    "test_in_tree_mtp_real.py",
    "test_in_tree_mtp_forward.py",
    "test_in_tree_mtp_stored.py",
    "test_gfx950_draft_plan.py",
    "test_in_tree_isa.py",
    "test_in_tree_mtp_dp.py",
    "test_in_tree_mtp_k0.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the :data:`IN_TREE_HARNESS` modules one unit of work: one worker runs them one
    after another. Why: two of them at once on the two workers, each with its forked ranks, took 4x as long as
    one alone (docs/benchmarks.md, "make test"); a worker kept apart from the other's harness costs no idle time,
    as a lock would."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HarnessOneAtATime(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "in-tree harness" if path.rsplit("/", 1)[-1] in IN_TREE_HARNESS else path

    return HarnessOneAtATime(config, log)


def on_gfx950() -> bool:
    """True on an AMD MI350/MI355 (gfx950) GPU: the plugin's own platform choice (``vllm_dsv4_mtp.platform``)."""
    from vllm_dsv4_mtp.platform import is_gfx950

    return is_gfx950()


def pytest_collection_modifyitems(config, items):
    """Modules with a test marked ``engine`` first (``make test``'s two workers take whole modules in this
    order, so the long ones start early and the short ones fill the end). Tests marked ``gfx950`` document what
    must hold on MI350/MI355; elsewhere they are skipped, with why."""
    runs_vllm = {item.module for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.module not in runs_vllm)  # whole modules, stable: file order otherwise
    if on_gfx950():
        return
    skip = pytest.mark.skip(reason="needs an AMD MI350/MI355 (gfx950) GPU with ROCm vLLM + AITER")
    for item in items:
        if "gfx950" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def vllm_dist(tmp_path_factory):
    """A one-process vLLM distributed environment (TP = 1, gloo with a file rendezvous) inside a default
    ``VllmConfig``: what vLLM's parallel layers need to be built and loaded outside an engine. A file, not a
    loopback port found free and released, which a concurrent engine could take first."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    rendezvous = tmp_path_factory.mktemp("vllm-dist") / "rendezvous"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{rendezvous}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.float32)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.fixture(scope="module")
def start_engine():
    """``start_engine(model, *, in_process=True, apply_model=False, env=None, **LLM kwargs)``: a vLLM ``LLM``
    (``tests/engines.py``) that runs until the module's tests are done, its environment restored after."""
    with contextlib.ExitStack() as stack:
        yield lambda model, **kw: stack.enter_context(vllm_engine(model, **kw))


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """``start_server(model, mtp_k=None, extra_args=())``: a started ``ManagedServer``
    (``vllm_dsv4_mtp/evaluate/server.py``: ``dsv4-mtp serve --profile cpu-tiny MODEL`` with MTP off or K drafts and
    the extra vLLM flags, which replace the profile's), stopped when the module's tests are done; its log is
    ``.log_path``."""
    from vllm_dsv4_mtp.evaluate.server import ManagedServer, ServerSpec

    def start(model, mtp_k=None, extra_args=()):
        spec = ServerSpec(model=str(model), mtp_k=mtp_k, extra_args=list(extra_args))
        log = tmp_path_factory.mktemp("server") / "server.log"
        return stack.enter_context(ManagedServer(spec, log_path=log, start_timeout_s=600))

    with contextlib.ExitStack() as stack:
        yield start


@pytest.fixture(scope="session")
def embedded_mxfp4():
    """The shipped MXFP4 checkpoint (what ``make demo`` serves); it is part of the repository, never substituted."""
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR
    from vllm_dsv4_mtp.evaluate.common import has_checkpoint

    assert has_checkpoint(MXFP4_CHECKPOINT_DIR), f"{MXFP4_CHECKPOINT_DIR}: the embedded MXFP4 checkpoint is missing"
    return MXFP4_CHECKPOINT_DIR
