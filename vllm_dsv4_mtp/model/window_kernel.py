"""Sliding-window attention with a sink through vLLM's CPU paged-attention kernel, for the SWA-only layers.

A DeepSeek-V4 layer with compress ratio 0 (the embedded model's layer 0, every MTP layer) attends each query at
position ``p`` to the latents of positions ``p - W + 1 .. p`` with one sink logit per head: what vLLM's CPU
attention kernel (``cpu_attention_with_kv_cache``) computes for a sliding-window model with attention sinks,
causal, one KV head shared by the query heads, from the paged cache and the step's block table, for every
request of the step in one call (no per-segment gather, mask or flash-kernel call), so it takes less time than
the gather and flash-kernel path of ``model/sink_attention.py``: far less on warm caches, less in the engine,
where the window rows come from memory (docs/benchmarks.md, "Why the code is as it is").

The kernel keeps keys and values in its own block layout (``cpu_attn_reshape_and_cache``), so the latent, key
and value at once, is stored twice: in the first ``2 * block_size * head_dim`` elements of each of the layer's
own cache blocks, which the portable rows of a SWA layer (``head_dim`` of its ``cache_width`` channels) leave
unused whenever ``cache_width >= 2 * head_dim`` (every model with a compressed layer). A layer whose cache is
too narrow, a block size, head size or dtype the kernel does not take, a non-CPU tensor, or a vLLM build whose
kernel fails a probe step against the reference (:func:`kernel_works`, logged) keeps the portable path
(:func:`usable`).
"""

from __future__ import annotations

import functools
import platform

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.logger import init_logger

from vllm_dsv4_mtp.model.attention_metadata import KernelSchedule, PortableAttentionMetadata

logger = init_logger("vllm.dsv4_mtp.window_kernel")

# vLLM's generic x86 instruction set for its CPU attention (AMX machines would also take it; vLLM picks "amx" for
# its own bf16 layers there); block sizes must be a multiple of 32 for it
ISA = "vec"
BLOCK_ALIGNMENT = 32
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = (torch.bfloat16, torch.float32)


def usable(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether a SWA layer with cache ``kv_cache [num_blocks, 1, block_size, cache_width]`` can use the kernel."""
    if kv_cache.ndim != 4 or kv_cache.device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    block_size, width = kv_cache.shape[2], kv_cache.shape[3]
    if block_size % BLOCK_ALIGNMENT or head_dim not in HEAD_SIZES or kv_cache.dtype not in DTYPES:
        return False
    if width < 2 * head_dim:
        return False
    return kernel_works(kv_cache.dtype, head_dim)


@functools.cache
def kernel_works(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this vLLM build's CPU kernel, driven as a step drives it (:meth:`WindowKernel.write` and
    :meth:`WindowKernel.attend`), gives the sink attention of two small steps (two prefills, then a chunk of
    three, over 32-row blocks, window 16) within this dtype's rounding of the float32 reference: checked once per
    process, so a build without it (another instruction set, another signature) keeps the portable path instead
    of failing a step."""
    from vllm_dsv4_mtp.model.sink_attention import sink_attention_reference

    g = torch.Generator().manual_seed(0)
    block, window, heads = BLOCK_ALIGNMENT, 16, 2
    table = np.array([[3, 0], [1, 4]])
    latents = [torch.randn(n, head_dim, generator=g).to(dtype) for n in (40, 23)]
    sink = torch.randn(heads, generator=g)
    kernel = WindowKernel(torch.zeros(5, 1, block, 2 * head_dim, dtype=dtype), head_dim, window, head_dim**-0.5)
    worst = 0.0
    try:
        # (request, first position, end position) of each step's tokens
        for step in ([(0, 0, 40), (1, 0, 20)], [(1, 20, 23)]):
            reqs = [r for r, _, _ in step]
            pos = np.concatenate([np.arange(a, b) for _, a, b in step])
            req = np.concatenate([np.full(b - a, i) for i, (_, a, b) in enumerate(step)])
            md = PortableAttentionMetadata.create(
                query_start_loc=np.cumsum([0] + [b - a for _, a, b in step]),
                seq_lens=np.array([b for _, _, b in step]),
                block_table=table[reqs],
                slot_mapping=torch.from_numpy(table[reqs][req, pos // block] * block + pos % block),
                num_actual_tokens=len(pos),
                block_size=block,
                device=torch.device("cpu"),
            )
            kernel.write(md, torch.cat([latents[r][a:b] for r, a, b in step]))
            q = torch.randn(len(pos), heads, head_dim, generator=g).to(dtype)
            out = kernel.attend(md, q, sink)
            for t, (i, p) in enumerate(zip(req, pos)):
                keys = latents[reqs[i]][max(0, p - window + 1) : p + 1].unsqueeze(0)
                ref = sink_attention_reference(
                    q[t].view(1, 1, heads, head_dim),
                    [(keys, torch.zeros(1, 1, keys.shape[1], dtype=torch.bool))],
                    sink,
                    kernel.scale,
                )
                worst = max(worst, (out[t].float() - ref.view(heads, head_dim).float()).abs().max().item())
    except Exception as e:  # noqa: BLE001 (a missing op, an unsupported instruction set: the portable path)
        logger.info(
            "vllm-dsv4-mtp: vLLM's CPU attention kernel is not usable here (%s); SWA layers keep the "
            "portable attention",
            e,
        )
        return False
    ok = worst <= (1e-4 if dtype == torch.float32 else 3e-2)
    if not ok:
        logger.warning(
            "vllm-dsv4-mtp: vLLM's CPU attention kernel differs from the reference sink attention by "
            "%.3g on a probe step; SWA layers keep the portable attention",
            worst,
        )
    return ok


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

    def write(self, md: PortableAttentionMetadata, kv: torch.Tensor) -> None:
        """Store the step's latents ``kv: [n, d]`` at their slots, as key and value (padding tokens dropped)."""
        kv = kv[: md.num_actual_tokens]
        if md.write_index is not None:
            kv = kv.index_select(0, md.write_index)
        kv = kv.to(self.key_cache.dtype).unsqueeze(1)  # [n, 1, d]
        ops.cpu_attn_reshape_and_cache(kv, kv, self.key_cache, self.value_cache, md.write_slots, ISA)

    def attend(self, md: PortableAttentionMetadata, q: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        """``q: [n, H_local, d]`` (roped), ``sink: [H_local]`` float32 -> ``[n, H_local, d]`` in ``q.dtype``."""
        n, heads = q.shape[0], q.shape[1]
        q = q.contiguous()
        out = torch.empty_like(q)
        if n == 0:
            return out
        schedules = md.derived.kernel_schedules
        key = (self.window, heads, q.dtype)
        if key not in schedules:  # the same for every SWA layer of the step
            qsl = torch.from_numpy(md._qsl.astype("int32"))
            seq_lens = torch.from_numpy(md._seq_lens.astype("int32"))
            table = torch.from_numpy(md._bt.astype("int32"))
            sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=seq_lens.shape[0],
                num_heads=heads,
                num_kv_heads=1,
                head_dim=self.head_dim,
                seq_lens=seq_lens,
                dtype=q.dtype,
                query_start_loc=qsl,
                causal=True,
                sliding_window_size=self.window,
                isa=ISA,
                enable_kv_split=False,
            )
            schedules[key] = KernelSchedule(qsl, seq_lens, table, sched)
        step = schedules[key]
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
