"""The portable attention core: DeepSeek-V4 layers' rows in vLLM's paged KV cache.

The portable core keeps, per layer and per token, one *row* in a standard paged cache (``FullAttentionSpec``,
one KV head, ``head_size`` = row width, no V): the roped latent ``kv`` (``d``) and, on compressed layers, the
compressor projections ``[c | z]`` (and the indexer's), see :func:`layer_row_width`. All layers pad their rows
to one width (:func:`cache_row_width`), so the whole model and its MTP draft are one KV-cache group with one
metadata build per step (``model/attention_backend.py`` builds ``model/attention_metadata.py``: every index a
layer needs, for all requests at once; no layer loops over requests).

**Compressed entries are made once and kept in the row of the token that completes their block.** Entry
``j`` of a layer with ratio ``r`` (and, on C4 layers, the indexer key ``j``) is computed in the step that
writes position ``r j + r - 1``, from the block's rows (C4 overlaps: blocks ``j - 1`` and ``j``), and stored
in that token's own row, over channels only that entry reads (:func:`entry_channels`):

* C4: the second halves ``c[d:2d]`` (attention) and ``c_I[dI:2dI]`` (indexer) of the completing row: in the
  overlapping pool, the second halves of a block's rows feed that block's entry only (block ``j + 1`` reads
  the first halves of block ``j``'s rows);
* C128 (any non-overlapping ratio): ``c[0:d]`` of the completing row, whose block is then complete.

So the row width is unchanged, and nothing derived from rows of rejected speculative tokens reaches
committed state: a query at position ``t`` reads only entries ``j < (t + 1) // r``, stored in rows of positions
``<= t`` of its own sequence, each written, entry included, in the step that computed that position's token;
a rejected draft's row (and the entry it completed) lies beyond the new ``seq_len``, is never addressed, and
is overwritten (raw channels and entry alike) when vLLM recomputes that position. Prefix-cache hits reuse
full blocks whose rows, entries included, depend only on the hashed tokens before them. Only the open block
is pooled again, once, by the token that completes it; nothing lives outside the paged cache.

A layer with compress ratio 0 whose cache vLLM's CPU attention kernel takes keeps its latent in that kernel's
layout instead, in the first ``2 * block_size * head_dim`` elements of each of its blocks
(``cpu/paged_window.py``); its rows here are then unused.

Each step a layer (``model/attention.py``) writes its new rows through ``slot_mapping``, completes the blocks
its tokens close (gathering their rows), then attends over padded segments of queries: the window keys
(one contiguous key range per segment), the C128 entries and the C4 indexer's keys, gathered through the
step's precomputed slots. The model runs eagerly (the model class is not ``@support_torch_compile``-decorated,
so nothing of this is traced; under tracing the cache access would have to sit behind an opaque custom op).

Chunked prefill and prefix caching are supported. Note that vLLM's CPU platform decides from
``model_type: deepseek_v4`` that the model uses MLA and, on CPUs without AMX, forces both features off (and
the block size to 256) whatever the layers do; ``VLLM_MLA_DISABLE=1`` (a vLLM setting; nothing in this model
uses vLLM's MLA code) keeps them on. ``tests/test_model_engine_chunked.py`` runs that configuration.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO, blocks_per_entry
from vllm_dsv4_mtp.model.attention_backend import PortableAttentionBackend
from vllm_dsv4_mtp.model.attention_metadata import PortableAttentionMetadata


def layer_row_width(compress_ratio: int, head_dim: int, index_head_dim: int) -> int:
    """Channels of a layer's cache row: ``kv`` + compressor ``[c | z]`` + (C4) indexer ``[c | z]``."""
    width = head_dim
    if compress_ratio > 1:
        width += 2 * blocks_per_entry(compress_ratio) * head_dim
    if compress_ratio == OVERLAP_RATIO:
        width += 2 * 2 * index_head_dim
    return width


def cache_row_width(compress_ratios: list[int], head_dim: int, index_head_dim: int) -> int:
    """The common row width of every layer of the model (and of its MTP draft), a multiple of ``head_dim``:
    the cache is then also a table of ``head_dim``-wide pieces, so a window's keys and the entries it attends
    (different channels of different rows) come out of one gather (:meth:`PagedRowCache.piece_index`)."""
    width = max(layer_row_width(r, head_dim, index_head_dim) for r in [0, *compress_ratios])
    return -(-width // head_dim) * head_dim


def entry_channels(compress_ratio: int, head_dim: int, index_head_dim: int) -> dict[str, int]:
    """Where a layer's row keeps its parts (channel offsets): ``kv``, ``kv_gate`` (compressor ``[c | z]``),
    ``index_kv_gate`` (indexer ``[c | z]``), and in the row of a block's completing token ``entry`` (the
    compressed entry, ``head_dim`` wide) and ``ikey`` (the indexer key, ``index_head_dim`` wide); see the module
    docstring."""
    d, di = head_dim, index_head_dim
    out = {"kv": 0}
    if compress_ratio > 1:
        out["kv_gate"] = d
        out["entry"] = blocks_per_entry(compress_ratio) * d  # C4: c[d:2d]; otherwise c[0:d]
    if compress_ratio == OVERLAP_RATIO:
        out["index_kv_gate"] = 5 * d
        out["ikey"] = 5 * d + di  # c_I[dI:2dI]
    return out


class PagedRowCache(nn.Module, AttentionLayerBase):
    """One layer's rows in vLLM's paged KV cache; registers itself as an attention layer under ``prefix``.

    ``prefix`` (e.g. ``model.layers.3.attn``) must hold exactly one integer: vLLM orders caches by it. The
    bound cache is ``[num_blocks, 1, block_size, cache_width]``; slot ``s`` is row ``s % block_size`` of block
    ``s // block_size``, stored as ``cache_width / piece_width`` pieces (see "Layout" below).
    """

    def __init__(self, *, row_width: int, cache_width: int, piece_width: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        if row_width > cache_width:
            raise ValueError(f"{prefix}: row width {row_width} exceeds the cache row width {cache_width}")
        if cache_width % piece_width:
            raise ValueError(
                f"{prefix}: cache row width {cache_width} is not a multiple of the piece width {piece_width}"
            )
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"kv_cache_dtype={cache_dtype!r} is not supported by the portable DeepSeek-V4 attention "
                "(it stores rows in the model dtype); use kv_cache_dtype='auto'"
            )
        self.row_width = row_width
        self.cache_width = cache_width
        self.piece_width = piece_width
        self.pieces = cache_width // piece_width
        self.layer_name = prefix
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache = torch.tensor([])
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate attention layer name {prefix!r}")
        ctx[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PortableAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.cache_width,
            head_size_v=0,
            dtype=self.dtype,
        )

    def metadata(self) -> PortableAttentionMetadata | None:
        """This step's metadata, or None in vLLM's profile / dummy runs (no cache to touch)."""
        if self.kv_cache.numel() == 0:
            return None
        md = get_forward_context().attn_metadata
        if md is None:
            return None
        if isinstance(md, list):
            raise NotImplementedError("micro-batching (ubatch) is not supported by the portable attention")
        md = md.get(self.layer_name) if isinstance(md, dict) else md
        if md is not None and md.block_size != self.kv_cache.shape[2]:
            raise ValueError(
                f"{self.layer_name}: metadata block size {md.block_size} != the bound cache's {self.kv_cache.shape[2]}"
            )
        return md

    # ----------------------------------------------------------------------------------------------
    # Layout. The cache is a table of ``piece_width``-wide pieces (:meth:`_pieces`); a row is ``pieces`` of
    # them. Inside each block of ``B`` rows, piece 0 of every row (the latent: the window's keys) comes first,
    # as one contiguous ``[B, piece_width]`` run, then the rest of each row, row by row. A window's keys are
    # then a few contiguous runs of memory (the per-step gathers stream), while a row's other channels stay
    # side by side (its write and the compressor's reads of whole rows too). vLLM sees opaque blocks.

    def _pieces(self) -> torch.Tensor:
        return self.kv_cache.view(-1, self.piece_width)  # [num_blocks * pieces * B, piece_width]

    def piece_table(self) -> torch.Tensor:
        """The cache as its table of pieces ``[num_blocks * pieces * block_size, piece_width]`` (a view), which
        :meth:`piece_index` indexes: for kernels that read pieces by index themselves."""
        return self._pieces()

    def _index(self, slots: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """Indices in :meth:`_pieces` of pieces ``first .. first + n - 1`` of the rows at ``slots: [...]`` ->
        ``[..., n]``."""
        block_size = self.kv_cache.shape[2]
        block_start = torch.div(slots, block_size, rounding_mode="floor") * (self.pieces * block_size)
        offset = slots % block_size
        cols = []
        if first == 0:
            cols.append((block_start + offset).unsqueeze(-1))
            first, n = 1, n - 1
        if n:
            rest = block_start + offset * (self.pieces - 1) + (block_size + first - 1)
            cols.append(rest.unsqueeze(-1) + torch.arange(n, device=slots.device))
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)

    def _spanned(self, start: int, width: int) -> range:
        """The pieces holding channels ``[start, start + width)``."""
        if start < 0 or width <= 0 or start + width > self.cache_width:
            raise ValueError(
                f"{self.layer_name}: channels {start}..{start + width} are outside the "
                f"{self.cache_width}-wide cache rows"
            )
        return range(start // self.piece_width, (start + width - 1) // self.piece_width + 1)

    def write(self, md: PortableAttentionMetadata, rows: torch.Tensor) -> None:
        """Store the step's ``rows: [T, row_width]`` at their slots (padding tokens, slot -1, are dropped)."""
        rows = rows[: md.num_actual_tokens]
        if md.write_index is not None:
            rows = rows.index_select(0, md.write_index)
        n_pieces = -(-self.row_width // self.piece_width)
        pad = n_pieces * self.piece_width - self.row_width  # channels no part of this layer's row uses
        rows = rows.to(self.kv_cache.dtype)
        if pad:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=-1)
        written = md.derived.write_pieces
        key = (self.pieces, self.piece_width, n_pieces)  # the same for every layer of this width
        if key not in written:
            written[key] = self._index(md.write_slots, 0, n_pieces).reshape(-1)
        self._pieces().index_copy_(0, written[key], rows.view(-1, self.piece_width))

    def gather(self, slots: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """Channels ``[start, start + width)`` of the rows at ``slots: [...]`` -> ``[..., width]``."""
        spanned = self._spanned(start, width)
        index = self._index(slots.reshape(-1), spanned[0], len(spanned)).reshape(-1)
        skip = start - spanned[0] * self.piece_width
        if len(spanned) == 1:  # inside one piece: read only those channels
            return self._pieces()[:, skip : skip + width].index_select(0, index).view(*slots.shape, width)
        pieces = self._pieces().index_select(0, index).view(*slots.shape, -1)
        return pieces[..., skip : skip + width]

    def piece_index(self, slots: torch.Tensor, start: int) -> torch.Tensor:
        """Index of the piece starting at channel ``start`` (a multiple of ``piece_width``) of the rows at
        ``slots``, for :meth:`gather_pieces`: one gather then reads pieces of different rows and channels."""
        if start % self.piece_width:
            raise ValueError(f"{self.layer_name}: channel {start} does not start a {self.piece_width}-wide piece")
        return self._index(slots, start // self.piece_width, 1).squeeze(-1)

    def gather_pieces(self, index: torch.Tensor) -> torch.Tensor:
        """The pieces at ``index: [...]`` (:meth:`piece_index`) -> ``[..., piece_width]``."""
        return self._pieces().index_select(0, index.reshape(-1)).view(*index.shape, self.piece_width)

    def put(self, slots: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Store ``values: [M, w]`` into channels ``[start, start + w)`` of the rows at ``slots: [M]``."""
        values = values.to(self.kv_cache.dtype)
        end = start + values.shape[-1]
        spanned = self._spanned(start, values.shape[-1])
        index = self._index(slots, spanned[0], len(spanned))  # [M, pieces spanned], as gather addresses them
        for i, p in enumerate(spanned):
            lo, hi = max(start, p * self.piece_width), min(end, (p + 1) * self.piece_width)
            table = self._pieces()[:, lo - p * self.piece_width : hi - p * self.piece_width]
            table.index_copy_(0, index[:, i], values[:, lo - start : hi - start])
