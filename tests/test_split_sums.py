"""The float64 parts of the sums tensor parallelism splits (``model/split_sums.py``), and the routed experts' use.

The engine-level check is ``tests/test_tensor_parallel.py`` (TP2 against TP1 through vLLM, attention and shared
expert included); here the arithmetic: a float32 sum split in two parts and added in float32 differs from the
whole sum in some elements, while the same parts in float64, rounded once, equal the whole sum rounded once; and
the routed experts' two tensor- or expert-parallel ranks, packed as the model loads them, add up to one rank's
result bit for bit, both ways the kit computes them.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.cpu import experts as kit_experts
from vllm_dsv4_mtp.model import experts, split_sums


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
    halves = [
        torch.cat([torch.arange(e * width + r * width // 2, e * width + (r + 1) * width // 2) for e in range(experts)])
        for r in range(2)
    ]
    whole, parts = _split_and_whole(lambda m: lambda v: v @ m.T, x, w, halves)
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
    w.zero_()  # a copy: the float64 GEMM does not read the parameter it was made from
    assert torch.equal(lin(torch.ones(2, 4)), torch.full((2, 4), 4.0, dtype=torch.float64))


def test_single_rank_all_reduce_is_the_identity(vllm_dist):
    t = torch.randn(3, 5, dtype=torch.float64)
    assert split_sums.all_reduce(t) is t


def _experts(weights, dtype, **tp):
    e, d, i = len(weights), weights[0]["w2"].shape[0], weights[0]["w2"].shape[1]
    ex = experts.PortableExperts(e, d, i, 10.0, dtype=dtype, **tp)
    for n, shards in enumerate(weights):
        for shard, w in shards.items():
            param = ex.w2_weight if shard == "w2" else ex.w13_weight
            param.weight_loader(param, w.to(dtype), f"experts.{n}.{shard}.weight", shard_id=shard, expert_id=n)
    return ex


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_add_up_to_one_rank_bit_for_bit(expert_parallel):
    """float32, packed: the two ranks' float64 parts, summed and rounded once, are one rank's result exactly (the
    grouped way and the all-experts way, at 7 and 300 tokens). With float32 down projections instead, a
    tensor-parallel rank rounds each expert's half of the sum to float32 before the ranks add them, and they no
    longer add up exactly (expert parallel ranks hold whole experts: their grouped way splits no expert's sum)."""
    g = torch.Generator().manual_seed(11)
    E, D, I = 8, 64, 64
    weights = [
        {
            "w1": torch.randn(I, D, generator=g),
            "w3": torch.randn(I, D, generator=g),
            "w2": torch.randn(D, I, generator=g),
        }
        for _ in range(E)
    ]
    whole = _experts(weights, torch.float32)
    ranks = [_experts(weights, torch.float32, tp_rank=r, tp_size=2, expert_parallel=expert_parallel) for r in range(2)]
    for tokens in (7, 300):
        x = torch.randn(tokens, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
        ws = torch.rand(tokens, 2, generator=g)
        for budget in (0, kit_experts.ALL_EXPERTS_MACS):  # the grouped way only; the kit's choice
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kit_experts, "ALL_EXPERTS_MACS", budget)
                for ex in (whole, *ranks):
                    ex.pack()
            one, parts = whole(x, ws, ids), [ex(x, ws, ids) for ex in ranks]
            assert one.dtype == parts[0].dtype == torch.float64
            assert torch.equal((parts[0] + parts[1]).float(), one.float()), tokens
        if not expert_parallel:  # the grouped way with float32 down projections
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kit_experts, "ALL_EXPERTS_MACS", 0)
                one, *parts = (
                    kit_experts.PackedExperts(
                        ex.w13_weight.data, ex.w2_weight.data, first=0, num_experts=E, out_dtype=torch.float32
                    )(x, ws, ids, whole.activation)
                    for ex in (whole, *ranks)
                )
            assert not torch.equal(one, parts[0] + parts[1]), tokens


@pytest.mark.usefixtures("vllm_dist")
def test_a_float32_row_linear_gets_its_float64_copy_from_the_weight_as_loaded():
    """``wo_b`` and the shared expert's ``down_proj``: their float64 copy is made from the loaded weight after
    vLLM has processed the layer (an in-place reload processes each layer before the model packs; vLLM's own
    float32 CPU method would have packed the weight away); a 16-bit one is left to its prepared GEMM."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_dsv4_mtp.cpu.linear import prepared_linear
    from vllm_dsv4_mtp.model.split_sums import wide_layer

    def row(dtype):
        torch.set_default_dtype(dtype)
        try:
            return prepared_linear(
                RowParallelLinear(8, 4, bias=False, return_bias=False, prefix="model.layers.0.attn.wo_b")
            )
        finally:
            torch.set_default_dtype(torch.float32)

    w, x = torch.randn(4, 8), torch.randn(3, 8)
    wide = row(torch.float32)
    wide.weight.data.copy_(w)
    wide.quant_method.process_weights_after_loading(wide)
    assert torch.equal(wide_layer(wide)(x), x.double() @ w.double().T)
    assert wide_layer(row(torch.bfloat16)) is None
