"""Where a DeepSeek-V4 layer keeps its per-token rows in vLLM's paged KV cache.

Each layer keeps, per token, one row in a standard paged cache (``FullAttentionSpec``, one KV head, ``head_size``
= row width, no V): the roped latent ``kv`` (``d``) and, on compressed layers, the compressor projections ``[c |
z]`` (and the indexer's), :func:`layer_row_width`. All layers pad their rows to one width (:func:`cache_row_width`,
a multiple of ``d``), so the model and its MTP draft are one KV-cache group with one metadata build per step, and
the cache is also a table of ``d``-wide *pieces*: the ``kv`` rows that DeepSeek's ``sparse_attn`` indexes.

**Compressed entries live in the row of the token that completes their block.** Entry ``j`` of ratio ``r`` (and,
on C4, indexer key ``j``) is pooled in the step that writes position ``r j + r - 1`` and stored in that token's
row, over channels only that entry reads (:func:`entry_channels`): C4, the second halves ``c[d:2d]`` and
``c_I[dI:2dI]`` (a block's second halves feed only its own entry); C128, ``c[0:d]``. A query at position ``t``
reads entries ``j < (t + 1) // r``, in rows of positions ``<= t`` of its own sequence, so nothing derived from a
rejected draft's row is ever read, and a prefix-cache hit reuses rows whose entries depend only on the tokens
before them: nothing lives outside the paged cache.

Layout inside a block of ``B`` rows: piece 0 of every row (the latent: the window's keys) first, as one
contiguous ``[B, d]`` run, then the rest of each row, row by row; a window's keys are then a few contiguous runs
of memory while a row's other channels stay side by side. vLLM sees opaque blocks.
"""

from __future__ import annotations

import torch

from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO, blocks_per_entry


def layer_row_width(compress_ratio: int, head_dim: int, index_head_dim: int) -> int:
    """Channels of a layer's cache row: ``kv`` + compressor ``[c | z]`` + (C4) indexer ``[c | z]``."""
    width = head_dim
    if compress_ratio > 1:
        width += 2 * blocks_per_entry(compress_ratio) * head_dim
    if compress_ratio == OVERLAP_RATIO:
        width += 2 * 2 * index_head_dim
    return width


def cache_row_width(compress_ratios: list[int], head_dim: int, index_head_dim: int) -> int:
    """The common row width of every layer of the model and its draft: a multiple of ``head_dim``."""
    width = max(layer_row_width(r, head_dim, index_head_dim) for r in [0, *compress_ratios])
    return -(-width // head_dim) * head_dim


def entry_channels(compress_ratio: int, head_dim: int, index_head_dim: int) -> dict[str, int]:
    """Channel offsets of a layer's row: ``kv``, ``kv_gate`` (compressor ``[c | z]``), ``index_kv_gate``
    (indexer ``[c | z]``) and, in a block's completing row, ``entry`` (``head_dim`` wide) and ``ikey``
    (``index_head_dim`` wide)."""
    d, di = head_dim, index_head_dim
    out = {"kv": 0}
    if compress_ratio > 1:
        out["kv_gate"] = d
        out["entry"] = blocks_per_entry(compress_ratio) * d  # C4: c[d:2d]; otherwise c[0:d]
    if compress_ratio == OVERLAP_RATIO:
        out["index_kv_gate"] = 5 * d
        out["ikey"] = 5 * d + di  # c_I[dI:2dI]
    return out


def piece_index(slots: torch.Tensor, first: int, n: int, *, pieces: int, block_size: int) -> torch.Tensor:
    """Indices in the piece table of pieces ``first .. first + n - 1`` of the rows at ``slots: [...]`` (-1 stays
    -1 where ``n == 1``) -> ``[..., n]``."""
    block_start = torch.div(slots, block_size, rounding_mode="floor") * (pieces * block_size)
    offset = slots % block_size
    cols = []
    if first == 0:
        cols.append((block_start + offset).unsqueeze(-1))
        first, n = 1, n - 1
    if n:
        rest = block_start + offset * (pieces - 1) + (block_size + first - 1)
        cols.append(rest.unsqueeze(-1) + torch.arange(n, device=slots.device))
    out = cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)
    return out.masked_fill_((slots < 0).unsqueeze(-1), -1) if out.shape[-1] == 1 else out


class PagedRows:
    """A bound cache ``[num_blocks, 1, block_size, width]`` seen as rows and as its ``d``-wide piece table."""

    def __init__(self, kv_cache: torch.Tensor, piece_width: int):
        self.kv_cache = kv_cache
        self.block_size, self.width = kv_cache.shape[2], kv_cache.shape[3]
        self.piece_width = piece_width
        self.pieces = self.width // piece_width
        self.table = kv_cache.view(-1, piece_width)  # [num_blocks * pieces * B, d]

    def index(self, slots: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, int]:
        """Piece indices ``[..., n]`` of the pieces holding channels ``[start, start + width)`` of the rows at
        ``slots``, and the offset of ``start`` in the first of them."""
        if start < 0 or width <= 0 or start + width > self.width:
            raise ValueError(f"channels {start}..{start + width} are outside the {self.width}-wide cache rows")
        first, last = start // self.piece_width, (start + width - 1) // self.piece_width
        idx = piece_index(slots, first, last - first + 1, pieces=self.pieces, block_size=self.block_size)
        return idx, start - first * self.piece_width

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows: [n, w]`` (channels ``0 .. w - 1``) at ``slots: [n]``; channels up to the next piece are
        zeroed."""
        n_pieces = -(-rows.shape[1] // self.piece_width)
        pad = n_pieces * self.piece_width - rows.shape[1]
        rows = rows.to(self.table.dtype)
        if pad:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=-1)
        idx, _ = self.index(slots, 0, n_pieces * self.piece_width)
        self.table.index_copy_(0, idx.reshape(-1), rows.reshape(-1, self.piece_width))

    def gather(self, slots: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """Channels ``[start, start + width)`` of the rows at ``slots: [...]`` -> ``[..., width]``."""
        idx, skip = self.index(slots, start, width)
        if idx.shape[-1] == 1:  # inside one piece: read only those channels
            return self.table[:, skip : skip + width].index_select(0, idx.reshape(-1)).view(*slots.shape, width)
        pieces = self.table.index_select(0, idx.reshape(-1)).view(*slots.shape, idx.shape[-1] * self.piece_width)
        return pieces[..., skip : skip + width]

    def put(self, slots: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Store ``values: [M, w]`` into channels ``[start, start + w)`` of the rows at ``slots: [M]``."""
        values = values.to(self.table.dtype)
        end = start + values.shape[-1]
        idx, _ = self.index(slots, start, values.shape[-1])
        d = self.piece_width
        for i, p in enumerate(range(start // d, (end - 1) // d + 1)):
            lo, hi = max(start, p * d), min(end, (p + 1) * d)
            self.table[:, lo - p * d : hi - p * d].index_copy_(0, idx[:, i], values[:, lo - start : hi - start])
