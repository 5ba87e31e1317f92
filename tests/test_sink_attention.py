"""The sink attention through torch's CPU flash kernel equals the plain float32 formula it replaced."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.model.sink_attention import additive_mask, sink_attention, sink_attention_reference


def _case(b, s, h, d, n_keys, n_picks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    keys = torch.randn(b, n_keys, d, generator=g).to(dtype)
    masked = torch.rand(b, s, n_keys, generator=g) < 0.3
    masked[..., 0] = False  # every query sees a key of the shared set (a window holds the query's own row)
    picks = torch.randn(b, s, n_picks, d, generator=g).to(dtype)
    unseen = torch.rand(b, s, n_picks, generator=g) < 0.4
    unseen[0, 0] = True  # a query none of whose picks is visible: its set must contribute nothing
    sink = torch.randn(h, generator=g) * 2
    return q, keys, masked, picks, unseen, sink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, s, n_keys, n_picks", [(1, 1, 128, 0), (5, 1, 130, 0), (3, 4, 40, 7), (2, 32, 60, 16)])
def test_flash_sink_attention_equals_the_float32_formula(dtype, b, s, n_keys, n_picks):
    h, d, scale = 4, 64, 64**-0.5
    q, keys, masked, picks, unseen, sink = _case(b, s, h, d, n_keys, n_picks, dtype)
    per_query = (picks, unseen) if n_picks else None
    got = sink_attention(q, (keys, additive_mask(masked, dtype)), per_query, sink, scale)
    parts = [(keys, masked)] + ([(picks, unseen)] if n_picks else [])
    want = sink_attention_reference(q, parts, sink, scale)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: the same sums in another order; bfloat16: the kernel's bf16 probabilities and one more rounding
    atol = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_the_sink_takes_its_share():
    """A sink far above every score leaves almost nothing; far below, plain softmax attention."""
    q, keys, masked, _, _, _ = _case(2, 3, 2, 32, 20, 0, torch.float32, seed=1)
    mask = additive_mask(masked, torch.float32)
    huge = sink_attention(q, (keys, mask), None, torch.full((2,), 80.0), 0.2)
    assert huge.abs().max() < 1e-20
    tiny = sink_attention(q, (keys, mask), None, torch.full((2,), -80.0), 0.2)
    logits = torch.einsum("bshd,bkd->bshk", q, keys) * 0.2
    plain = torch.einsum("bshk,bkd->bshd", logits.masked_fill(masked.unsqueeze(2), float("-inf")).softmax(-1), keys)
    torch.testing.assert_close(tiny, plain, atol=2e-6, rtol=0)
