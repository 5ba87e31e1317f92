"""vLLM engines for tests: :func:`vllm_engine` starts one ``LLM``, sets the environment the test asks for, and
always restores the environment and shuts the engine down (``tests/conftest.py``'s ``start_engine`` keeps one
for a module's tests).

What a test may ask for, each an explicit flag:

* ``apply_model``: ``LLM.apply_model`` pickles a function to the worker, which vLLM allows only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (read when the function is sent, so it stays set while the engine lives);
* ``in_process`` (the default): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the engine core and its worker in this
  process, so the test reaches the model objects (:func:`drafter`) and a worker's exception reaches the caller
  unchanged. ``in_process=False`` starts them as a server does, an engine-core process and a worker process,
  each importing vLLM and the plugin again (~15 s of CPU per engine here). An in-process engine builds vLLM's
  distributed groups in this process; they are destroyed when it stops, and vLLM's env cache (frozen by an
  in-process engine core) is reset;
* ``env``: any other variable the engine must start with (``VLLM_MLA_DISABLE=1`` keeps chunked prefill on for
  model_type deepseek_v4 on CPUs without AMX).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_dsv4_mtp.evaluate.common import STOP_GRACE_S

if TYPE_CHECKING:
    from vllm import LLM

# the float32 parity engines' settings (tiny checkpoints against HF transformers' float32 oracle)
PARITY_ENGINE = dict(
    dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=8, skip_tokenizer_init=True, seed=0
)


@contextmanager
def vllm_engine(
    model: str | Path,
    *,
    in_process: bool = True,
    apply_model: bool = False,
    env: Mapping[str, str] | None = None,
    **llm_kwargs,
) -> Iterator[LLM]:
    """``with vllm_engine(ckpt, dtype="float32", ...) as llm:`` an ``LLM(model=str(ckpt), **llm_kwargs)``.

    Raises what ``LLM(...)`` raises (after the same clean-up), so ``pytest.raises`` around the ``with`` checks an
    engine that must fail to start.
    """
    import torch.distributed
    import vllm.envs
    from vllm import LLM

    settings = dict(env or {})
    if apply_model:
        settings["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if in_process:
        settings["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # groups already up belong to the caller (the vllm_dist fixture): an in-process engine joins them
    borrowed = in_process and torch.distributed.is_initialized()
    before = _process_state()  # given back whole, the settings below included
    try:
        os.environ.update(settings)
        vllm.envs.disable_envs_cache()  # a cached read from before would hide what was just set
        llm = None
        try:
            llm = LLM(model=str(model), **llm_kwargs)
            if borrowed:  # only a start that fails may join them: stopping a running engine destroys them
                raise RuntimeError(
                    "an in-process engine started inside an initialised vLLM distributed "
                    "environment (the vllm_dist fixture): stopping it would destroy those groups"
                )
            yield llm
        finally:
            _shut_down(llm, in_process and not borrowed)
    finally:
        _restore(before)
        vllm.envs.disable_envs_cache()  # the restored environment is what vLLM reads next


def _process_state() -> tuple:
    """This process's environment and its thread's CPU affinity (what a later subprocess inherits), and torch's
    thread count and ``torch.set_num_threads`` (which vLLM's CPU worker replaces with a no-op)."""
    import torch

    return dict(os.environ), os.sched_getaffinity(0), torch.get_num_threads(), torch.set_num_threads


def _restore(state: tuple) -> None:
    """Put back what :func:`_process_state` saw. vLLM's CPU platform and worker write ``os.environ`` as they start
    (``LD_PRELOAD``, ``VLLM_DIST_IDENT``, ``VLLM_WORKER_MULTIPROC_METHOD``, ...) and bind the worker's thread to
    its cores: in process, into this process, where every later subprocess would inherit them (in the first
    clean-clone run with in-process engines, a forked rank of the real-class harness started after them waited on
    a futex until its 20-minute timeout; not reproduced, so not proven the cause)."""
    import torch

    env, cores, threads, set_num_threads = state
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)


def _shut_down(llm, destroy_groups: bool) -> None:
    """Stop the engine core (its process, or in this process its executor), then what an in-process start left:
    vLLM's distributed groups and memory (also when ``LLM(...)`` failed half way, after the worker joined them)."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown(timeout=STOP_GRACE_S)
    del llm
    gc.collect()
    if destroy_groups:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def _model_runner(llm):
    """The model runner of an in-process (``in_process=True``) engine on one device."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def target(llm):
    """The target model object of an in-process engine on one device."""
    return _model_runner(llm).model


def drafter(llm):
    """The speculative draft model object of an in-process engine on one device.

    Model Runner V1 holds the proposer as ``.drafter``; V2 (the default for MTP on ROCm with Triton from vLLM
    0.32, the only runner from 0.34) as ``.speculator``. Both keep the draft module as ``.model``."""
    runner = _model_runner(llm)
    proposer = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    if proposer is None:
        raise AssertionError(
            f"{type(runner).__module__}.{type(runner).__name__} has neither .speculator (Model "
            "Runner V2) nor .drafter (V1): is speculative decoding on?"
        )
    return proposer.model


def record_draft_calls(llm, prompts: list[list[int]], max_tokens: int = 2) -> tuple[list[dict], list]:
    """Generate ``max_tokens`` greedy tokens per prompt on an in-process engine and record every call vLLM's
    proposer makes to the draft: ``input_ids``, ``positions``, the ``hidden_states`` fed in and the state returned
    (``out``). Returns the calls and vLLM's outputs."""
    from vllm import SamplingParams

    calls = []

    def record(module, args, kwargs, out):
        calls.append(
            {k: kwargs[k].detach().clone() for k in ("input_ids", "positions", "hidden_states")}
            | {"out": out.detach().clone()}
        )

    handle = drafter(llm).register_forward_hook(record, with_kwargs=True)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False),
        )
    finally:
        handle.remove()
    return calls, outs


def replay_first_round(draft, step1: dict, later: list[dict], prompts: list[list[int]], ref) -> Iterator[dict]:
    """Replay the recorded first drafting round (``record_draft_calls``: ``step1`` over every prompt position, then
    ``later`` = steps 2..K, one row per request) through the float32 reference MTP ``ref``, fed the same hidden
    states and tokens, with its own cache per request.

    Yields per request ``r`` and step ``k`` (0 = step 1): ``got`` (the draft's logits from its recorded output),
    ``want`` (the reference's), and for ``k >= 1`` the recorded ``call``, the ``token`` fed and the reference's
    logits of the step before (``prev``), whose argmax that token should be."""
    import torch
    from transformers.cache_utils import DynamicCache

    hc, d = 4, ref.e_proj.weight.shape[0]
    start = 0
    for r, prompt in enumerate(prompts):
        n = len(prompt)
        rows = slice(start, start + n)
        start += n
        with torch.no_grad():
            cache = DynamicCache(config=ref.config)
            state = ref(
                step1["hidden_states"][rows].view(1, n, hc, d),
                step1["input_ids"][rows][None].long(),
                torch.arange(n)[None],
                past_key_values=cache,
            )
            yield {"r": r, "k": 0, "got": draft.compute_logits(step1["out"][rows]), "want": ref.logits(state)[0]}
            state = state[:, -1:]
            for k, call in enumerate(later, start=1):
                prev = ref.logits(state)[0, -1]
                token = call["input_ids"][r].view(1, 1).long()
                state = ref(state, token, torch.tensor([[n + k - 1]]), past_key_values=cache)
                got = draft.compute_logits(call["out"][r : r + 1])[0]
                want = ref.logits(state)[0, -1]
                yield {"r": r, "k": k, "got": got, "want": want, "call": call, "token": token, "prev": prev}
