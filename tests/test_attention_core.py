"""The portable attention core: platform choice, row widths, and the paged addressing.

The addressing test drives :meth:`PagedRowCache.run` with the metadata vLLM's runner would build for a batch
mixing a chunked prefill continuation, a fresh prefill, a decode, a 3-token speculative verify and a padding
request, over a shuffled block table: every request must see exactly its own rows of positions 0..L-1, in
order, including rows written in earlier steps; rows beyond ``seq_len`` (rejected drafts) are never read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dsv4_mtp.kernels import attention_core as ac


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


def _core(cache_width=8, block_size=4, num_blocks=12):
    vc = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size),
                         model_config=SimpleNamespace(dtype=torch.float32),
                         compilation_config=SimpleNamespace(static_forward_context={}))
    core = ac.PagedRowCache(row_width=6, cache_width=cache_width, prefix="model.layers.0.attn", vllm_config=vc)
    assert vc.compilation_config.static_forward_context["model.layers.0.attn"] is core
    spec = core.get_kv_cache_spec(vc)
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.block_size) == (1, cache_width, 0, block_size)
    core.bind_kv_cache(torch.full((num_blocks, 1, block_size, cache_width), float("nan")))
    return core


def _row(req, pos, version=0.0):
    return torch.tensor([req, pos, req * 1000 + pos, version, 2.0, 3.0])


def test_paged_rows_for_mixed_batches():
    core = _core()
    bs = 4
    # request -> its blocks (shuffled physical ids)
    tables = {0: [7, 2, 9], 1: [4, 11], 2: [0, 5, 3], 3: [10, 1, 6, 8]}
    written = {r: 0 for r in tables}

    def step(batch, version=0.0):
        """batch: list of (req, n_new_tokens) or (None, 0) padding; returns what each request saw."""
        rows, slots, qsl, seq_lens, tab = [], [], [0], [], []
        for req, n in batch:
            t = tables.get(req, [0])
            tab.append(t + [0] * (4 - len(t)))
            start = written.get(req, 0)
            for p in range(start, start + n):
                rows.append(_row(req, p, version))
                slots.append(t[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        rows.append(torch.zeros(6))  # a padded token slot
        slots.append(-1)
        md = ac.PortableAttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens,
                                          block_table=torch.tensor(tab, dtype=torch.int32),
                                          slot_mapping=torch.tensor(slots, dtype=torch.int64),
                                          num_actual_tokens=len(slots))
        seen = {}
        out = torch.zeros(len(slots), 1)

        def fn(seq_rows, tokens):
            req = int(seq_rows[0, 0])
            seen[req] = (seq_rows.clone(), tokens)
            return torch.ones(tokens.stop - tokens.start, 1)

        core.run(md, torch.stack(rows), out, fn)
        for req, n in batch:
            if req is not None:
                written[req] += n
        return seen, out

    step([(0, 6), (1, 3)])  # prefills (request 0's first chunk)
    seen, out = step([(0, 5), (2, 9), (1, 1), (None, 0)])  # chunk continuation, fresh prefill, decode, padding
    for req, L in ((0, 11), (2, 9), (1, 4)):
        rows, _ = seen[req]
        assert torch.equal(rows, torch.stack([_row(req, p) for p in range(L)]))
    assert out[:-1].eq(1).all() and out[-1].eq(0).all()  # the padded token is left alone
    # speculative verify: 1 + 2 drafts (positions 4, 5, 6), both drafts rejected; the next step recomputes
    # position 5 with the corrected token (new row content), and the stale draft row of position 6 stays in
    # the cache beyond seq_len: it must never be read
    step([(1, 3)], version=7.0)
    written[1] -= 2
    seen, _ = step([(1, 1), (3, 13)], version=9.0)
    rows, tokens = seen[1]
    want = [_row(1, p) for p in range(4)] + [_row(1, 4, 7.0), _row(1, 5, 9.0)]
    assert torch.equal(rows, torch.stack(want))
    assert tokens == slice(0, 1)
    assert torch.equal(seen[3][0], torch.stack([_row(3, p, 9.0) for p in range(13)]))


def test_kv_cache_dtype_other_than_model_dtype_is_refused():
    vc = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8", block_size=16),
                         model_config=SimpleNamespace(dtype=torch.bfloat16),
                         compilation_config=SimpleNamespace(static_forward_context={}))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by the portable DeepSeek-V4"):
        ac.PagedRowCache(row_width=6, cache_width=8, prefix="model.layers.0.attn", vllm_config=vc)


def test_duplicate_layer_name_is_refused():
    core = _core()
    vc = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto", block_size=4),
                         model_config=SimpleNamespace(dtype=torch.float32),
                         compilation_config=SimpleNamespace(static_forward_context={"model.layers.0.attn": core}))
    with pytest.raises(ValueError, match="Duplicate attention layer name 'model.layers.0.attn'"):
        ac.PagedRowCache(row_width=6, cache_width=8, prefix="model.layers.0.attn", vllm_config=vc)
