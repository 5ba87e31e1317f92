"""vLLM's CPU attention kernel for the SWA layers (``cpu/paged_window.py``): which caches take it, the probe
that keeps the portable path where this vLLM build's kernel is missing or computes something else, and a SWA
layer through it against HF and against the portable path."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.attention.backend import PagedWindowImpl
from vllm_dsv4_mtp.cpu import kit
from vllm_dsv4_mtp.cpu import paged_window as wk


@pytest.mark.parametrize(
    "shape,dtype,head_dim,want",
    [
        ((8, 1, 256, 896), torch.bfloat16, 128, True),  # the embedded model's caches
        ((8, 1, 32, 256), torch.float32, 128, True),
        ((8, 1, 16, 896), torch.bfloat16, 128, False),  # block size not a multiple of 32
        ((8, 1, 256, 128), torch.bfloat16, 128, False),  # no room for key and value (a model of SWA layers only)
        ((8, 1, 256, 896), torch.float16, 128, False),
        ((8, 1, 256, 896), torch.bfloat16, 48, False),  # a head size the kernel lacks
    ],
)
def test_which_caches_take_the_kernel(shape, dtype, head_dim, want):
    cache = torch.zeros(shape, dtype=dtype)
    assert wk.takes(cache, head_dim) is want and kit.KIT.paged_window(cache, head_dim) is want


def test_the_probe_passes_here_and_refuses_a_kernel_that_computes_something_else(monkeypatch):
    import vllm._custom_ops as ops

    probe = kit._probe_paged_window  # the kit keeps its first answer; the probe itself answers anew
    assert probe(torch.float32, 128) and probe(torch.bfloat16, 128)
    real = ops.cpu_attention_with_kv_cache

    def one_key_too_many(**kw):  # a window of W + 1 keys: a different attention
        real(**{**kw, "sliding_window": kw["sliding_window"] + 1})

    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", one_key_too_many)
    assert not probe(torch.float32, 128)

    def missing(**kw):
        raise RuntimeError("no kernel for this instruction set")

    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", missing)
    assert not probe(torch.float32, 128)


@pytest.mark.usefixtures("vllm_dist")
def test_swa_layer_through_vllms_cpu_kernel_matches_hf_and_the_portable_path(tmp_path):
    """A SWA layer (compress ratio 0) over a cache whose blocks the kernel takes (32 rows) runs through vLLM's CPU
    attention kernel (``cpu/paged_window.py``) and gives HF's output over 300 tokens (the window wraps), and
    the portable path's (16-row blocks) for the same steps: in pieces as chunked prefill, decodes and verify
    windows come, several sequences at once, and after rejected drafts, whose rows stay in the cache.

    The kernel's caches are filled with 1e4, not NaN: like vLLM's own CPU attention it multiplies the rows of a
    block outside the window by zero probabilities rather than skipping them (vLLM zero-fills its caches); a
    row it wrongly attended to would still dominate the output."""
    from paged_layer import PagedSequences, run_in_chunks
    from test_model_layers import ATOL, _attention_pair, _hf_full

    cfg, hcfg, ref, mine = _attention_pair(tmp_path, [0, 4, 128, 4, 0], 0, seed=31)
    x = torch.randn(1, 300, cfg["hidden_size"], generator=torch.Generator().manual_seed(7))
    y_ref = _hf_full(ref, hcfg, x)
    chunks = [(0, 9), (9, 12), (12, 13), (13, 140), (140, 141), (141, 144), (144, 300)]
    with torch.no_grad():
        portable = run_in_chunks(mine, x[0], chunks)
        assert not isinstance(mine.sparse_attn.impl, PagedWindowImpl)  # 16-row blocks: the portable path
        kernel = run_in_chunks(mine, x[0], chunks, block_size=32, fill=1e4)
        assert isinstance(mine.sparse_attn.impl, PagedWindowImpl)  # 32-row blocks: vLLM's kernel
    assert y_ref.abs().max() > 1.0
    torch.testing.assert_close(kernel, y_ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(kernel, portable, atol=1e-5, rtol=0)

    # several sequences in one step, and a verify window whose two drafts are rejected
    g = torch.Generator().manual_seed(8)
    xs = {s: torch.randn(m, cfg["hidden_size"], generator=g) for s, m in (("a", 200), ("b", 150))}
    drafts = torch.randn(2, cfg["hidden_size"], generator=g) * 3
    outs = {}
    with torch.no_grad():
        for bs in (16, 32):
            seqs = PagedSequences(mine, block_size=bs, seed=4, fill=1e4 if bs == 32 else float("nan"))
            first = seqs.step([("a", xs["a"][:130]), ("b", xs["b"][:100])])
            seqs.step([("a", torch.cat([xs["a"][130:131], drafts])), ("b", xs["b"][100:101])])
            seqs.rewind("a", 2)
            later = seqs.step([("a", xs["a"][131:134]), ("b", xs["b"][101:150])])
            outs[bs] = torch.cat(first + later)
            fresh = PagedSequences(mine, block_size=bs, seed=5, fill=1e4 if bs == 32 else float("nan"))
            fresh.step([("a", xs["a"][:131])])
            assert torch.allclose(fresh.step([("a", xs["a"][131:134])])[0], later[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[32], outs[16], atol=1e-5, rtol=0)
