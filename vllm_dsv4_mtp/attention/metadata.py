"""One step's attention metadata, built once on the host for every layer of the KV-cache group.

From vLLM's ``CommonAttentionMetadata`` (host copies of ``query_start_loc``, ``seq_lens``, the block table and
``slot_mapping``) the builder makes, with numpy, every index the layers need, eagerly, typed per layer kind (no
layer loops over requests, and none derives anything from the step)::

    pos[t]          = seq_len[r] - q_len[r] + i                 # token t = request r's i-th new token
    window_idxs[t]  = piece(pos[t] - W + 1 .. pos[t])           # -1 before position 0
    entry_idxs[r][t] = piece of entry j's row, j < (pos[t] + 1) // r, else -1     # each C128-style ratio r
    indexer         = the C4 entries each segment of <= 32 queries of one request may pick from
    completions[r]  = the rows of each block of ratio r that this step's tokens complete

``piece`` is the row's index in the cache's piece table (``attention/rows.py``): the ``kv`` that DeepSeek's
``sparse_attn(q, kv, sink, topk_idxs, scale)`` indexes, ``-1`` = masked. A layer's ``topk_idxs`` is
``window_idxs``, then its ratio's ``entry_idxs`` or its indexer picks, concatenated as DeepSeek does. Positions
outside a sequence are never addressed, so rows beyond ``seq_len`` (rejected drafts) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dsv4_mtp.attention.rows import piece_index
from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO, blocks_per_entry
from vllm_dsv4_mtp.cpu.paged_window import Schedule

# queries per indexer segment: bounds a prefill's padded [segments, S, entries] score tensor
SEGMENT = 32


@dataclass(frozen=True)
class StepPlan:
    """What the group's layers need from a step, fixed once their caches are bound."""

    window: int
    head_dim: int
    pieces: int  # pieces per cache row
    ratios: tuple[int, ...]  # compress ratios of the group's layers (> 1)
    swa_kernel: tuple[int, torch.dtype] | None = None  # (query heads, dtype) where SWA layers use vLLM's kernel


@dataclass
class Completions:
    """Blocks completed by this step's tokens (``position % ratio == ratio - 1``), ``M`` of them: ``row_slots
    [M, span]`` rows of positions ``p - span + 1 .. p``, ``row_valid [M, span, 1]`` (position >= 0), ``dst [M]``
    the completing token's slot, ``block_pos [M]`` = ``ratio * j``."""

    row_slots: torch.Tensor
    row_valid: torch.Tensor
    dst: torch.Tensor
    block_pos: torch.Tensor


@dataclass
class IndexerSegments:
    """The C4 entries each query segment may pick from: ``slots [B, n]`` their rows, ``pieces [B, n]`` their
    entries' piece indices, ``masked [B, S, n]`` (``j >= limit``), ``limit [B, S, 1]``; ``query_index [B S]`` /
    ``output_index [T]`` gather the step's queries into segments and back (None: identity)."""

    slots: torch.Tensor
    pieces: torch.Tensor
    masked: torch.Tensor
    limit: torch.Tensor
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None


@dataclass
class DeepseekV4AttentionMetadata:
    num_actual_tokens: int  # tokens of the step's tensors (may include padding)
    num_tokens: int  # real tokens
    num_reqs: int
    block_size: int
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # slots of the tokens that are stored
    write_index: torch.Tensor | None  # those tokens (None: all num_actual_tokens)
    window_idxs: torch.Tensor  # [T, W]
    entry_idxs: dict[int, torch.Tensor]  # C128-style ratio -> [T, n]
    indexer: IndexerSegments | None
    completions: dict[int, Completions | None]  # ratio -> blocks completed (None: none)
    window_schedule: Schedule | None  # vLLM's CPU kernel's arguments, for SWA layers that use it


def _slots(block_table: np.ndarray, req: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slots of positions ``pos >= 0`` of requests ``req`` (broadcast together), by the block table."""
    return block_table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


def build_step(
    plan: StepPlan,
    *,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: torch.Tensor,
    num_actual_tokens: int,
    block_size: int,
) -> DeepseekV4AttentionMetadata:
    """The step's metadata from host copies of vLLM's ``query_start_loc [R + 1]``, ``seq_lens [R]``,
    ``block_table [R, max_blocks]`` and ``slot_mapping [>= num_actual_tokens]`` (-1 = padding)."""
    qsl, lens = query_start_loc.astype(np.int64), seq_lens.astype(np.int64)
    q_lens = np.diff(qsl)
    n = int(qsl[-1])
    if n > num_actual_tokens:
        raise ValueError(f"query_start_loc ends at {n} > num_actual_tokens={num_actual_tokens}")
    req = np.repeat(np.arange(q_lens.shape[0]), q_lens)
    pos = np.arange(n) - qsl[req] + (lens - q_lens)[req]
    sm = slot_mapping[:num_actual_tokens].long()
    sm_np = sm.numpy()
    keep = sm_np >= 0
    keep[n:] = False  # padding tokens are never stored
    done_tok = keep[:n]

    def pieces(r: np.ndarray, p: np.ndarray, visible: np.ndarray, piece: int) -> torch.Tensor:
        slots = _slots(block_table, r, np.maximum(p, 0), block_size)
        idx = piece_index(
            torch.from_numpy(np.where(visible, slots, -1)), piece, 1, pieces=plan.pieces, block_size=block_size
        )
        return idx.squeeze(-1)

    top = int(pos.max(initial=-1)) + 1
    w = max(1, min(plan.window, top))
    kpos = pos[:, None] - w + 1 + np.arange(w)[None, :]
    entry_idxs, completions = {}, {}
    for ratio in plan.ratios:
        span = blocks_per_entry(ratio) * ratio
        ends = np.nonzero((pos % ratio == ratio - 1) & done_tok)[0]
        rows = pos[ends, None] - span + 1 + np.arange(span)[None, :]
        completions[ratio] = (
            Completions(
                torch.from_numpy(_slots(block_table, req[ends, None], np.maximum(rows, 0), block_size)),
                torch.from_numpy((rows >= 0)[:, :, None]),
                sm[torch.from_numpy(ends)],
                torch.from_numpy(pos[ends] - ratio + 1),
            )
            if ends.shape[0]
            else None
        )
        if ratio != OVERLAP_RATIO:
            j = np.arange(top // ratio)[None, :]
            entry_idxs[ratio] = pieces(req[:, None], ratio * j + ratio - 1, j < (pos[:, None] + 1) // ratio, 1)
    return DeepseekV4AttentionMetadata(
        num_actual_tokens=num_actual_tokens,
        num_tokens=n,
        num_reqs=len(lens),
        block_size=block_size,
        positions=torch.from_numpy(pos),
        write_slots=sm if keep.all() else torch.from_numpy(sm_np[keep]),
        write_index=None if keep.all() else torch.from_numpy(np.nonzero(keep)[0]),
        window_idxs=pieces(req[:, None], kpos, kpos >= 0, 0),
        entry_idxs=entry_idxs,
        indexer=_indexer_segments(pos, req, qsl, block_table, block_size, plan)
        if OVERLAP_RATIO in plan.ratios
        else None,
        completions=completions,
        window_schedule=None
        if plan.swa_kernel is None
        else Schedule.make(
            qsl,
            lens,
            block_table,
            heads=plan.swa_kernel[0],
            head_dim=plan.head_dim,
            window=plan.window,
            dtype=plan.swa_kernel[1],
        ),
    )


def _indexer_segments(
    pos: np.ndarray, req: np.ndarray, qsl: np.ndarray, block_table: np.ndarray, block_size: int, plan: StepPlan
) -> IndexerSegments:
    """Each request's queries cut into segments of at most ``S = min(max q_len, SEGMENT)`` (padded to ``S``), with
    the C4 entries the segment's last query may see: one key set per segment for the indexer's scores."""
    q_lens, n = np.diff(qsl), pos.shape[0]
    s = max(1, min(int(q_lens.max(initial=0)), SEGMENT))
    n_seg_r = -(-q_lens // s)
    seg_req = np.repeat(np.arange(q_lens.shape[0]), n_seg_r)
    seg_tok = qsl[seg_req] + (np.arange(seg_req.shape[0]) - np.repeat(np.cumsum(n_seg_r) - n_seg_r, n_seg_r)) * s
    seg_cnt = np.minimum(s, qsl[seg_req + 1] - seg_tok)
    valid = np.arange(s)[None, :] < seg_cnt[:, None]
    qidx = np.where(valid, seg_tok[:, None] + np.arange(s)[None, :], 0)
    qpos = np.where(valid, pos[np.minimum(qidx, max(n - 1, 0))] if n else -1, -1)  # [B, S], -1 = padding
    if bool((seg_cnt == s).all()):  # no padded query: the layout is the step's own
        query_index = output_index = None
    else:
        query_index = torch.from_numpy(qidx.reshape(-1))
        tok_seg = np.repeat(np.arange(seg_req.shape[0]), seg_cnt)
        output_index = torch.from_numpy(tok_seg * s + (np.arange(n) - seg_tok[tok_seg]))
    seen = (qpos.max(axis=1, initial=-1) + 1) // OVERLAP_RATIO  # [B]
    j = np.arange(int(seen.max(initial=0)))[None, :]
    jpos = np.where(j < seen[:, None], OVERLAP_RATIO * j + OVERLAP_RATIO - 1, 0)
    slots = _slots(block_table, seg_req[:, None], jpos, block_size)
    limit = (qpos + 1) // OVERLAP_RATIO  # padding queries (-1) see none
    slots_t = torch.from_numpy(slots)
    return IndexerSegments(
        slots=slots_t,
        pieces=piece_index(
            slots_t, blocks_per_entry(OVERLAP_RATIO), 1, pieces=plan.pieces, block_size=block_size
        ).squeeze(-1),
        masked=torch.from_numpy(j[None] >= limit[:, :, None]),
        limit=torch.from_numpy(limit[:, :, None]),
        query_index=query_index,
        output_index=output_index,
    )
