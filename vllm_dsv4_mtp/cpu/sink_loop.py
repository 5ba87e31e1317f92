"""The sink attention of the portable layers' query segments as one compiled CPU loop over paged rows.

:func:`attend_rows` computes :func:`vllm_dsv4_mtp.model.sink_attention.sink_attention_reference`'s function
for ``B`` segments of ``S`` queries (decodes, verify windows, prefill pieces: ``attention_metadata.SEGMENT``
caps a segment at 32 queries), reading every key straight from the cache's piece table by index
(``csrc/sink_attention.c``): no gathered copy of the keys, no additive masks, no per-set log-sum-exp to combine.
Scores, probabilities and sums are float32 for bfloat16 and float32 rows alike, and the output is rounded once
(torch's CPU flash kernel, the other path, rounds bfloat16 probabilities before the value product). A decode
step's C4 layer takes less time here than through the gather and flash kernel, at batch 1 and at batch 64
(docs/benchmarks.md, "Why the code is as it is").

Built on first use with the machine's C compiler (``cpu/compiled.py``); without one, or if the build or the
probe against the reference fails (``cpu/kit.py``), the attention keeps torch's path.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_dsv4_mtp.cpu.compiled import ROW_DTYPES, KernelError, function

VECTOR = 16  # floats per vector in the C file: head sizes must be a multiple
MAX_HEAD = 512
ERRORS = {1: "out of memory", 2: "a key index outside the cache's piece table", 3: "an unsupported head size"}


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# q, q_stride, pieces, n_pieces, bf16, B, S, H, d, shared_idx, shared_masked, K, own_idx, own_masked, k, sink,
# scale, out
SIGNATURE = (_P, _I64, _P, _I64, _I32, _I32, _I32, _I32, _I32, _P, _P, _I32, _P, _P, _I32, _P, ctypes.c_float, _P)


def loaded():
    """The C function, or None where the loop cannot be built or loaded (logged once)."""
    return function("sink_attention", "dsv4_sink_attention", SIGNATURE)


def attend_rows(
    q: torch.Tensor,
    pieces: torch.Tensor,
    shared_index: torch.Tensor,
    shared_masked: torch.Tensor,
    own_index: torch.Tensor | None,
    own_masked: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sink attention of ``q [B, S, H, d]`` over keys read from ``pieces [N, d]`` (the cache's piece table,
    ``PagedRowCache.piece_table``): every query of segment ``b`` may see the rows ``shared_index [B, K]`` where
    ``shared_masked [B, S, K]`` (bool, True = masked) is False, and query ``(b, s)`` also its own
    ``own_index [B, S, k]`` where ``own_masked`` is False; ``sink [H]`` float32 -> ``[B, S, H, d]`` in
    ``q.dtype``. ``q`` and ``pieces`` share a dtype (float32 or bfloat16); ``q``'s heads and channels must be
    contiguous (its query rows may be strided)."""
    fn = loaded()
    if fn is None:
        raise KernelError("the sink-attention kernel is not available (see the log)")
    b, s, h, d = q.shape
    if (
        q.dtype != pieces.dtype
        or q.dtype not in ROW_DTYPES
        or pieces.dim() != 2
        or pieces.shape[-1] != d
        or not pieces.is_contiguous()
    ):
        raise ValueError(
            f"attend_rows: q {q.dtype} [.., {d}] against a {pieces.dtype} piece table "
            f"{tuple(pieces.shape)} (contiguous: {pieces.is_contiguous()})"
        )
    masks = (shared_masked,) if own_masked is None else (shared_masked, own_masked)
    indices = (shared_index,) if own_index is None else (shared_index, own_index)
    if (
        any(t.dtype != torch.int64 for t in indices)
        or any(t.dtype not in (torch.bool, torch.uint8) for t in masks)
        or sink.numel() != h
    ):
        raise ValueError(
            f"attend_rows: int64 indices, bool masks and {h} sink logits expected, got "
            f"{[t.dtype for t in indices]}, {[t.dtype for t in masks]}, {sink.numel()} sink logits"
        )
    if q.stride(3) != 1 or q.stride(2) != d or q.stride(0) != s * q.stride(1):
        q = q.contiguous()
    k = 0 if own_index is None else own_index.shape[-1]
    shared_index = shared_index.contiguous()
    shared_masked = shared_masked.contiguous()
    if shared_index.shape != (b, shared_index.shape[1]) or shared_masked.shape != (b, s, shared_index.shape[1]):
        raise ValueError(
            f"attend_rows: shared keys {tuple(shared_index.shape)} / {tuple(shared_masked.shape)} for {b} x {s} queries"
        )
    if k:
        own_index, own_masked = own_index.contiguous(), own_masked.contiguous()
        if own_index.shape != (b, s, k) or own_masked.shape != (b, s, k):
            raise ValueError(
                f"attend_rows: own keys {tuple(own_index.shape)} / {tuple(own_masked.shape)} for {b} x {s} queries"
            )
    sink = sink.float().contiguous()
    out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
    rc = fn(
        q.data_ptr(),
        q.stride(1),
        pieces.data_ptr(),
        pieces.shape[0],
        ROW_DTYPES[q.dtype],
        b,
        s,
        h,
        d,
        shared_index.data_ptr(),
        shared_masked.data_ptr(),
        shared_index.shape[1],
        own_index.data_ptr() if k else None,
        own_masked.data_ptr() if k else None,
        k,
        sink.data_ptr(),
        scale,
        out.data_ptr(),
    )
    if rc:
        raise KernelError(f"the sink-attention kernel failed: {ERRORS.get(rc, rc)}")
    return out


def takes(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether :func:`attend_rows` takes rows of ``dtype`` and ``head_dim`` on ``device`` (a CPU tensor, a dtype
    and head size the C file serves); whether the loop built and passed its probe is the kit's question
    (:meth:`vllm_dsv4_mtp.cpu.kit.CpuKit.sink_loop`)."""
    return device.type == "cpu" and dtype in ROW_DTYPES and head_dim % VECTOR == 0 and head_dim <= MAX_HEAD
