"""The portable DeepSeek-V4 attention as a vLLM attention backend: Backend, MetadataBuilder, Impl, and the layer.

Each step vLLM calls :class:`DeepseekV4MetadataBuilder` once for the KV-cache group (the target and its MTP
draft), which makes the step's indices (``attention/metadata.py``). A model layer then, through its
:class:`DeepseekV4SparseAttention`::

    md = attn.metadata()                            # the forward context's, None in profile / dummy runs
    attn.write(md, positions, rows)                 # the step's rows at their slots
    attn.compress(md, compressor, ...)              # pool the blocks this step completes, entries into rows
    picks = attn.indexer_picks(md, qI, w, ...)      # C4: each query's top-k entries
    o = attn(md, q, sink, picks)                    # sparse_attn(q, kv, sink, topk_idxs, scale)

with ``topk_idxs = cat(window_idxs, entry_idxs[ratio] | picks)``, per query, ``-1`` = masked, into the cache's
piece table. The implementation is chosen once, when the cache is bound: vLLM's CPU paged kernel for a
sliding-window layer whose cache it takes, else the compiled loop where the CPU kit has it, else torch's
reference (``cpu/``).
"""

from __future__ import annotations

import numpy as np
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

from vllm_dsv4_mtp.attention.metadata import DeepseekV4AttentionMetadata, StepPlan, build_step
from vllm_dsv4_mtp.attention.rows import PagedRows
from vllm_dsv4_mtp.cpu.kit import KIT
from vllm_dsv4_mtp.cpu.paged_window import WindowKernel
from vllm_dsv4_mtp.cpu.sparse_attn import sparse_attn_compiled, sparse_attn_reference

PORTABLE_BACKEND_NAME = "DSV4_MTP_PORTABLE"

# On CPU, vLLM's unpadded draft path (0.32; 0.33's prepare_inputs reads the same) hands the draft metadata whose
# seq_lens is the tensor it also keeps as seq_lens_cpu_upper_bound (llm_base_proposer.prepare_inputs makes it with
# async_tensor_h2d, which on CPU returns its input; seen in 0.32), and each later draft step of one call increments
# both (eagle_step_update_slot_mapping_and_metadata, then "+= 1"): the k-th draft token's sequence would be k - 1
# positions too long. The padded path (the default) keeps them apart; with one draft token there is no later step.
UNPADDED_DRAFTS_ON_CPU = (
    "speculative_config.disable_padded_drafter_batch=True with num_speculative_tokens > 1 is not supported on CPU: "
    "vLLM's unpadded draft path makes the draft's seq_lens on CPU the same tensor as its seq_lens_cpu_upper_bound "
    "and increments both at every draft step, so the k-th draft token would see a sequence k - 1 positions too "
    "long; leave disable_padded_drafter_batch unset (the default padded path)"
)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64)


def step_plan(layers: list[DeepseekV4SparseAttention]) -> StepPlan:
    """What a step's metadata must hold for ``layers`` (bound)."""
    swa = next((layer for layer in layers if isinstance(layer.impl, PagedWindowImpl)), None)
    return StepPlan(
        window=layers[0].window,
        head_dim=layers[0].head_dim,
        pieces=layers[0].rows.pieces,
        ratios=tuple(sorted({layer.compress_ratio for layer in layers if layer.compress_ratio})),
        swa_kernel=None if swa is None else (swa.num_heads, swa.kv_cache.dtype),
    )


class DeepseekV4MetadataBuilder(AttentionMetadataBuilder[DeepseekV4AttentionMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # decodes, verifies and prefills may come in any order
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self._plan: StepPlan | None = None
        spec = vllm_config.speculative_config
        if (
            spec is not None
            and spec.disable_padded_drafter_batch
            and spec.num_speculative_tokens > 1
            and (spec.use_eagle() or spec.uses_draft_model())
            and torch.device(device).type == "cpu"
        ):
            raise ValueError(UNPADDED_DRAFTS_ON_CPU)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DeepseekV4AttentionMetadata:
        if self._plan is None:  # the caches are bound by the first step
            ctx = self.vllm_config.compilation_config.static_forward_context
            self._plan = step_plan([ctx[name] for name in self.layer_names])
        cm = common_attn_metadata
        n = cm.num_reqs
        # host copies: the drafter updates seq_lens (and its slot buffer) in place after building
        return build_step(
            self._plan,
            query_start_loc=_host(cm.query_start_loc_cpu[: n + 1]),
            seq_lens=_host(cm.seq_lens[:n]),
            block_table=_host(cm.block_table_tensor[:n]),
            slot_mapping=cm.slot_mapping.detach().cpu().clone(),
            num_actual_tokens=cm.num_actual_tokens,
            block_size=self.block_size,
        )


class SparseAttnImpl:
    """``sparse_attn(q, kv, sink, topk_idxs, scale)`` over the layer's piece table: the compiled loop or torch's
    reference, chosen at bind."""

    def __init__(self, compiled: bool):
        self.fn = sparse_attn_compiled if compiled else sparse_attn_reference

    def write(self, rows: PagedRows, slots: torch.Tensor, values: torch.Tensor) -> None:
        rows.write(slots, values)

    def forward(self, md, q, kv, sink, topk_idxs, scale) -> torch.Tensor:
        return self.fn(q, kv, sink, topk_idxs, scale)


class PagedWindowImpl:
    """A sliding-window layer through vLLM's CPU paged-attention kernel (its ``topk_idxs`` are the window's)."""

    def __init__(self, kernel: WindowKernel):
        self.kernel = kernel

    def write(self, rows: PagedRows, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.kernel.write(values, slots)

    def forward(self, md, q, kv, sink, topk_idxs, scale) -> torch.Tensor:
        return self.kernel.attend(q, sink, md.window_schedule)


class DeepseekV4AttentionBackend(AttentionBackend):
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return PORTABLE_BACKEND_NAME

    @staticmethod
    def get_builder_cls():
        return DeepseekV4MetadataBuilder

    @staticmethod
    def get_impl_cls():
        return SparseAttnImpl


class DeepseekV4SparseAttention(nn.Module, AttentionLayerBase):
    """One layer's rows in the paged cache and its attention; registered under ``prefix`` (one integer in it:
    vLLM orders caches by it). ``window``, ``compress_ratio`` (0: SWA) and ``num_heads`` (this rank's) are the
    layer's; ``cache_width`` is every layer's row width, ``row_width`` this layer's part of it."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        prefix: str,
        num_heads: int,
        head_dim: int,
        window: int,
        compress_ratio: int,
        row_width: int,
        cache_width: int,
    ):
        super().__init__()
        if row_width > cache_width or cache_width % head_dim:
            raise ValueError(f"{prefix}: row width {row_width} does not fit {head_dim}-wide pieces of {cache_width}")
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"kv_cache_dtype={cache_dtype!r} is not supported by the portable DeepSeek-V4 attention "
                "(it stores rows in the model dtype); use kv_cache_dtype='auto'"
            )
        self.layer_name = prefix
        self.num_heads, self.head_dim, self.window = num_heads, head_dim, window
        self.compress_ratio, self.row_width, self.cache_width = compress_ratio, row_width, cache_width
        self.scale = head_dim**-0.5
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache = torch.tensor([])
        self.rows: PagedRows | None = None
        self.impl: SparseAttnImpl | PagedWindowImpl | None = None
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate attention layer name {prefix!r}")
        ctx[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return DeepseekV4AttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.cache_width,
            head_size_v=0,
            dtype=self.dtype,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Bind ``[num_blocks, 1, block_size, cache_width]`` and choose the implementation, once."""
        self.kv_cache = kv_cache
        self.rows = PagedRows(kv_cache, self.head_dim)
        if self.compress_ratio == 0 and KIT.paged_window(kv_cache, self.head_dim):
            self.impl = PagedWindowImpl(WindowKernel(kv_cache, self.head_dim, self.window, self.scale))
        else:
            self.impl = SparseAttnImpl(KIT.sparse_attn_loop(kv_cache.dtype, self.head_dim, kv_cache.device))

    def metadata(self) -> DeepseekV4AttentionMetadata | None:
        """This step's metadata, or None in vLLM's profile / dummy runs (no cache to touch)."""
        if self.kv_cache.numel() == 0:
            return None
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            raise NotImplementedError("micro-batching (ubatch) is not supported by the portable attention")
        md = md.get(self.layer_name) if isinstance(md, dict) else md
        if md is not None and md.block_size != self.kv_cache.shape[2]:
            raise ValueError(f"{self.layer_name}: metadata block size {md.block_size} != {self.kv_cache.shape[2]}")
        return md

    def write(self, md: DeepseekV4AttentionMetadata, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the step's ``rows: [T, row_width]`` (padding tokens dropped) at their slots."""
        given = positions[: md.num_tokens].to(md.positions.dtype)
        if not torch.equal(given, md.positions):
            t = int((given != md.positions).nonzero()[0, 0])
            raise ValueError(
                "portable attention: the step's positions differ from seq_lens - query_lens + i (the addressing of "
                f"the paged rows assumes it): token {t} is at {int(given[t])}, addressed at {int(md.positions[t])}"
            )
        rows = rows[: md.num_actual_tokens]
        self.impl.write(self.rows, md.write_slots, rows if md.write_index is None else rows[md.write_index])

    def compress(self, md: DeepseekV4AttentionMetadata, pool, *, ratio: int, kv_gate: int, width: int, entry: int):
        """The blocks of ``ratio`` this step completes: their rows' channels ``[kv_gate, kv_gate + width)``
        through ``pool(rows [M, span, width], valid [M, span, 1], block_pos [M]) -> [M, w]``, stored at channel
        ``entry`` of each completing row."""
        done = md.completions[ratio]
        if done is not None:
            pooled = pool(self.rows.gather(done.row_slots, kv_gate, width), done.row_valid, done.block_pos)
            self.rows.put(done.dst, entry, pooled)

    def indexer_picks(self, md: DeepseekV4AttentionMetadata, q: torch.Tensor, w: torch.Tensor, select, *, ikey: int):
        """C4: ``select(q [B, S, nI, dI], w [B, S, nI], keys [B, n, dI], masked, limit) -> (picks, unseen)
        [B, S, k]`` over each segment's entries (keys at channel ``ikey``) -> the picks' piece indices
        ``[T, k]`` of the step's own tokens (-1: none; ``q``, ``w`` may go on with padding tokens)."""
        seg = md.indexer
        q, w = q[: md.num_tokens], w[: md.num_tokens]
        b, s = seg.masked.shape[:2]
        if seg.slots.shape[1] == 0 or md.num_tokens == 0:
            return q.new_empty((q.shape[0], 0), dtype=torch.int64)
        if seg.query_index is not None:
            q, w = q[seg.query_index], w[seg.query_index]
        keys = self.rows.gather(seg.slots, ikey, q.shape[-1])
        picks, unseen = select(q.view(b, s, *q.shape[1:]), w.view(b, s, -1), keys, seg.masked, seg.limit)
        idx = (
            torch.gather(seg.pieces, 1, picks.reshape(b, -1))
            .view(b * s, -1)
            .masked_fill_(unseen.reshape(b * s, -1), -1)
        )
        return idx if seg.output_index is None else idx[seg.output_index]

    def forward(self, md, q: torch.Tensor, sink: torch.Tensor, picks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, H, d]`` (roped), ``sink [H]`` -> ``[T, H, d]``: each of the step's queries over its window,
        then the entries of this layer's ratio (C128-style) or its ``picks`` (C4); padding tokens' rows 0."""
        n = md.num_tokens
        extra = picks if picks is not None else md.entry_idxs.get(self.compress_ratio)
        topk_idxs = md.window_idxs if extra is None else torch.cat([md.window_idxs, extra], dim=-1)
        o = self.impl.forward(md, q[:n], self.rows.table, sink, topk_idxs, self.scale)
        return o if n == q.shape[0] else torch.cat([o, o.new_zeros(q.shape[0] - n, *o.shape[1:])])
