"""The tests' engine factory (``tests/engines.py``) leaves nothing behind: the environment it set is restored, an
in-process engine's distributed groups are destroyed and vLLM reads the environment afresh, also when the engine
fails to start."""

from __future__ import annotations

import operator
import os

import pytest
from engines import vllm_engine

pytestmark = pytest.mark.engine

SET = ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_MLA_DISABLE")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("engines") / "bf16", seed=0)


def _left_behind() -> dict:
    """The environment variables the factory sets, what vLLM reads for them (stale if its env cache stayed on),
    and whether vLLM's distributed groups are up."""
    import torch.distributed
    import vllm.envs

    return {
        "env": {k: os.environ.get(k) for k in SET},
        "vllm_reads": (vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING, vllm.envs.VLLM_MLA_DISABLE),
        "groups": torch.distributed.is_initialized(),
    }


def test_in_process_engine_with_apply_model_is_undone(ckpt, monkeypatch):
    for key in SET[:2]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "0")  # a value of the caller's, to be given back
    before = _left_behind()
    assert before["vllm_reads"] == (True, False) and before["groups"] is False
    import torch
    from vllm import LLM  # noqa: F401  (what importing vLLM sets, e.g. cv2's LD_LIBRARY_PATH, is not the engine's)

    env, cores, set_num_threads = dict(os.environ), os.sched_getaffinity(0), torch.set_num_threads
    with vllm_engine(
        ckpt,
        in_process=True,
        apply_model=True,
        env={"VLLM_MLA_DISABLE": "1"},
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
    ) as llm:
        assert _left_behind() == {
            "env": {
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_MLA_DISABLE": "1",
            },
            "vllm_reads": (False, True),
            "groups": True,
        }
        # in this process: the engine core is reachable, and apply_model ships its function to the worker
        assert type(llm.llm_engine.engine_core).__name__ == "InprocClient"
        assert llm.apply_model(operator.methodcaller("describe"))[0]["dtype"] == "torch.float32"
        # vLLM's CPU platform and worker wrote their own variables into this process (LD_PRELOAD, ...)
        assert set(os.environ) - set(env) - set(SET)
        assert torch.set_num_threads is not set_num_threads  # vLLM's CPU worker made it a no-op
    assert _left_behind() == before
    # all of it undone, and the worker's core binding: later subprocesses inherit both (tests/engines.py)
    assert dict(os.environ) == env and os.sched_getaffinity(0) == cores
    assert torch.set_num_threads is set_num_threads


def test_failed_in_process_start_is_undone(ckpt, tmp_path):
    import shutil

    from vllm_dsv4_mtp.formats.checkpoint import CheckpointError

    bad = tmp_path / "trunc"
    shutil.copytree(ckpt, bad)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1000])  # fails in the worker, after it built the distributed groups
    before, env = _left_behind(), dict(os.environ)
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        with vllm_engine(
            bad, in_process=True, dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True
        ):
            pass  # not reached: the engine must not start
    assert _left_behind() == before and dict(os.environ) == env
