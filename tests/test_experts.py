"""The portable routed experts and the kit's two ways of computing them (``cpu/experts.py``): the routed sum, the
TP / EP split, which way a step takes, and the portable quantization config that claims DeepSeek-V4 checkpoints
off gfx950."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dsv4_mtp import portable_quant_config as portable_quant
from vllm_dsv4_mtp.cpu import experts as kit_experts
from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.model import experts, split_sums


def test_portable_quant_config_claims_dsv4_only_off_gfx950():
    quark = {"quant_method": "quark"}
    dsv4 = SimpleNamespace(model_type="deepseek_v4", compress_ratios=[0, 4], hc_mult=4)
    draft = SimpleNamespace(model_type="deepseek_mtp", compress_ratios=[0, 4], hc_mult=4)
    v3 = SimpleNamespace(model_type="deepseek_v3")
    assert portable_quant.claims(quark, dsv4, gfx950=False)
    assert portable_quant.claims({"quant_method": "fp8"}, dsv4, gfx950=False)
    assert portable_quant.claims(quark, draft, gfx950=False)
    assert not portable_quant.claims(quark, dsv4, gfx950=True)  # gfx950: vLLM's QuarkConfig (AITER)
    assert not portable_quant.claims(quark, v3, gfx950=False)
    assert not portable_quant.claims({"quant_method": "awq"}, dsv4, gfx950=False)
    assert not portable_quant.claims(None, dsv4, gfx950=False)


def _expert_weights(num_experts, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(inter, hidden, generator=g),
            "w3": torch.randn(inter, hidden, generator=g),
            "w2": torch.randn(hidden, inter, generator=g),
        }
        for _ in range(num_experts)
    ]


def _load(ex, weights, way="all", monkeypatch=None):
    """Load ``weights`` and pack: ``way`` "grouped" packs no all-experts GEMMs (a budget of 0), so every step
    takes the grouped way; "all" the kit's own budget, which every step of these tests' sizes is within."""
    for e, shards in enumerate(weights):
        for shard, w in shards.items():
            param = ex.w2_weight if shard == "w2" else ex.w13_weight
            param.weight_loader(param, w, f"experts.{e}.{shard}.weight", shard_id=shard, expert_id=e)
    with pytest.MonkeyPatch.context() as mp:
        if way == "grouped":
            mp.setattr(kit_experts, "ALL_EXPERTS_MACS", 0)
        ex.pack()
    assert (ex._packed.all is not None) == (way == "all")
    return ex


def _reference(x, weights, ids, ws, limit, w4a4):
    """sum_k w_k * expert_{id_k}(x), one token and one expert at a time, in float64."""
    act = (lambda v: mxfp4.fake_quant(v.float()).double()) if w4a4 else (lambda v: v)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            p = weights[int(ids[t, k])]
            xt = act(x[t : t + 1].double())
            h = experts.swiglu_clamped(xt @ p["w1"].double().T, xt @ p["w3"].double().T, limit)
            out[t] += float(ws[t, k]) * (act(h) @ p["w2"].double().T)[0]
    return out


WAYS = ["grouped", "all"]


@pytest.mark.parametrize("tokens", [1, 3, 40])  # one, a few and all experts hit
@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("way", WAYS)
def test_experts_compute_the_routed_sum(tokens, w4a4, way):
    E, D, I, k = 8, 64, 32, 2
    weights = _expert_weights(E, D, I)
    ex = _load(experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=torch.float32), weights, way)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, D, generator=g) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    ws = torch.rand(tokens, k, generator=g)
    got = ex(x, ws, ids).double()
    want = _reference(x, weights, ids, ws, 10.0, w4a4)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_unpacked_experts_say_so():
    ex = experts.PortableExperts(4, 64, 32, 10.0, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="prepare_weights"):
        ex(torch.zeros(1, 64), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("way", WAYS)
def test_parallel_ranks_sum_to_the_whole(expert_parallel, way):
    """Rank r of 2 holds half of every expert's intermediate dim (TP) or half of the experts (EP); the ranks'
    partial sums add up to the single-rank result, and an EP rank says which experts it does not hold."""
    E, D, I = 4, 64, 64
    weights = _expert_weights(E, D, I, seed=4)
    full = _load(experts.PortableExperts(E, D, I, 10.0, dtype=torch.float32), weights, way)
    parts = [
        _load(
            experts.PortableExperts(
                E, D, I, 10.0, tp_rank=r, tp_size=2, expert_parallel=expert_parallel, dtype=torch.float32
            ),
            weights,
            way,
        )
        for r in range(2)
    ]
    g = torch.Generator().manual_seed(5)  # inputs independent of the tests run before
    x = torch.randn(9, D, generator=g)
    ids = torch.randint(0, E, (9, 2), generator=g)
    ws = torch.rand(9, 2, generator=g)
    torch.testing.assert_close(parts[0](x, ws, ids) + parts[1](x, ws, ids), full(x, ws, ids), atol=1e-4, rtol=1e-5)
    if expert_parallel:
        p = parts[1].w13_weight
        assert p.weight_loader(p, weights[0]["w1"], "experts.0.w1.weight", "w1", 0, return_success=True) is False
        assert p.weight_loader(p, weights[3]["w1"], "experts.3.w1.weight", "w1", 3, return_success=True) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("split", ["none", "tp", "ep"])
def test_all_experts_compute_the_grouped_sum(dtype, w4a4, split):
    """Every expert over every token, the routing weights between the two GEMMs, is the grouped way's routed
    sum: float32 to its rounding, bfloat16 to its own (the pass rounds each weighted expert row once where the
    grouped way rounds each expert output once); on one rank, a TP rank and an EP rank (other ranks' experts
    dropped), with an expert a token picked twice (hash routing's table may) summed."""
    E, D, I = 8, 64, 64
    tp = {"none": {}, "tp": dict(tp_rank=1, tp_size=2), "ep": dict(tp_rank=1, tp_size=2, expert_parallel=True)}[split]
    weights = _expert_weights(E, D, I, seed=7)
    both = {
        way: _load(experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=dtype, **tp), weights, way)
        for way in WAYS
    }
    g = torch.Generator().manual_seed(8)
    for tokens in (1, 7, 50):
        x = torch.randn(tokens, D, generator=g).to(dtype)
        ids = torch.randint(0, E, (tokens, 2), generator=g)
        ids[0, 1] = ids[0, 0]  # one token's two picks the same expert
        ws = torch.rand(tokens, 2, generator=g)
        got, want = both["all"](x, ws, ids), both["grouped"](x, ws, ids)
        assert got.dtype == want.dtype == split_sums.partial_dtype(dtype) and got.shape == want.shape
        scale = want.float().abs().max().item()
        # bfloat16: a few roundings of 2**-9 on each term; under W4A4 the same MXFP4 codes (the SwiGLU rounds
        # as the grouped way's), so no rounding step of 2**-2 appears here
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)
        if dtype == torch.float32:  # a dropped or doubled expert is far outside float32 rounding
            wrong = ws.clone()
            wrong[0, 1] = 0.0
            bad = both["all"](x, wrong, ids)
            assert (bad - got).abs().max().item() > 1e3 * tol * scale or split == "ep"


@pytest.mark.parametrize("split", ["none", "ep"])
@pytest.mark.parametrize("w4a4", [False, True])
def test_all_experts_leave_experts_no_token_routed_to_out_of_the_sum(split, w4a4):
    """The all-experts way runs the SwiGLU (and its rounding) on the routed rows only: an expert no token picked
    cannot reach the sum even where its output overflows (infinite weights here, which a checkpoint load
    refuses; an overflowing GEMM gives the same), where a 0 routing weight would make its row 0 * inf = NaN; an
    expert-parallel rank drops the other rank's picks the same way."""
    E, D, I = 8, 64, 64
    tp = dict(tp_rank=0, tp_size=2, expert_parallel=True) if split == "ep" else {}
    weights = _expert_weights(E, D, I, seed=9)
    weights[3]["w1"] = torch.full((I, D), float("inf"))  # expert 3: never picked below
    both = {
        way: _load(
            experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=torch.bfloat16, **tp), weights, way
        )
        for way in WAYS
    }
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, D, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 7], [1, 6], [5, 0], [4, 2]])  # EP rank 0 holds 0-3: 7, 6, 5, 4 are rank 1's
    ws = torch.rand(5, 2, generator=g)
    got, want = both["all"](x, ws, ids), both["grouped"](x, ws, ids)
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=0)


def test_all_experts_are_taken_for_small_moes_only(monkeypatch):
    """The embedded model's MoE (8 experts of 128 x 128) takes the all-experts way for a decode step of 64
    requests and not for a verify window of 3 x 64 tokens; DeepSeek-V4's own experts (256 of 2048 x 7168) never,
    so they pack no all-experts GEMMs; a step within the budget takes the way, one past it the grouped one."""
    assert kit_experts.all_experts_pay(64, 8, 128, 128)
    assert not kit_experts.all_experts_pay(192, 8, 128, 128)
    assert not kit_experts.all_experts_pay(1, 256, 2048, 7168)
    ex = _load(experts.PortableExperts(8, 128, 128, 10.0, dtype=torch.bfloat16), _expert_weights(8, 128, 128))
    taken = []
    for way in ("_grouped", "_all_experts"):
        real = getattr(kit_experts.PackedExperts, way)
        monkeypatch.setattr(
            kit_experts.PackedExperts, way, lambda self, *a, way=way, real=real: taken.append(way) or real(self, *a)
        )
    for tokens in (0, 1, 64, 192):
        x = torch.randn(tokens, 128).bfloat16()
        ex(x, torch.rand(tokens, 2), torch.randint(0, 8, (tokens, 2)))
    assert taken == ["_grouped", "_all_experts", "_all_experts", "_grouped"]
