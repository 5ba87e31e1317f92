"""The attention backend: platform choice, row widths, and the step's paged addressing.

The addressing tests build the step's metadata (``attention/metadata.py``) the way vLLM's runner would for a
batch mixing a chunked-prefill continuation, a fresh prefill, a decode, a 3-token speculative verify and a
padding request (plus a padding token), over a shuffled block table, write identifiable rows through the layer,
and check that every query's ``topk_idxs`` address exactly the rows of its own sequence it may see: the window,
the rows holding compressed entries (the completing token of each complete block), and, for the blocks the step
completes, the rows they pool; rows beyond ``seq_len`` (rejected drafts) are never addressed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dsv4_mtp.attention import rows as ac
from vllm_dsv4_mtp.attention.backend import DeepseekV4SparseAttention
from vllm_dsv4_mtp.attention.metadata import SEGMENT, StepPlan, build_step


def test_platform_choice():
    from vllm_dsv4_mtp import platform

    assert platform.implementation(gfx950=True) == platform.IN_TREE
    assert platform.implementation(gfx950=False) == platform.PORTABLE
    assert platform.implementation() == platform.PORTABLE  # this CPU


def test_row_widths():
    # head_dim 512, index_head_dim 128 (the real models)
    assert ac.layer_row_width(0, 512, 128) == 512
    assert ac.layer_row_width(128, 512, 128) == 512 + 2 * 512
    assert ac.layer_row_width(4, 512, 128) == 512 + 2 * 2 * 512 + 2 * 2 * 128
    assert ac.cache_row_width([128, 128, 4, 128], 512, 128) == 3072
    assert ac.cache_row_width([0, 0], 512, 128) == 512


def test_entries_live_in_channels_only_their_own_block_reads():
    d, di = 512, 128
    # C4 row: kv [0, d) | c [d, 3d) | z [3d, 5d) | c_I [5d, 5d + 2dI) | z_I [.., 5d + 4dI)
    c4 = ac.entry_channels(4, d, di)
    assert c4 == {"kv": 0, "kv_gate": d, "entry": 2 * d, "index_kv_gate": 5 * d, "ikey": 5 * d + di}
    # the entry overwrites c[d:2d] (second half: pooled only into the row's own block), the key c_I[dI:2dI]
    assert c4["entry"] == c4["kv_gate"] + d and c4["ikey"] == c4["index_kv_gate"] + di
    assert c4["ikey"] + di <= ac.layer_row_width(4, d, di)
    c128 = ac.entry_channels(128, d, di)
    assert c128 == {"kv": 0, "kv_gate": d, "entry": d}  # c[0:d] of the completing row (disjoint blocks)
    assert ac.entry_channels(0, d, di) == {"kv": 0}


def _vllm_config(block_size, dtype=torch.float32, ctx=None):
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size),
        model_config=SimpleNamespace(dtype=dtype),
        compilation_config=SimpleNamespace(static_forward_context={} if ctx is None else ctx),
    )


def _layer(vc, **kw):
    args = dict(prefix="model.layers.0.attn", num_heads=1, head_dim=4, window=5, compress_ratio=0, row_width=6)
    return DeepseekV4SparseAttention(vc, **{**args, "cache_width": 8, **kw})


def _core(cache_width=8, block_size=4, num_blocks=12):
    vc = _vllm_config(block_size)
    core = _layer(vc, cache_width=cache_width)
    assert vc.compilation_config.static_forward_context["model.layers.0.attn"] is core
    spec = core.get_kv_cache_spec(vc)
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.block_size) == (1, cache_width, 0, block_size)
    core.bind_kv_cache(torch.full((num_blocks, 1, block_size, cache_width), float("nan")))
    return core


def _row(req, pos, version=0.0):
    return torch.tensor([req, pos, req * 1000 + pos, version, 2.0, 3.0])


class _Steps:
    """Drives one layer through steps of a batch; rows carry (request, position, version)."""

    bs = 4
    tables = {0: [7, 2, 9], 1: [4, 11], 2: [0, 5, 3], 3: [10, 1, 6, 8]}  # request -> shuffled blocks

    def __init__(self, window=5, ratios=(3, 4)):
        self.core = _core()
        self.plan = StepPlan(window=window, head_dim=4, pieces=2, ratios=ratios)
        self.written = {r: 0 for r in self.tables}

    def step(self, batch, version=0.0):
        """batch: list of (req, n_new_tokens) or (None, 0) padding; returns (metadata, request of each token)."""
        rows, slots, qsl, seq_lens, tab, owner = [], [], [0], [], [], []
        for req, n in batch:
            t = self.tables.get(req, [0])
            tab.append(t + [0] * (4 - len(t)))
            start = self.written.get(req, 0)
            for p in range(start, start + n):
                rows.append(_row(req, p, version))
                slots.append(t[p // self.bs] * self.bs + p % self.bs)
                owner.append(req)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        slots.append(-1)  # a padded token slot
        md = build_step(
            self.plan,
            query_start_loc=np.array(qsl),
            seq_lens=np.array(seq_lens),
            block_table=np.array(tab),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_actual_tokens=len(slots),
            block_size=self.bs,
        )
        self.core.write(md, md.positions, torch.stack(rows + [torch.full((6,), 99.0)]))
        for req, n in batch:
            if req is not None:
                self.written[req] += n
        return md, owner

    def seen(self, slots, masked=None):
        """(request, position, version) of the rows at ``slots`` not masked, in order."""
        rows = self.core.rows.gather(slots, 0, 6)
        keep = torch.ones(slots.shape, dtype=torch.bool) if masked is None else ~masked
        return [(int(r[0]), int(r[1]), float(r[3])) for r in rows[keep]]

    def seen_pieces(self, idx, piece):
        """(request, position, version) of the rows whose piece ``piece`` is at ``idx [K]`` (-1 left out)."""
        slots = torch.tensor([b * self.bs + o for b in range(12) for o in range(self.bs)])
        where = ac.piece_index(slots, piece, 1, pieces=2, block_size=self.bs).squeeze(-1).tolist()
        slot_of = dict(zip(where, slots.tolist()))
        return self.seen(torch.tensor([slot_of[i] for i in idx.tolist() if i >= 0], dtype=torch.int64))


def test_addressing_of_a_mixed_batch():
    st = _Steps()
    st.step([(0, 6), (1, 3)])  # prefills (request 0's first chunk)
    md, owner = st.step([(0, 5), (2, 9), (1, 1), (None, 0)])  # chunk continuation, prefill, decode, padding
    assert md.num_tokens == 15 and md.num_actual_tokens == 16
    assert md.positions.tolist() == list(range(6, 11)) + list(range(9)) + [3]
    # the padded token is not stored; the real ones are, at their slots
    assert st.seen(torch.tensor([7 * 4 + 2, 2 * 4 + 2, 9 * 4 + 2])) == [(0, 2, 0.0), (0, 6, 0.0), (0, 10, 0.0)]
    for t, (req, p) in enumerate(zip(owner, md.positions.tolist())):
        assert st.seen_pieces(md.window_idxs[t], 0) == [(req, k, 0.0) for k in range(max(0, p - 4), p + 1)]
        want = [(req, 3 * j + 2, 0.0) for j in range((p + 1) // 3)]
        assert st.seen_pieces(md.entry_idxs[3][t], 1) == want
    for ratio in (4, 3):
        done = md.completions[ratio]
        ends = [(req, p) for req, p in zip(owner, md.positions.tolist()) if p % ratio == ratio - 1]
        span = 2 * ratio if ratio == 4 else ratio
        assert len(done.dst) == len(ends)
        for m, (req, p) in enumerate(ends):
            assert st.seen(done.dst[m : m + 1]) == [(req, p, 0.0)]
            assert st.seen(done.row_slots[m], ~done.row_valid[m, :, 0]) == [
                (req, k, 0.0) for k in range(max(0, p - span + 1), p + 1)
            ]
            assert int(done.block_pos[m]) == p - ratio + 1
    # C4: each segment's candidate entries, through the segment layout and back
    seg = md.indexer
    s = seg.masked.shape[1]
    assert s == min(9, SEGMENT) and seg.masked.shape[0] == 3
    for t, (req, p) in enumerate(zip(owner, md.positions.tolist())):
        g, o = divmod(int(seg.output_index[t]), s)
        assert int(seg.query_index[g * s + o]) == t
        want = [(req, 4 * j + 3, 0.0) for j in range((p + 1) // 4)]
        assert st.seen(seg.slots[g], seg.masked[g, o]) == want and int(seg.limit[g, o, 0]) == len(want)


def test_rows_of_rejected_drafts_are_never_addressed():
    st = _Steps(window=64, ratios=(2, 3, 4))
    st.step([(0, 6), (1, 3)])
    st.step([(0, 5), (2, 9), (1, 1)])
    # speculative verify: 1 + 2 drafts at positions 4, 5, 6 (the draft at 6 closes a block of 7 and of 3 and
    # 5 one of 2), both drafts rejected; the next step recomputes position 5 with the corrected token (new row
    # content) and the stale draft row of position 6 stays in the cache beyond seq_len
    st.step([(1, 3)], version=7.0)
    st.written[1] -= 2
    md, owner = st.step([(1, 1), (3, 13)], version=9.0)
    for t, (req, p) in enumerate(zip(owner, md.positions.tolist())):
        for ratio in (2, 3):
            seen = st.seen_pieces(md.window_idxs[t], 0) + st.seen_pieces(md.entry_idxs[ratio][t], 1)
            assert all(k <= p for _, k, _ in seen) and {r for r, _, _ in seen} <= {req}
            if req == 1:
                assert (1, 6, 7.0) not in seen and (1, 5, 9.0) in seen and (1, 4, 7.0) in seen
    # the corrected position 5 closes a block of 2: pooled from the accepted rows only
    done = md.completions[2]
    assert st.seen(done.row_slots[0], ~done.row_valid[0, :, 0]) == [(1, 4, 7.0), (1, 5, 9.0)]


def test_decode_and_verify_steps_use_the_identity_layout():
    st = _Steps()
    st.step([(0, 6), (1, 3), (2, 2)])
    md, _ = st.step([(0, 1), (1, 1), (None, 0), (2, 1)])
    assert md.indexer.masked.shape[:2] == (3, 1) and md.indexer.query_index is None
    assert md.positions.tolist() == [6, 3, 2]
    md, _ = st.step([(0, 3), (1, 3), (2, 3)])  # verify windows of K + 1 = 3 tokens each
    assert md.indexer.masked.shape[:2] == (3, 3) and md.indexer.output_index is None


def test_positions_must_match_the_addressing():
    st = _Steps()
    st.step([(0, 6)])
    md, _ = st.step([(0, 2)])
    with pytest.raises(ValueError, match="positions differ from seq_lens - query_lens") as e:
        st.core.write(md, torch.tensor([6, 8]), torch.zeros(3, 6))
    assert str(e.value).endswith("token 1 is at 8, addressed at 7")


def test_row_channels_round_trip_through_the_piece_major_blocks():
    """Rows written, entries put across a piece boundary, and pieces gathered by index all address the same
    channels of the same slot; piece 0 of a block's rows is one contiguous run (what the window gathers read)."""
    st = _Steps()
    st.step([(0, 6), (1, 3), (3, 13)])
    rows_, bs = st.core.rows, st.bs
    slots = torch.tensor([[7 * bs + 1, 2 * bs + 1], [4 * bs + 2, 10 * bs + 3]])  # request 0 pos 1 / 5, 1 pos 2, 3 pos 3
    want = [(0, 1), (0, 5), (1, 2), (3, 3)]
    rows = rows_.gather(slots, 0, 6).view(4, 6)
    assert [(int(r[0]), int(r[1])) for r in rows] == want
    assert torch.equal(rows[:, 2], torch.tensor([1000.0 * r + p for r, p in want]))
    # channels 3..5 span the two 4-wide pieces
    rows_.put(slots.reshape(-1), 3, torch.tensor([[-1.0, -2.0, -3.0]] * 4))
    assert torch.equal(rows_.gather(slots, 2, 4).view(4, 4)[:, 1:], torch.tensor([[-1.0, -2.0, -3.0]] * 4))
    assert torch.equal(rows_.gather(slots, 0, 3).view(4, 3), rows[:, :3])  # neighbours untouched
    for piece in (0, 1):
        idx = ac.piece_index(slots, piece, 1, pieces=2, block_size=bs).squeeze(-1)
        assert torch.equal(rows_.table[idx], rows_.gather(slots, 4 * piece, 4))
    with pytest.raises(ValueError, match="channels 6..10 are outside the 8-wide cache rows"):
        rows_.gather(slots, 6, 4)
    block7 = st.core.kv_cache[7, 0].reshape(-1)  # request 0's first block, positions 0..3
    assert torch.equal(block7[: 4 * 4].view(4, 4)[:, :2], torch.tensor([[0.0, p] for p in range(4)]))


def test_kv_cache_dtype_other_than_model_dtype_is_refused():
    vc = _vllm_config(16, dtype=torch.bfloat16)
    vc.cache_config.cache_dtype = "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by the portable DeepSeek-V4"):
        _layer(vc)


def test_duplicate_layer_name_is_refused():
    core = _core()
    vc = _vllm_config(4, ctx={"model.layers.0.attn": core})
    with pytest.raises(ValueError, match="Duplicate attention layer name 'model.layers.0.attn'"):
        _layer(vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("block_diagonal", [True, False])
def test_grouped_wo_a_is_the_block_diagonal_product_packed_or_not(dtype, tokens, block_diagonal, monkeypatch):
    """``wo_a`` runs one linear per group on strided group slices of its input (before pack() through
    F.linear; after it through vLLM's CPU GEMM dispatch, one linear per group or, for small groups, one
    block-diagonal linear); every way the result is the block-diagonal product, also on a strided input."""
    from vllm_dsv4_mtp.cpu import linear
    from vllm_dsv4_mtp.cpu.linear import GroupedLinear

    if not block_diagonal:
        monkeypatch.setattr(linear, "BLOCK_DIAGONAL_MAX", 0)
    g = torch.Generator().manual_seed(0)
    wo_a = GroupedLinear(256, 64, n_groups=4, n_local_groups=2)
    wo_a.weight.data.copy_(torch.randn(128, 256, generator=g) * 0.05)
    wo_a.to(dtype)
    o = torch.randn(tokens, 3, 256, generator=g).to(dtype)[:, 1:]  # strided, as the attention hands it
    unpacked = wo_a(o)
    wo_a.pack()
    assert len(wo_a._linears) == (1 if block_diagonal else 2)
    packed = wo_a(o)
    blocks = torch.block_diag(*wo_a.weight.detach().double().view(2, 64, 256))
    exact = o.double().flatten(1) @ blocks.T
    assert packed.shape == unpacked.shape == (tokens, 128)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (unpacked, packed):
        torch.testing.assert_close(got.double(), exact, atol=tol * exact.abs().max().item(), rtol=0)
