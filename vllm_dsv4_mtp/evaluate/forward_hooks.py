"""PyTorch forward hooks that time parts of a model inside vLLM's worker, for the step benchmarks
(:mod:`.stepcost` here, and the step-parts benchmark).

A benchmark's own ``install`` function, sent to the worker through vLLM's public ``LLM.collective_rpc``, calls
:func:`time_forward` on the modules it wants timed; each call of such a module then appends
``(part, tokens, start, end)`` (``time.perf_counter`` seconds) to this module's records in the worker's
process, and :func:`take_records`, sent the same way, hands them back. Functions travel by reference (module
name), hence ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and must be module-level functions of an importable
module (not ``__main__``) so that the hooks and :func:`take_records` share one module global. Between
:func:`start_profile` and :func:`finish_profile` every timed call is also a ``torch.profiler`` range named
``bench::<part>:<tokens>``. Nothing of vLLM is replaced.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

Record = tuple[str, int, float, float]  # (part, tokens, start s, end s)

_RECORDS: list[Record] = []  # in the worker's process
_PROFILING: dict = {"on": False, "prof": None}


def _tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a forward call: dim 0 of its first tensor argument (every forward timed here is token-major:
    ``input_ids`` / ``positions`` ``[T]``, hidden states ``[T, ...]``); -1 when it has none."""
    x = next((a for a in list(args) + list(kwargs.values()) if hasattr(a, "shape") and len(a.shape) >= 1), None)
    return -1 if x is None else int(x.shape[0])


def time_forward(module, part: str) -> None:
    """Record every forward of ``module`` as ``part`` (nested calls of one module pair up innermost first)."""
    import torch

    stack: list = []

    def pre(mod, args, kwargs):
        n = _tokens(args, kwargs)
        rf = torch.profiler.record_function(f"bench::{part}:{n}") if _PROFILING["on"] else None
        if rf is not None:
            rf.__enter__()
        stack.append((time.perf_counter(), n, rf))

    def post(mod, args, kwargs, out):
        t0, n, rf = stack.pop()
        if rf is not None:
            rf.__exit__(None, None, None)
        _RECORDS.append((part, n, t0, time.perf_counter()))

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


def decoder_blocks(model) -> Iterator[tuple[str, str, object]]:
    """``(name, kind, module)`` for each decoder block's attention (``*.attn`` / ``*.self_attn``: kind
    ``attention``) and MoE / MLP (``*.ffn`` / ``*.mlp``: kind ``moe``) under a ``layers`` container."""
    kinds = {"attn": "attention", "self_attn": "attention", "ffn": "moe", "mlp": "moe"}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in kinds and ".layers." in f".{name}":
            yield name, kinds[leaf], mod


def take_records(worker) -> list[Record]:
    """In the worker: the records since the last call (and forget them)."""
    out = list(_RECORDS)
    _RECORDS.clear()
    return out


def start_profile(worker) -> None:
    """In the worker: start a CPU ``torch.profiler`` session; timed calls become ``bench::`` ranges in it."""
    import torch

    _PROFILING["on"] = True
    _PROFILING["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _PROFILING["prof"].__enter__()


def finish_profile():
    """In the worker (called from a benchmark's own rpc function): end the session started by
    :func:`start_profile`, drop the records taken meanwhile, and return the finished profiler."""
    prof, _PROFILING["prof"] = _PROFILING["prof"], None
    prof.__exit__(None, None, None)
    _PROFILING["on"] = False
    _RECORDS.clear()
    return prof
