"""torch's reference of DeepSeek's ``sparse_attn(q, kv, sink, topk_idxs, scale)`` (``cpu/sparse_attn.py``): each
query's own rows, ``-1`` masked, the sink in the denominator; its chunking changes nothing."""

from __future__ import annotations

import torch

from vllm_dsv4_mtp.cpu import sparse_attn


def _case(t, h, d, n_rows, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n_rows, d, generator=g)
    idx = torch.randint(0, n_rows, (t, k), generator=g).masked_fill_(torch.rand(t, k, generator=g) < 0.3, -1)
    return q, kv, idx, torch.randn(h, generator=g) * 2


def test_each_query_attends_its_own_rows_with_the_sink():
    q, kv, idx, sink = _case(7, 3, 32, 50, 11)
    idx[2] = -1  # a query that sees no key: the sink takes all the weight
    got = sparse_attn.sparse_attn_reference(q, kv, sink, idx, 0.2)
    for t in range(7):
        rows = kv[idx[t][idx[t] >= 0]]
        logits = torch.cat([(q[t] @ rows.T) * 0.2, sink[:, None]], dim=-1)
        want = logits.softmax(-1)[:, :-1] @ rows
        torch.testing.assert_close(got[t], want, atol=2e-6, rtol=0)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_masked_rows_may_hold_anything_and_chunks_change_nothing(monkeypatch):
    q, kv, idx, sink = _case(9, 2, 16, 30, 8, seed=1)
    whole = sparse_attn.sparse_attn_reference(q, kv, sink, idx, 0.3)
    hidden = sorted(set(range(30)) - set(idx[idx >= 0].tolist()))
    kv[hidden] = float("nan")
    idx[idx < 0] = -1
    monkeypatch.setattr(sparse_attn, "GATHER_BUDGET", 16 * 8 * 2)  # two queries a chunk
    torch.testing.assert_close(sparse_attn.sparse_attn_reference(q, kv, sink, idx, 0.3), whole, atol=0, rtol=0)


def test_the_sink_takes_its_share():
    """A sink far above every score leaves almost nothing."""
    q, kv, idx, _ = _case(4, 2, 32, 20, 6, seed=2)
    assert sparse_attn.sparse_attn_reference(q, kv, torch.full((2,), 80.0), idx, 0.2).abs().max() < 1e-20
