"""The plugin's compiled CPU loops (``cpu/compiled.py``): ``sparse_attn`` (``cpu/sparse_attn.py``) against
torch's float32 reference, the W4A4 rounding (``cpu/mxfp4_round.py``) against ``mxfp4.fake_quant`` bit for
bit, and their build."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.cpu import compiled as cpu_kernels
from vllm_dsv4_mtp.cpu import mxfp4_round
from vllm_dsv4_mtp.cpu.kit import KIT, round_to_mxfp4
from vllm_dsv4_mtp.cpu.sparse_attn import sparse_attn_compiled, sparse_attn_reference
from vllm_dsv4_mtp.formats import mxfp4

CPU = torch.device("cpu")


def _case(dtype, b, s, h, d, n_shared, k, seed, p_masked=0.3, n_rows=500):
    g = torch.Generator().manual_seed(seed)
    pieces = torch.randn(n_rows, d, generator=g).to(dtype)
    q = (torch.randn(b, s, h, d, generator=g) * 2).to(dtype)
    shared = torch.randint(0, n_rows, (b, n_shared), generator=g)
    masked = torch.rand(b, s, n_shared, generator=g) < p_masked
    own = torch.randint(0, n_rows, (b, s, k), generator=g) if k else None
    own_masked = (torch.rand(b, s, k, generator=g) < p_masked) if k else None
    sink = torch.randn(h, generator=g)
    return pieces, q, shared, masked, own, own_masked, sink


def _contract(q, shared, masked, own, own_masked):
    """Segments ``q [B, S, H, d]`` with shared keys and own picks -> DeepSeek's ``q [T, H, d]``, ``topk_idxs [T, K]``
    (-1 = masked)."""
    b, s, h, d = q.shape
    idx = shared[:, None, :].expand(b, s, -1).masked_fill(masked, -1)
    if own is not None:
        idx = torch.cat([idx, own.masked_fill(own_masked, -1)], dim=-1)
    return q.reshape(b * s, h, d), idx.reshape(b * s, -1)


def attend_rows(q, pieces, shared, masked, own, own_masked, sink, scale):
    qq, idx = _contract(q, shared, masked, own, own_masked)
    return sparse_attn_compiled(qq, pieces, sink, idx, scale).view(q.shape)


def _reference(pieces, q, shared, masked, own, own_masked, sink, scale):
    qq, idx = _contract(q.float(), shared, masked, own, own_masked)
    return sparse_attn_reference(qq, pieces.float(), sink, idx, scale).view(q.shape)


def test_the_loops_build_and_pass_their_probes_here():
    """This machine has a C compiler (the project's set-up needs one): every loop builds, the build is cached (a
    second build is the same file), the portable attention's short segments take the kernel in float32 and
    bfloat16, and the MoE's W4A4 rounding takes its loop."""
    assert cpu_kernels.NAMES == ("mxfp4_round", "sparse_attn")
    for name in cpu_kernels.NAMES:  # raises, naming the compiler's problem, where there is none or it fails
        path = cpu_kernels.build(name)
        assert path.exists() and cpu_kernels.build(name) == path
    assert KIT.sparse_attn_loop(torch.float32, 128, CPU) and KIT.sparse_attn_loop(torch.bfloat16, 128, CPU)
    assert not KIT.sparse_attn_loop(torch.float16, 128, CPU) and not KIT.sparse_attn_loop(torch.float32, 120, CPU)
    assert KIT.mxfp4_round()


@pytest.mark.parametrize(
    "b,s,h,d,n_shared,k",
    [
        (1, 1, 4, 128, 144, 0),  # a decode of a C128 / SWA layer
        (64, 1, 4, 128, 128, 16),  # a batch of C4 decodes: window + picks
        (5, 3, 3, 64, 40, 7),  # verify windows, an odd head count
        (2, 16, 1, 512, 33, 4),  # the longest kernel segment, one head, DeepSeek-V4's head size
        (3, 2, 5, 16, 1, 1),  # one shared key and one pick
    ],
)
def test_kernel_equals_the_float32_reference(b, s, h, d, n_shared, k):
    """float32 rows: the reference's function within float32 rounding (1e-5 here, on outputs of order 1)."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.float32, b, s, h, d, n_shared, k, seed=b + s)
    got = attend_rows(q, pieces, shared, masked, own, own_masked, sink, d**-0.5)
    want = _reference(pieces, q, shared, masked, own, own_masked, sink, d**-0.5)
    assert want.abs().max() > 0.3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("b,s,k", [(64, 1, 16), (4, 3, 16), (2, 7, 0)])
def test_kernel_rounds_bfloat16_once(b, s, k):
    """bfloat16 rows: float32 arithmetic, one rounding at the output, so every element is within half a
    bfloat16 step (2^-8 relative) of the float32 reference (torch's flash kernel also rounds the probabilities
    to bfloat16 before the value product, which this bound does not allow)."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.bfloat16, b, s, 4, 128, 144, k, seed=7 + s)
    got = attend_rows(q, pieces, shared, masked, own, own_masked, sink, 128**-0.5)
    want = _reference(pieces, q, shared, masked, own, own_masked, sink, 128**-0.5)
    assert got.dtype == torch.bfloat16 and want.abs().max() > 0.3
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 * 1.001 + 1e-6).all()


def test_queries_that_see_no_key_get_zero_and_masked_keys_do_not_count():
    """A query whose keys are all masked gets 0 (the sink takes all the weight); changing masked keys' rows
    changes nothing."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.float32, 3, 2, 4, 64, 20, 5, seed=3)
    masked[1, 0] = True
    own_masked[1, 0] = True
    got = attend_rows(q, pieces, shared, masked, own, own_masked, sink, 0.125)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0])) and got[1, 1].abs().max() > 0
    # overwrite the rows that only masked keys point at (a row one query may not see, another may)
    seen = set(shared[~masked.all(dim=1)].tolist()) | set(own[~own_masked].tolist())
    hidden_only = [r for r in set(shared.flatten().tolist()) | set(own.flatten().tolist()) if r not in seen]
    assert hidden_only
    pieces[hidden_only] = 1e4
    again = attend_rows(q, pieces, shared, masked, own, own_masked, sink, 0.125)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_extreme_scores_and_nan():
    """Scores far above and below the sink stay finite (the max is subtracted; e^x under e^-104 is 0); a NaN
    query gives NaN for its heads, as the reference does, and leaves the other queries alone."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.float32, 2, 1, 2, 32, 12, 0, seed=9, p_masked=0.0)
    for factor in (400.0, -400.0):
        qq = q * factor
        got = attend_rows(qq, pieces, shared, masked, None, None, sink, 1.0)
        want = _reference(pieces, qq, shared, masked, None, None, sink, 1.0)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    q[0, 0, 1, 3] = float("nan")
    got = attend_rows(q, pieces, shared, masked, None, None, sink, 1.0)
    assert got[0, 0, 1].isnan().all() and torch.isfinite(got[0, 0, 0]).all() and torch.isfinite(got[1]).all()


def test_strided_queries_are_read_in_place():
    """Query rows ``H + 1`` heads apart (the layer's queries are a view of queries and latent side by side)."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.float32, 4, 3, 4, 64, 30, 4, seed=12)
    q, idx = _contract(q, shared, masked, own, own_masked)
    wide = torch.cat([q, torch.full_like(q[:, :1], float("nan"))], dim=1)[:, :4]
    assert wide.stride(0) == 5 * 64
    got = sparse_attn_compiled(wide, pieces, sink, idx, 0.125)
    torch.testing.assert_close(got, sparse_attn_compiled(q, pieces, sink, idx, 0.125), atol=0, rtol=0)


def test_bad_calls_are_errors_not_reads_out_of_bounds():
    """An index outside kv (or below -1), mismatched shapes or dtypes (int32 indices, too few sink logits: the C
    would read past them) are errors naming the problem."""
    pieces, q, shared, masked, own, own_masked, sink = _case(torch.float32, 2, 1, 4, 64, 10, 3, seed=1)
    q, idx = _contract(q, shared, masked, own, own_masked)
    for wrong in (pieces.shape[0], -2):
        bad = idx.clone()
        bad[1, 4] = wrong
        with pytest.raises(cpu_kernels.KernelError, match="an index outside kv"):
            sparse_attn_compiled(q, pieces, sink, bad, 0.125)
    with pytest.raises(ValueError, match="against a"):
        sparse_attn_compiled(q.bfloat16(), pieces, sink, idx, 0.125)
    for bad_idx, bad_sink in ((idx.int(), sink), (idx[:1], sink), (idx, sink[:2])):
        with pytest.raises(ValueError, match="int64 topk_idxs"):
            sparse_attn_compiled(q, pieces, bad_sink, bad_idx, 0.125)


def test_without_a_compiler_the_build_says_so(monkeypatch, tmp_path):
    """``$CC`` naming no compiler: ``build`` raises (``library`` then logs it and returns None: the callers keep
    their torch path); a compiler that fails: the compiler's error, and no file left behind."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(OSError, match="no C compiler"):
        cpu_kernels.build("sparse_attn")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library("mxfp4_round") is None
    finally:
        cpu_kernels.library.cache_clear()
    monkeypatch.setenv("CC", "false")
    with pytest.raises(Exception) as e:
        cpu_kernels.build("sparse_attn")
    assert "false" in str(e.value) or getattr(e.value, "returncode", 0)
    assert not list(tmp_path.rglob("*.so"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def test_mxfp4_loop_is_fake_quant_on_every_bfloat16_pattern():
    """Every bfloat16 bit pattern in order (NaN and inf among them), alone in a block of zeros, and shuffled
    among the finite ones: the same bits as ``mxfp4.fake_quant`` (NaN payloads aside)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    alone = torch.zeros(every.numel(), 32, dtype=torch.bfloat16)
    alone[:, 7] = every
    finite = every[every.isfinite()]
    shuffled = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))]
    for x in (every.reshape(-1, 32), alone, shuffled[: finite.numel() // 64 * 64].reshape(-1, 64)):
        got = mxfp4_round.compiled_round(x)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        same = _same_bits(got, mxfp4.fake_quant(x))
        assert same.all(), (x[~same][:4], got[~same][:4])


def test_mxfp4_loop_is_fake_quant_on_random_float32_bits():
    """1M random float32 bit patterns (every exponent, subnormals, NaN, inf) and scaled normals, as float32 rows
    and 3-d batches: the same bits as ``mxfp4.fake_quant``."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    normals = torch.randn(4, 16, 128, generator=g) * torch.logspace(-30, 30, 16).view(1, 16, 1)
    for x in (bits.view(torch.float32).reshape(-1, 64), normals):
        same = _same_bits(mxfp4_round.compiled_round(x), mxfp4.fake_quant(x))
        assert same.all(), x[~same][:4]


def test_round_to_mxfp4_takes_the_loop_only_where_it_serves(monkeypatch):
    """bfloat16 / float32 CPU rows of a multiple of 32 take the loop; float16, an odd width or a machine without
    the library take ``fake_quant`` (the same bits), never an error."""
    calls = []
    monkeypatch.setattr(mxfp4_round, "compiled_round", lambda x: calls.append(x.dtype) or mxfp4.fake_quant(x))
    x = torch.randn(3, 64)
    for t in (x, x.bfloat16(), x.half()):
        assert torch.equal(round_to_mxfp4(t), mxfp4.fake_quant(t))
    assert calls == [torch.float32, torch.bfloat16]
    with pytest.raises(ValueError, match="multiple of 32"):  # the codec's own error for a width it cannot block
        round_to_mxfp4(torch.randn(2, 48))
    monkeypatch.setattr(KIT, "mxfp4_round", lambda: False)
    calls.clear()
    assert torch.equal(round_to_mxfp4(x), mxfp4.fake_quant(x)) and not calls


def _kit_log(run) -> list[str]:
    """The kit logger's messages while ``run()`` runs (a handler of its own: vLLM's logging may not propagate)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("vllm.dsv4_mtp.cpu_kit")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def test_the_kit_probes_once_and_reports_in_one_line(monkeypatch):
    """The kit answers each question once per process (a second asking runs no probe), with float32 as torch's
    default dtype whatever the caller's (vLLM builds models under theirs), and ``report`` logs the answers a model
    asks for in one line, once per question set: the MXFP4 loop only for W4A4 experts."""
    from vllm_dsv4_mtp.cpu import kit

    fresh = kit.CpuKit()
    seen = []
    real = kit._probe_mxfp4_round
    monkeypatch.setattr(kit, "_probe_mxfp4_round", lambda: seen.append(torch.get_default_dtype()) or real())
    prior = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert fresh.mxfp4_round() and fresh.mxfp4_round()
        assert torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(prior)
    assert seen == [torch.float32]

    def ask(w4a4):
        return lambda: fresh.report(torch.bfloat16, head_dim=64, norm_widths=(64, 128), eps=1e-6, w4a4=w4a4)

    lines = _kit_log(lambda: (ask(True)(), ask(True)()))
    assert len(lines) == 1, lines
    for name in ("sink-attention loop yes", "vLLM paged window kernel yes", "MXFP4 rounding loop yes"):
        assert name in lines[0], lines[0]
    for name in ("rms_norm kernel (64 channels)", "rms_norm kernel (128 channels)", "native 16-bit GEMM", "fused mHC"):
        assert name in lines[0], lines[0]
    lines = _kit_log(ask(False))
    assert len(lines) == 1 and "MXFP4" not in lines[0], lines
    assert seen == [torch.float32]
