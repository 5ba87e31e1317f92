"""DeepSeek-V4's attention contract, ``sparse_attn(q, kv, sink, topk_idxs, scale)``, two ways.

For query ``t`` and head ``h``, over the rows ``kv[i]`` with ``i`` in ``topk_idxs[t]`` and ``i >= 0`` (``-1``: no
key; the latent is key and value at once) and a sink logit ``sink[h]``::

    l_i = scale * q[t, h] . kv[i]
    o[t, h] = sum_i exp(l_i) kv[i] / (sum_i exp(l_i) + exp(sink[h]))

:func:`sparse_attn_reference` computes it with torch (a gather of each query's rows, float32 matmuls);
:func:`sparse_attn_compiled` with the plugin's C loop (``csrc/sparse_attn.c``), which reads each row in place
from ``kv`` (the paged cache's piece table) by index: no gathered copy. Both compute in float32 and round the
output once. The attention backend picks one per layer when the cache is bound (``cpu/kit.py`` says whether
the loop was built and passed its probe against the reference).
"""

from __future__ import annotations

import ctypes

import torch

from vllm_dsv4_mtp.cpu.compiled import ROW_DTYPES, KernelError, function

VECTOR = 16  # floats per vector in the C file: head sizes must be a multiple
MAX_HEAD = 512
ERRORS = {1: "out of memory", 2: "an index outside kv", 3: "an unsupported head size"}
# the reference gathers at most this many key elements at once (bounds a long prefill's memory)
GATHER_BUDGET = 1 << 24

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# q, q_stride, kv, n_kv, bf16, T, H, d, topk_idxs, K, sink, scale, out
SIGNATURE = (_P, _I64, _P, _I64, _I32, _I32, _I32, _I32, _P, _I32, _P, ctypes.c_float, _P)


def loaded():
    """The C function, or None where the loop cannot be built or loaded (logged once)."""
    return function("sparse_attn", "dsv4_sparse_attn", SIGNATURE)


def sparse_attn_reference(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, topk_idxs: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [T, H, d]``, ``kv [N, d]``, ``sink [H]``, ``topk_idxs [T, K]`` int64 (-1: no key) -> ``[T, H, d]`` in
    ``q.dtype``; in float32, over token chunks whose gathered keys stay under ``GATHER_BUDGET`` elements."""
    t, h, d = q.shape
    k = topk_idxs.shape[1]
    out = torch.empty_like(q)
    step = max(1, GATHER_BUDGET // max(k * d, 1))
    sink = sink.float().view(1, h, 1)
    for a in range(0, t, step):
        idx = topk_idxs[a : a + step]
        masked = idx < 0
        keys = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, d).float()  # [t', K, d]
        keys.masked_fill_(masked.unsqueeze(-1), 0)  # a masked slot's row may hold anything (NaN): weight 0 x 0
        logits = torch.bmm(q[a : a + step].float(), keys.transpose(1, 2)).mul_(scale)  # [t', H, K]
        logits.masked_fill_(masked.unsqueeze(1), float("-inf"))
        # the sink is one more logit per head whose value carries nothing
        p = torch.softmax(torch.cat([logits, sink.expand(logits.shape[0], h, 1)], dim=-1), dim=-1)[..., :k]
        out[a : a + step] = torch.bmm(p, keys).to(q.dtype)
    return out


def sparse_attn_compiled(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, topk_idxs: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`sparse_attn_reference`'s function through the C loop. ``q`` and ``kv`` share a dtype (float32 or
    bfloat16); ``kv`` is contiguous; ``q``'s heads and channels are contiguous (its rows may be strided)."""
    fn = loaded()
    if fn is None:
        raise KernelError("the sparse-attention kernel is not available (see the log)")
    t, h, d = q.shape
    if q.dtype != kv.dtype or q.dtype not in ROW_DTYPES or kv.dim() != 2 or kv.shape[-1] != d or not kv.is_contiguous():
        raise ValueError(
            f"sparse_attn: q {q.dtype} [.., {d}] against a {kv.dtype} kv {tuple(kv.shape)} "
            f"(contiguous: {kv.is_contiguous()})"
        )
    if topk_idxs.dtype != torch.int64 or topk_idxs.dim() != 2 or topk_idxs.shape[0] != t or sink.numel() != h:
        raise ValueError(
            f"sparse_attn: int64 topk_idxs [{t}, K] and {h} sink logits expected, got {topk_idxs.dtype} "
            f"{tuple(topk_idxs.shape)}, {sink.numel()} sink logits"
        )
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    topk_idxs = topk_idxs.contiguous()
    sink = sink.float().contiguous()
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        kv.data_ptr(),
        kv.shape[0],
        ROW_DTYPES[q.dtype],
        t,
        h,
        d,
        topk_idxs.data_ptr(),
        topk_idxs.shape[1],
        sink.data_ptr(),
        scale,
        out.data_ptr(),
    )
    if rc:
        raise KernelError(f"the sparse-attention kernel failed: {ERRORS.get(rc, rc)}")
    return out


def takes(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether :func:`sparse_attn_compiled` takes rows of ``dtype`` and ``head_dim`` on ``device``; whether the
    loop built and passed its probe is the kit's question
    (:meth:`vllm_dsv4_mtp.cpu.kit.CpuKit.sparse_attn_loop`)."""
    return device.type == "cpu" and dtype in ROW_DTYPES and head_dim % VECTOR == 0 and head_dim <= MAX_HEAD
