"""vLLM's CPU attention kernel for the SWA layers (``model/window_kernel.py``): which caches take it, and the probe
that keeps the portable path where this vLLM build's kernel is missing or computes something else."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.model import window_kernel as wk


@pytest.mark.parametrize("shape,dtype,head_dim,want", [
    ((8, 1, 256, 896), torch.bfloat16, 128, True),  # the embedded model's caches
    ((8, 1, 32, 256), torch.float32, 128, True),
    ((8, 1, 16, 896), torch.bfloat16, 128, False),  # block size not a multiple of 32
    ((8, 1, 256, 128), torch.bfloat16, 128, False),  # no room for key and value (a model of SWA layers only)
    ((8, 1, 256, 896), torch.float16, 128, False),
    ((8, 1, 256, 896), torch.bfloat16, 48, False),  # a head size the kernel lacks
])
def test_which_caches_take_the_kernel(shape, dtype, head_dim, want):
    assert wk.usable(torch.zeros(shape, dtype=dtype), head_dim) is want


def test_the_probe_passes_here_and_refuses_a_kernel_that_computes_something_else(monkeypatch):
    import vllm._custom_ops as ops

    probe = wk.kernel_works.__wrapped__  # uncached
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
