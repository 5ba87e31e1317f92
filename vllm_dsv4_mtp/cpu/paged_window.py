"""Sliding-window attention with a sink through vLLM's CPU paged-attention kernel, for the SWA-only layers.

A DeepSeek-V4 layer with compress ratio 0 (the embedded model's layer 0, every MTP layer) attends each query at
position ``p`` to the latents of positions ``p - W + 1 .. p`` with one sink logit per head: what vLLM's CPU
attention kernel (``cpu_attention_with_kv_cache``) computes for a sliding-window model with attention sinks,
causal, one KV head shared by the query heads, from the paged cache and the step's block table, for every
request of the step in one call (no per-query index list), so it takes less time than ``sparse_attn`` over
the window's indices (``cpu/sparse_attn.py``): far less on warm caches, less in the engine, where the window
rows come from memory (docs/benchmarks.md, "Why the code is as it is").

The kernel keeps keys and values in its own block layout (``cpu_attn_reshape_and_cache``), so the latent, key
and value at once, is stored twice: in the first ``2 * block_size * head_dim`` elements of each of the layer's
own cache blocks, which the portable rows of a SWA layer (``head_dim`` of its ``cache_width`` channels) leave
unused whenever ``cache_width >= 2 * head_dim`` (every model with a compressed layer). A layer whose cache is
too narrow, a block size, head size or dtype the kernel does not take, a non-CPU tensor, or a vLLM build whose
kernel fails a probe step against the reference (``cpu/kit.py``, logged) keeps the portable path (:func:`takes`
and ``KIT.paged_window``). The step's arguments (:class:`Schedule`) are made once per step by the attention
backend's metadata builder and shared by every SWA layer.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import numpy as np
import torch
from vllm import _custom_ops as ops

# vLLM's generic x86 instruction set for its CPU attention (AMX machines would also take it; vLLM picks "amx" for
# its own bf16 layers there); block sizes must be a multiple of 32 for it
ISA = "vec"
BLOCK_ALIGNMENT = 32
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = (torch.bfloat16, torch.float32)


def takes(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether a SWA layer with cache ``kv_cache [num_blocks, 1, block_size, cache_width]`` fits the kernel (an
    x86 CPU tensor, a block size, head size and dtype it takes, room for its layout); whether this vLLM build's
    kernel passed its probe is the kit's question (:meth:`vllm_dsv4_mtp.cpu.kit.CpuKit.paged_window`)."""
    if kv_cache.ndim != 4 or kv_cache.device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    block_size, width = kv_cache.shape[2], kv_cache.shape[3]
    return (
        block_size % BLOCK_ALIGNMENT == 0
        and head_dim in HEAD_SIZES
        and kv_cache.dtype in DTYPES
        and width >= 2 * head_dim
    )


@dataclass
class Schedule:
    """One step's arguments of the kernel: int32 ``query_start_loc [R + 1]``, ``seq_lens [R]``, the block table
    ``[R, max_blocks]`` and the kernel's scheduler metadata."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler: torch.Tensor

    @classmethod
    def make(
        cls,
        qsl: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        *,
        heads: int,
        head_dim: int,
        window: int,
        dtype,
    ) -> Schedule:
        qsl_t, lens_t = torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(seq_lens.astype(np.int32))
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens_t.shape[0],
            num_heads=heads,
            num_kv_heads=1,
            head_dim=head_dim,
            seq_lens=lens_t,
            dtype=dtype,
            query_start_loc=qsl_t,
            causal=True,
            sliding_window_size=window,
            isa=ISA,
            enable_kv_split=False,
        )
        return cls(qsl_t, lens_t, torch.from_numpy(block_table.astype(np.int32)), sched)


class WindowKernel:
    """One SWA layer's latent in vLLM's CPU attention layout inside its own cache blocks, and its attention."""

    def __init__(self, kv_cache: torch.Tensor, head_dim: int, window: int, scale: float):
        num_blocks, _, block_size, width = kv_cache.shape
        region = kv_cache.view(num_blocks, block_size * width)[:, : 2 * block_size * head_dim]
        # [num_blocks, 1 KV head, block_size, head_dim] each, blocks block_size * width apart
        self.key_cache, self.value_cache = region.view(num_blocks, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        self.head_dim = head_dim
        self.window = window
        self.scale = scale

    def write(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Store latents ``kv: [n, d]`` at ``slots: [n]`` int64, as key and value."""
        kv = kv.to(self.key_cache.dtype).unsqueeze(1)  # [n, 1, d]
        ops.cpu_attn_reshape_and_cache(kv, kv, self.key_cache, self.value_cache, slots, ISA)

    def attend(self, q: torch.Tensor, sink: torch.Tensor, step: Schedule) -> torch.Tensor:
        """``q: [n, H_local, d]`` (roped), ``sink: [H_local]`` float32 -> ``[n, H_local, d]`` in ``q.dtype``."""
        q = q.contiguous()
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            output=out,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=self.window,
            block_table=step.block_table,
            softcap=0.0,
            scheduler_metadata=step.scheduler,
            s_aux=sink,
        )
        return out
