"""The portable routed experts: implementation choice, how MXFP4 bytes are loaded, TP split, and the
portable quantization config that claims DeepSeek-V4 checkpoints off gfx950."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dsv4_mtp import portable_quant_config as portable_quant
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


def _load(ex, weights):
    for e, shards in enumerate(weights):
        for shard, w in shards.items():
            param = ex.w2_weight if shard == "w2" else ex.w13_weight
            param.weight_loader(param, w, f"experts.{e}.{shard}.weight", shard_id=shard, expert_id=e)


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


@pytest.mark.parametrize("tokens", [1, 3, 40])  # one, a few and all experts hit
@pytest.mark.parametrize("w4a4", [False, True])
def test_experts_compute_the_routed_sum(tokens, w4a4):
    E, D, I, k = 8, 64, 32, 2
    weights = _expert_weights(E, D, I)
    ex = experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=torch.float32)
    _load(ex, weights)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, D, generator=g) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    ws = torch.rand(tokens, k, generator=g)
    got = ex(x, ws, ids).double()
    want = _reference(x, weights, ids, ws, 10.0, w4a4)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_compute_what_the_parameters_do(dtype):
    """After pack() the experts' GEMMs go through vLLM's CPU linear dispatch; the routed sum is the one the
    parameters give through F.linear (float32: to rounding; bfloat16: to one output rounding)."""
    E, D, I = 8, 64, 32
    ex = experts.PortableExperts(E, D, I, 10.0, dtype=dtype)
    _load(ex, _expert_weights(E, D, I, seed=2))
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 50):
        x = torch.randn(tokens, D, generator=g).to(dtype)
        ids = torch.randint(0, E, (tokens, 2), generator=g)
        ws = torch.rand(tokens, 2, generator=g)
        ex._linears = None
        plain = ex(x, ws, ids)
        ex.pack()
        assert ex._linears is not None
        packed = ex(x, ws, ids)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(packed.float(), plain.float(), atol=tol * plain.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("split", ["none", "tp", "no_local_hit"])
def test_shared_expert_in_the_routed_pass_is_bit_identical(dtype, w4a4, split):
    """The MoE hands its shared expert to the routed pass (``dense``) so one SwiGLU and one MXFP4 rounding
    cover both: the result is bit-identical to the routed sum plus the shared expert computed on its own, on
    one rank, on a tensor-parallel rank (half of every expert's and of the shared expert's width) and on a rank
    none of whose experts a token hit (an expert-parallel rank's experts; the MoE itself only fuses where the
    shared expert has the routed experts' width, which under expert parallelism is a single rank)."""
    E, D, I = 8, 64, 64  # a TP rank's half (32) is still one MXFP4 block wide
    tp = {
        "none": {},
        "tp": dict(tp_rank=1, tp_size=2),
        "no_local_hit": dict(tp_rank=1, tp_size=2, expert_parallel=True),
    }[split]
    expert_parallel = split == "no_local_hit"
    ex = experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=dtype, **tp)
    _load(ex, _expert_weights(E, D, I, seed=5))
    ex.pack()
    g = torch.Generator().manual_seed(6)
    w13, w2 = (
        torch.randn(2 * ex.local_intermediate, D, generator=g).to(dtype),
        torch.randn(D, ex.local_intermediate, generator=g).to(dtype),
    )
    dense = (lambda v: v @ w13.T, lambda h: h @ w2.T)
    act = mxfp4.fake_quant if w4a4 else (lambda v: v)
    for tokens in (1, 7, 50):
        x = torch.randn(tokens, D, generator=g).to(dtype)
        ids = torch.randint(0, E // 2 if expert_parallel and tokens == 1 else E, (tokens, 2), generator=g)
        ws = torch.rand(tokens, 2, generator=g)
        alone = dense[1](act(experts.swiglu_clamped(*dense[0](act(x)).chunk(2, dim=-1), 10.0)))
        assert torch.equal(ex(x, ws, ids, dense=dense), ex(x, ws, ids) + alone), tokens


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_parallel_ranks_sum_to_the_whole(expert_parallel):
    """Rank r of 2 holds half of every expert's intermediate dim (TP) or half of the experts (EP); the ranks'
    partial sums add up to the single-rank result, and an EP rank says which experts it does not hold."""
    E, D, I = 4, 64, 64
    weights = _expert_weights(E, D, I, seed=4)
    full = experts.PortableExperts(E, D, I, 10.0, dtype=torch.float32)
    _load(full, weights)
    parts = []
    for r in range(2):
        part = experts.PortableExperts(
            E, D, I, 10.0, tp_rank=r, tp_size=2, expert_parallel=expert_parallel, dtype=torch.float32
        )
        _load(part, weights)
        parts.append(part)
    g = torch.Generator().manual_seed(5)  # inputs independent of the tests run before
    x = torch.randn(9, D, generator=g)
    ids = torch.randint(0, E, (9, 2), generator=g)
    ws = torch.rand(9, 2, generator=g)
    torch.testing.assert_close(parts[0](x, ws, ids) + parts[1](x, ws, ids), full(x, ws, ids), atol=1e-4, rtol=1e-5)
    if expert_parallel:
        p = parts[1].w13_weight
        assert p.weight_loader(p, weights[0]["w1"], "experts.0.w1.weight", "w1", 0, return_success=True) is False
        assert p.weight_loader(p, weights[3]["w1"], "experts.3.w1.weight", "w1", 3, return_success=True) is True


def _kept(w: torch.Tensor) -> SimpleNamespace:
    """What ``pack_all`` reads of a shared-expert linear: its weight as loaded."""
    return SimpleNamespace(weight=torch.nn.Parameter(w, requires_grad=False))


def _all_and_dispatch(ex, x, ws, ids, shared=None):
    """The all-expert pass and the dispatch on the same input (``shared``: the shared expert's weights)."""
    dense = None
    if shared is not None:
        dense = (lambda v: v @ shared[0].T, lambda h: h @ shared[1].T)
    ex.pack_all(None if shared is None else tuple(map(_kept, shared)))
    assert ex.takes_all(x.shape[0])
    return ex.forward_all(x, ws, ids), ex(x, ws, ids, dense=dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("split", ["none", "tp", "ep"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_all_expert_pass_computes_the_dispatch(dtype, w4a4, split, with_shared):
    """Every expert over every token, the routing weights between the two GEMMs, is the dispatch's routed sum
    (plus the shared expert): float32 to its rounding, bfloat16 to its own (the pass rounds each weighted
    expert row once where the dispatch rounds each expert output once); on one rank, a TP rank and an EP rank
    (other ranks' experts dropped), with an expert a token picked twice (hash routing's table may) summed."""
    E, D, I = 8, 64, 64
    tp = {"none": {}, "tp": dict(tp_rank=1, tp_size=2), "ep": dict(tp_rank=1, tp_size=2, expert_parallel=True)}[split]
    ex = experts.PortableExperts(E, D, I, 10.0, activation_quant=w4a4, dtype=dtype, **tp)
    _load(ex, _expert_weights(E, D, I, seed=7))
    ex.pack()
    g = torch.Generator().manual_seed(8)
    shared = None
    if with_shared:
        shared = (
            torch.randn(2 * ex.local_intermediate, D, generator=g).to(dtype) / 8,
            torch.randn(D, ex.local_intermediate, generator=g).to(dtype) / 8,
        )
    for tokens in (1, 7, 50):
        x = torch.randn(tokens, D, generator=g).to(dtype)
        ids = torch.randint(0, E, (tokens, 2), generator=g)
        ids[0, 1] = ids[0, 0]  # one token's two picks the same expert
        ws = torch.rand(tokens, 2, generator=g)
        got, want = _all_and_dispatch(ex, x, ws, ids, shared)
        assert got.dtype == want.dtype == split_sums.partial_dtype(dtype) and got.shape == want.shape
        scale = want.float().abs().max().item()
        # bfloat16: a few roundings of 2**-9 on each term; under W4A4 the same MXFP4 codes (the SwiGLU rounds
        # as the dispatch's), so no rounding step of 2**-2 appears here
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)
        if dtype == torch.float32:  # a dropped or doubled expert is far outside float32 rounding
            wrong = ws.clone()
            wrong[0, 1] = 0.0
            bad, _ = _all_and_dispatch(ex, x, wrong, ids, shared)
            assert (bad - got).abs().max().item() > 1e3 * tol * scale or split == "ep"


@pytest.mark.parametrize("split", ["none", "ep"])
def test_w4a4_pass_leaves_experts_no_token_routed_to_out_of_the_sum(split):
    """Under W4A4 the all-expert pass runs the SwiGLU and rounding on the routed rows only: an expert no token
    picked cannot reach the sum even where its output overflows (infinite weights here, which a checkpoint load
    refuses; an overflowing GEMM gives the same), where a 0 routing weight would make its row 0 * inf = NaN; an
    expert-parallel rank drops the other rank's picks the same way."""
    E, D, I = 8, 64, 64
    tp = dict(tp_rank=0, tp_size=2, expert_parallel=True) if split == "ep" else {}
    ex = experts.PortableExperts(E, D, I, 10.0, activation_quant=True, dtype=torch.bfloat16, **tp)
    weights = _expert_weights(E, D, I, seed=9)
    weights[3]["w1"] = torch.full((I, D), float("inf"))  # expert 3: never picked below
    _load(ex, weights)
    ex.pack()
    ex.pack_all(None)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, D, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 7], [1, 6], [5, 0], [4, 2]])  # EP rank 0 holds 0-3: 7, 6, 5, 4 are rank 1's
    ws = torch.rand(5, 2, generator=g)
    assert ex.takes_all(5)
    got, want = ex.forward_all(x, ws, ids), ex(x, ws, ids)
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=0)


def test_all_expert_pass_is_taken_for_small_moes_only(monkeypatch):
    """The embedded model's MoE (8 experts + the shared one, 128 x 128) takes the all-expert pass for a decode
    step of 64 requests (BF16 and W4A4) and not for a verify window of 3 x 64 tokens (W4A4: 96); DeepSeek-V4's
    own experts (256 of 2048 x 7168) never; nothing before pack_all; pack_all refuses mis-shaped shared weights."""
    assert experts.all_experts_pay(64, 9, 128, 128, w4a4=False)
    assert not experts.all_experts_pay(192, 9, 128, 128, w4a4=False)
    assert experts.all_experts_pay(64, 8, 128, 128, w4a4=True)
    assert not experts.all_experts_pay(96, 8, 128, 128, w4a4=True)
    assert not experts.all_experts_pay(1, 256, 2048, 7168, w4a4=False)
    tiny = experts.PortableExperts(8, 128, 128, 10.0, dtype=torch.bfloat16)
    assert not tiny.takes_all(1)  # not packed
    bf16 = dict(dtype=torch.bfloat16)
    tiny.pack_all((_kept(torch.zeros(256, 128, **bf16)), _kept(torch.zeros(128, 128, **bf16))))
    assert tiny.takes_all(64) and not tiny.takes_all(192)
    with pytest.raises(ValueError, match="shared expert's weights"):
        tiny.pack_all((_kept(torch.zeros(128, 128)), _kept(torch.zeros(128, 128))))
    # a MoE whose pass would not pay with the shared expert in it makes none and reads nothing of it, even where
    # the routed experts alone would pay
    edge = experts.PortableExperts(8, 128, 128, 10.0, dtype=torch.bfloat16)
    assert edge.packs_all(with_shared=False)
    monkeypatch.setattr(experts, "ALL_EXPERTS_MACS", 8 * 3 * 128 * 128)
    assert edge.packs_all(with_shared=False) and not edge.packs_all(with_shared=True)
    emptied = SimpleNamespace(weight=torch.empty(0))  # would fail the shape check if read
    edge.pack_all((emptied, emptied))
    assert not edge.takes_all(1)
