"""The float64 parts of the sums tensor parallelism splits (``model/split_sums.py``), and where the model uses them.

The engine-level check is ``tests/test_tensor_parallel.py`` (TP2 against TP1 through vLLM); here the arithmetic:
a float32 sum split in two parts and added in float32 differs from the whole sum in some elements, while the same
parts in float64, rounded once, equal the whole sum rounded once.
"""

from __future__ import annotations

import torch

from vllm_dsv4_mtp.model import split_sums


def _split_and_whole(linear_for, x, w, halves):
    """``x @ w.T`` as one linear and as two ranks' parts (``halves``: the input features of each) added."""
    whole = linear_for(w)(x)
    a, b = (linear_for(w[:, h].contiguous())(x[:, h].contiguous()) for h in halves)
    return whole, a + b


def test_float64_parts_round_to_the_whole_sum():
    """Features split as the MoE's ``w2`` splits (each rank half of every expert's width: not one contiguous
    half), for which the float32 kernels' orders differ."""
    g = torch.Generator().manual_seed(0)
    experts, width = 9, 64
    x, w = torch.randn(64, experts * width, generator=g), torch.randn(128, experts * width, generator=g)
    halves = [torch.cat([torch.arange(e * width + r * width // 2, e * width + (r + 1) * width // 2)
                         for e in range(experts)]) for r in range(2)]
    whole, parts = _split_and_whole(lambda m: (lambda v: v @ m.T), x, w, halves)
    assert (whole != parts).any()  # float32: another order of the additions, other roundings
    whole, parts = _split_and_whole(split_sums.wide_linear, x, w, halves)
    assert whole.dtype == parts.dtype == torch.float64
    assert torch.equal(whole.float(), parts.float())


def test_only_float32_models_widen():
    assert split_sums.partial_dtype(torch.float32) == torch.float64
    assert split_sums.partial_dtype(torch.bfloat16) == torch.bfloat16
    assert split_sums.wide_linear(torch.ones(4, 4, dtype=torch.bfloat16)) is None
    w = torch.ones(4, 4)
    lin = split_sums.wide_linear(w)
    w.zero_()  # a copy: vLLM's CPU dispatch may drop the parameter it was made from
    assert torch.equal(lin(torch.ones(2, 4)), torch.full((2, 4), 4.0, dtype=torch.float64))


def test_single_rank_all_reduce_is_the_identity(vllm_dist):
    t = torch.randn(3, 5, dtype=torch.float64)
    assert split_sums.all_reduce(t) is t
