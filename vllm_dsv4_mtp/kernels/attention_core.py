"""The portable attention core: DeepSeek-V4 layers' rows in vLLM's paged KV cache.

The portable core keeps, per layer and per token, one *row* in a standard paged cache
(``FullAttentionSpec``, one KV head, ``head_size`` = row width, no V): the roped latent ``kv`` (512) and,
on compressed layers, the raw compressor projections ``[c | z]`` (and the indexer's). Each step it writes
the new rows through ``slot_mapping``, then for every request gathers the rows of positions ``0 .. L-1``
through the block table and hands them to the layer's maths, which rebuilds compressed entries and indexer
keys from rows. Nothing derived from rows is stored, so the path is correct for batches of sequences of
any lengths, chunked prefill, decode, speculative verify (rows of rejected drafts lie beyond ``seq_len``
and are overwritten when those positions are recomputed) and prefix-cache hits (cached blocks hold the
rows). Costs: each step re-pools a sequence's compressed blocks (O(L) per layer) and runs a Python loop over
requests; the model runs eagerly (the model class is not ``@support_torch_compile``-decorated, so nothing of
this is traced; under tracing the cache access would have to sit behind an opaque custom op).

All layers pad their rows to one width (:func:`cache_row_width`) so the whole model is one KV-cache group
with one metadata build per step (the MTP draft's SWA layer uses the same width).

Chunked prefill and prefix caching are supported. Note that vLLM's CPU platform decides from
``model_type: deepseek_v4`` that the model uses MLA and, on CPUs without AMX, forces both features off (and
the block size to 256) whatever the layers do; ``VLLM_MLA_DISABLE=1`` (a vLLM setting; nothing in this model
uses vLLM's MLA code) keeps them on. ``tests/test_model_engine_chunked.py`` runs that configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

PORTABLE_BACKEND_NAME = "DSV4_MTP_PORTABLE"


def layer_row_width(compress_ratio: int, head_dim: int, index_head_dim: int) -> int:
    """Channels of a layer's cache row: ``kv`` + compressor ``[c | z]`` + (C4) indexer ``[c | z]``."""
    width = head_dim
    if compress_ratio > 1:
        coff = 2 if compress_ratio == 4 else 1
        width += 2 * coff * head_dim
    if compress_ratio == 4:
        width += 2 * 2 * index_head_dim
    return width


def cache_row_width(compress_ratios: list[int], head_dim: int, index_head_dim: int) -> int:
    """The common row width of every layer of the model (and of its MTP draft)."""
    return max(layer_row_width(r, head_dim, index_head_dim) for r in [0, *compress_ratios])


@dataclass
class PortableAttentionMetadata:
    """Per-step addressing, shared by all layers of the KV-cache group (host lists: free on CPU)."""

    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs], context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    num_actual_tokens: int


class PortableAttentionMetadataBuilder(AttentionMetadataBuilder[PortableAttentionMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into :class:`PortableAttentionMetadata`."""

    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # decodes, verifies and prefills may come in any order
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PortableAttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        return PortableAttentionMetadata(
            query_start_loc=cm.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=cm.seq_lens[:n].cpu().tolist(),
            block_table=cm.block_table_tensor[:n],
            slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
            num_actual_tokens=cm.num_actual_tokens,
        )


class PortableAttentionBackend(AttentionBackend):
    """vLLM backend record of the portable core (only its builder is used; no ``AttentionImpl``)."""

    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return PORTABLE_BACKEND_NAME

    @staticmethod
    def get_builder_cls():
        return PortableAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            f"{PORTABLE_BACKEND_NAME} has no AttentionImpl: its layers compute attention themselves"
        )


# per-sequence maths: (rows [L, W] of positions 0..L-1, token slice of this request) -> [q_len, ...]
SequenceFn = Callable[[torch.Tensor, slice], torch.Tensor]


class PagedRowCache(nn.Module, AttentionLayerBase):
    """One layer's rows in vLLM's paged KV cache; registers itself as an attention layer under ``prefix``.

    ``prefix`` (e.g. ``model.layers.3.attn``) must hold exactly one integer: vLLM orders caches by it.
    """

    def __init__(self, *, row_width: int, cache_width: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        if row_width > cache_width:
            raise ValueError(f"{prefix}: row width {row_width} exceeds the cache row width {cache_width}")
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"kv_cache_dtype={cache_dtype!r} is not supported by the portable DeepSeek-V4 attention "
                "(it stores rows in the model dtype); use kv_cache_dtype='auto'"
            )
        self.row_width = row_width
        self.cache_width = cache_width
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
        md = get_forward_context().attn_metadata
        if md is None:
            return None
        if isinstance(md, list):
            raise NotImplementedError("micro-batching (ubatch) is not supported by the portable attention")
        return md.get(self.layer_name) if isinstance(md, dict) else md

    def forward(self, rows: torch.Tensor, out: torch.Tensor, sequence_fn: SequenceFn) -> bool:
        """Store ``rows: [T, row_width]`` and fill ``out[:num_actual_tokens]`` request by request.

        Returns False (and leaves ``out`` alone) when there is no metadata: a profile / dummy run.
        """
        md = self.metadata()
        if md is None or self.kv_cache.numel() == 0:
            return False
        self.run(md, rows, out, sequence_fn)
        return True

    def run(self, md: PortableAttentionMetadata, rows: torch.Tensor, out: torch.Tensor,
            sequence_fn: SequenceFn) -> None:
        """The paged part of :meth:`forward` for explicit metadata: write rows, then per request gather
        positions ``0 .. seq_len-1`` through the block table and fill its slice of ``out``."""
        cache = self.kv_cache  # [num_blocks, 1, block_size, cache_width]
        block_size = cache.shape[2]
        n = md.num_actual_tokens
        slots = md.slot_mapping
        keep = slots >= 0
        slots = slots[keep]
        cache[slots // block_size, 0, slots % block_size, : self.row_width] = rows[:n][keep].to(cache.dtype)

        qsl = md.query_start_loc
        for r, seq_len in enumerate(md.seq_lens):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            pos = torch.arange(seq_len, device=cache.device)
            blocks = md.block_table[r, pos // block_size].long()
            seq_rows = cache[blocks, 0, pos % block_size, : self.row_width]
            out[start:end] = sequence_fn(seq_rows, slice(start, end))
