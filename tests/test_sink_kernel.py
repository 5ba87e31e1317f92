"""The compiled sink-attention kernel (``model/sink_kernel.py``) against the float32 reference."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.model import sink_kernel
from vllm_dsv4_mtp.model.sink_attention import sink_attention_reference

CPU = torch.device("cpu")


def _case(dtype, b, s, h, d, n_shared, k, seed, p_hidden=0.3, n_rows=500):
    g = torch.Generator().manual_seed(seed)
    pieces = torch.randn(n_rows, d, generator=g).to(dtype)
    q = (torch.randn(b, s, h, d, generator=g) * 2).to(dtype)
    shared = torch.randint(0, n_rows, (b, n_shared), generator=g)
    hidden = torch.rand(b, s, n_shared, generator=g) < p_hidden
    own = torch.randint(0, n_rows, (b, s, k), generator=g) if k else None
    own_hidden = (torch.rand(b, s, k, generator=g) < p_hidden) if k else None
    sink = torch.randn(h, generator=g)
    return pieces, q, shared, hidden, own, own_hidden, sink


def _reference(pieces, q, shared, hidden, own, own_hidden, sink, scale):
    parts = [(pieces[shared], hidden)] + ([] if own is None else [(pieces[own], own_hidden)])
    return sink_attention_reference(q.float(), [(k.float(), m) for k, m in parts], sink, scale)


def test_the_kernel_builds_and_passes_its_probe_here():
    """This machine has a C compiler (the project's set-up needs one): the portable attention's short segments
    take the kernel in float32 and bfloat16, and the build is cached (a second build is the same file)."""
    path = sink_kernel.build()  # raises, naming the compiler's problem, where there is none or it fails
    assert sink_kernel.usable(torch.float32, 128, CPU) and sink_kernel.usable(torch.bfloat16, 128, CPU)
    assert path.exists() and sink_kernel.build() == path
    assert not sink_kernel.usable(torch.float16, 128, CPU) and not sink_kernel.usable(torch.float32, 120, CPU)


@pytest.mark.parametrize("b,s,h,d,n_shared,k", [
    (1, 1, 4, 128, 144, 0),  # a decode of a C128 / SWA layer
    (64, 1, 4, 128, 128, 16),  # a batch of C4 decodes: window + picks
    (5, 3, 3, 64, 40, 7),  # verify windows, an odd head count
    (2, 16, 1, 512, 33, 4),  # the longest kernel segment, one head, DeepSeek-V4's head size
    (3, 2, 5, 16, 1, 1),  # one shared key and one pick
])
def test_kernel_equals_the_float32_reference(b, s, h, d, n_shared, k):
    """float32 rows: the reference's function within float32 rounding (1e-5 here, on outputs of order 1)."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.float32, b, s, h, d, n_shared, k, seed=b + s)
    got = sink_kernel.attend_rows(q, pieces, shared, hidden, own, own_hidden, sink, d**-0.5)
    want = _reference(pieces, q, shared, hidden, own, own_hidden, sink, d**-0.5)
    assert want.abs().max() > 0.3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("b,s,k", [(64, 1, 16), (4, 3, 16), (2, 7, 0)])
def test_kernel_rounds_bfloat16_once(b, s, k):
    """bfloat16 rows: float32 arithmetic, one rounding at the output, so every element is within half a
    bfloat16 step (2^-8 relative) of the float32 reference (torch's flash kernel also rounds the probabilities
    to bfloat16 before the value product, which this bound does not allow)."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.bfloat16, b, s, 4, 128, 144, k, seed=7 + s)
    got = sink_kernel.attend_rows(q, pieces, shared, hidden, own, own_hidden, sink, 128**-0.5)
    want = _reference(pieces, q, shared, hidden, own, own_hidden, sink, 128**-0.5)
    assert got.dtype == torch.bfloat16 and want.abs().max() > 0.3
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 * 1.001 + 1e-6).all()


def test_queries_that_see_no_key_get_zero_and_masked_keys_do_not_count():
    """A query whose keys are all hidden gets 0 (the sink takes all the weight); changing hidden keys' rows
    changes nothing."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.float32, 3, 2, 4, 64, 20, 5, seed=3)
    hidden[1, 0] = True
    own_hidden[1, 0] = True
    got = sink_kernel.attend_rows(q, pieces, shared, hidden, own, own_hidden, sink, 0.125)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0])) and got[1, 1].abs().max() > 0
    # overwrite the rows that only hidden keys point at (a row one query may not see, another may)
    seen = set(shared[~hidden.all(dim=1)].tolist()) | set(own[~own_hidden].tolist())
    hidden_only = [r for r in set(shared.flatten().tolist()) | set(own.flatten().tolist()) if r not in seen]
    assert hidden_only
    pieces[hidden_only] = 1e4
    again = sink_kernel.attend_rows(q, pieces, shared, hidden, own, own_hidden, sink, 0.125)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_extreme_scores_and_nan():
    """Scores far above and below the sink stay finite (the max is subtracted; e^x under e^-104 is 0); a NaN
    query gives NaN for its heads, as the reference does, and leaves the other queries alone."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.float32, 2, 1, 2, 32, 12, 0, seed=9,
                                                             p_hidden=0.0)
    for factor in (400.0, -400.0):
        qq = q * factor
        got = sink_kernel.attend_rows(qq, pieces, shared, hidden, None, None, sink, 1.0)
        want = _reference(pieces, qq, shared, hidden, None, None, sink, 1.0)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    q[0, 0, 1, 3] = float("nan")
    got = sink_kernel.attend_rows(q, pieces, shared, hidden, None, None, sink, 1.0)
    assert got[0, 0, 1].isnan().all() and torch.isfinite(got[0, 0, 0]).all() and torch.isfinite(got[1]).all()


def test_strided_queries_are_read_in_place():
    """Query rows ``H + 1`` heads apart (the layer's queries are a view of queries and latent side by side)."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.float32, 4, 3, 4, 64, 30, 4, seed=12)
    wide = torch.cat([q, torch.full_like(q[:, :, :1], float("nan"))], dim=2)[:, :, :4]
    assert wide.stride(1) == 5 * 64
    got = sink_kernel.attend_rows(wide, pieces, shared, hidden, own, own_hidden, sink, 0.125)
    torch.testing.assert_close(got, sink_kernel.attend_rows(q, pieces, shared, hidden, own, own_hidden, sink,
                                                            0.125), atol=0, rtol=0)


def test_bad_calls_are_errors_not_reads_out_of_bounds():
    """An index outside the piece table, mismatched shapes or dtypes are errors naming the problem."""
    pieces, q, shared, hidden, own, own_hidden, sink = _case(torch.float32, 2, 1, 4, 64, 10, 3, seed=1)
    bad = shared.clone()
    bad[1, 4] = pieces.shape[0]
    with pytest.raises(sink_kernel.KernelError, match="outside the cache's piece table"):
        sink_kernel.attend_rows(q, pieces, bad, hidden, own, own_hidden, sink, 0.125)
    with pytest.raises(sink_kernel.KernelError, match="outside the cache's piece table"):
        sink_kernel.attend_rows(q, pieces, shared, hidden, own - 10_000, own_hidden, sink, 0.125)
    with pytest.raises(ValueError, match="shared keys"):
        sink_kernel.attend_rows(q, pieces, shared, hidden[:, :, :5], own, own_hidden, sink, 0.125)
    with pytest.raises(ValueError, match="own keys"):
        sink_kernel.attend_rows(q, pieces, shared, hidden, own[:, :, :2], own_hidden, sink, 0.125)
    with pytest.raises(ValueError, match="piece table"):
        sink_kernel.attend_rows(q.bfloat16(), pieces, shared, hidden, own, own_hidden, sink, 0.125)


def test_without_a_compiler_the_build_says_so(monkeypatch, tmp_path):
    """``$CC`` naming no compiler: ``build`` raises (``usable`` then logs it and the attention keeps torch's
    path); a compiler that fails: the compiler's error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(OSError, match="no C compiler"):
        sink_kernel.build()
    monkeypatch.setenv("CC", "false")
    with pytest.raises(Exception) as e:
        sink_kernel.build()
    assert "false" in str(e.value) or getattr(e.value, "returncode", 0)
    assert not list(tmp_path.rglob("*.so"))
