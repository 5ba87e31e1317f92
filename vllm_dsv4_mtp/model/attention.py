"""DeepSeek-V4 attention layer (portable path): SWA, C4 (indexer top-k) and C128, with an attention sink.

Per token ``t`` at position ``p``::

    qr  = q_norm(wq_a(x))                         # [q_lora]
    q   = wq_b(qr).view(H, d);  q = q / rms(q)    # per-head RMS, no weight
    q   = rope(q, p)                              # last 64 channels, interleaved
    kv  = rope(kv_norm(wkv(x)), p)                # ONE 512-d latent: key and value at once
    keys(t) = window {p-127 .. p}  U  compressed entries (C128: all complete; C4: indexer top-k)
    o   = softmax_with_sink(q . keys * d^-0.5) @ keys ;  o = rope^-1(o, p)
    out = wo_b(grouped wo_a(o))                   # G groups of H/G heads, o_lora rank each

``wq_a`` and ``wkv`` are one stacked replicated GEMM (``fused_wqa_wkv``); heads (``wq_b``, ``attn_sink``)
and output groups (``wo_a``) are split across tensor-parallel ranks, ``wo_b`` reduces. The cache-touching
part is :class:`vllm_dsv4_mtp.model.paged_rows.PagedRowCache` with the step's addressing
(``model/attention_metadata.py``); this file holds the maths, batched over the whole step: the queries are
laid out as ``[n_seg, S]`` segments (consecutive queries of one request), each segment attends to one
contiguous window-key range plus the C128 entries it may see or (C4) each query's indexer picks. Segments (at
most ``attention_metadata.SEGMENT`` = 32 queries: decodes, verify windows, prefill pieces) attend through the
plugin's compiled loop, which reads those keys from the cache by index (``cpu/sink_loop.py``); where that loop
is not usable (no C compiler, float16 rows) through torch's flash kernel over gathered keys
(``model/sink_attention.py``). A layer with compress ratio 0 attends through vLLM's CPU
paged-attention kernel instead where that kernel takes its cache (``cpu/paged_window.py``): the window and the
sink are all it sees.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO
from vllm_dsv4_mtp.cpu import sink_loop
from vllm_dsv4_mtp.cpu.kit import KIT
from vllm_dsv4_mtp.cpu.linear import Linear, dispatched_linear, plain_linears, prepared_linear, slice_linears
from vllm_dsv4_mtp.cpu.paged_window import WindowKernel
from vllm_dsv4_mtp.model.attention_metadata import PortableAttentionMetadata, SharedKeys
from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.indexer import Indexer, indexer_topk
from vllm_dsv4_mtp.model.norm import rms_norm, rms_normalise
from vllm_dsv4_mtp.model.paged_rows import PagedRowCache, cache_row_width, entry_channels, layer_row_width
from vllm_dsv4_mtp.model.rope import layer_rope
from vllm_dsv4_mtp.model.sink_attention import additive_mask, sink_attention
from vllm_dsv4_mtp.model.split_sums import all_reduce, wide_layer

# the intermediates of one group of segments (masks, gathered keys, indexer scores) stay below this many elements
GROUP_BUDGET = 1 << 23
# wo_a as one block-diagonal linear while that matrix has at most this many elements (the embedded model's:
# 2 x 64 x 2 x 256: one call instead of one per group and a concatenation, faster on CPU: docs/benchmarks.md);
# DeepSeek-V4's own groups stay one call each
BLOCK_DIAGONAL_MAX = 1 << 20


class GroupedLinear(nn.Module):
    """Block-diagonal ``wo_a``: group ``g`` maps its ``(H/G) d`` inputs to ``o_lora`` outputs.

    ``weight: [G_local * o_lora, (H/G) d]`` (native ``wo_a.weight`` rows of this rank's groups); applied one
    group at a time (after :meth:`pack` through vLLM's CPU GEMM dispatch, ``cpu/linear.py``), so it is a
    plain parameter rather than a vLLM linear layer.
    """

    def __init__(self, in_per_group: int, out_per_group: int, n_groups: int, n_local_groups: int):
        super().__init__()
        self.out_per_group = out_per_group
        self.n_groups = n_groups
        self.n_local_groups = n_local_groups
        self.weight = nn.Parameter(torch.empty(n_local_groups * out_per_group, in_per_group), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self._linears: list[Linear] | None = None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        full = (self.n_groups * self.out_per_group, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"wo_a: expected shape {full}, got {tuple(loaded.shape)}")
        rows = param.shape[0]
        start = get_tensor_model_parallel_rank() * rows
        param.data.copy_(loaded[start : start + rows])

    def _grouped_weight(self) -> torch.Tensor:
        return self.weight.view(self.n_local_groups, self.out_per_group, -1)

    def pack(self) -> None:
        """After loading: one linear per group or, while that matrix is small (``BLOCK_DIAGONAL_MAX``), one
        block-diagonal linear for all groups (one call instead of ``G_local`` and a concatenation; the zero
        blocks add exact zeros)."""
        w = self._grouped_weight()
        g, n, k = w.shape
        if g > 1 and g * n * g * k <= BLOCK_DIAGONAL_MAX:
            self._linears = [dispatched_linear(torch.block_diag(*w.data))]
        else:
            self._linears = slice_linears(w)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """``o: [T, G_local, (H/G) d]`` -> ``[T, G_local * o_lora]`` (groups side by side)."""
        linears = self._linears if self._linears is not None else plain_linears(self._grouped_weight())
        if len(linears) == 1:
            return linears[0](o.reshape(o.shape[0], -1))
        return torch.cat([lin(o[:, g]) for g, lin in enumerate(linears)], dim=-1)


class DeepseekV4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (native ``layers.N.attn.*``, or ``mtp.0.attn.*`` with ratio 0)."""

    def __init__(self, vllm_config: VllmConfig, spec: DeepseekV4Spec, *, compress_ratio: int, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.hidden_size = spec.hidden_size
        self.n_heads = spec.num_attention_heads
        self.head_dim = spec.head_dim
        self.rope_dim = spec.qk_rope_head_dim
        self.n_groups = spec.o_groups
        self.o_lora_rank = spec.o_lora_rank
        self.window = spec.sliding_window
        self.eps = spec.rms_norm_eps
        self.compress_ratio = compress_ratio if compress_ratio > 1 else 0
        if self.n_heads % tp or self.n_groups % tp:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) and o_groups ({self.n_groups}) must be divisible by the "
                f"tensor-parallel size ({tp})"
            )
        self.n_local_heads = self.n_heads // tp
        self.n_local_groups = self.n_groups // tp
        self.scale = self.head_dim**-0.5
        self._build_projections(spec, prefix)
        self._build_compression(spec, prefix)
        ratios = list(spec.compress_ratios[: spec.num_hidden_layers])
        self.row_width = layer_row_width(self.compress_ratio, self.head_dim, spec.index_head_dim)
        self.channels = entry_channels(self.compress_ratio, self.head_dim, spec.index_head_dim)
        # every layer pads its rows to one width, so target and draft share one KV-cache group
        self.cache = PagedRowCache(
            row_width=self.row_width,
            cache_width=cache_row_width(ratios, self.head_dim, spec.index_head_dim),
            piece_width=self.head_dim,
            prefix=prefix,
            vllm_config=vllm_config,
        )

    def _build_projections(self, spec: DeepseekV4Spec, prefix: str) -> None:
        """Query/KV projections (``wq_a`` and ``wkv`` fused: one GEMM of the same input), grouped output, sink."""
        self.fused_wqa_wkv = prepared_linear(
            MergedColumnParallelLinear(
                self.hidden_size,
                [spec.q_lora_rank, self.head_dim],
                bias=False,
                prefix=f"{prefix}.fused_wqa_wkv",
                disable_tp=True,
                return_bias=False,
            )
        )
        self.q_norm = RMSNorm(spec.q_lora_rank, eps=self.eps)
        self.kv_norm = RMSNorm(self.head_dim, eps=self.eps)
        self.wq_b = prepared_linear(
            ColumnParallelLinear(
                spec.q_lora_rank,
                self.n_heads * self.head_dim,
                bias=False,
                prefix=f"{prefix}.wq_b",
                return_bias=False,
            )
        )
        # grouped low-rank output: wo_a is block-diagonal over groups, applied as a batched matmul
        self.wo_a = GroupedLinear(
            self.n_heads * self.head_dim // self.n_groups, self.o_lora_rank, self.n_groups, self.n_local_groups
        )
        self.wo_b = prepared_linear(
            RowParallelLinear(
                self.n_groups * self.o_lora_rank,
                self.hidden_size,
                bias=False,
                prefix=f"{prefix}.wo_b",
                return_bias=False,
            )
        )
        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = self._load_sink  # type: ignore[attr-defined]
        self._wo_b_wide: Linear | None = None  # float32 models: wo_b in float64, set by pack()
        self._window_kernel: tuple[torch.Tensor, WindowKernel | None] | None = None  # (bound cache, kernel)

    def _build_compression(self, spec: DeepseekV4Spec, prefix: str) -> None:
        """The layer's rope (YaRN on compressed layers), its compressor (C4 / C128) and, on C4, the indexer."""
        self.rope = layer_rope(
            compress_ratio=self.compress_ratio,
            rope_dim=self.rope_dim,
            rope_theta=spec.rope_theta,
            compress_rope_theta=spec.compress_rope_theta,
            rope_scaling=spec.rope_scaling,
        )
        self.compressor = (
            Compressor(self.hidden_size, self.head_dim, self.compress_ratio, self.eps, prefix=f"{prefix}.compressor")
            if self.compress_ratio
            else None
        )
        self.indexer = (
            Indexer(
                self.hidden_size,
                spec.q_lora_rank,
                spec.index_n_heads,
                spec.index_head_dim,
                spec.index_topk,
                self.eps,
                prefix=f"{prefix}.indexer",
            )
            if self.compress_ratio == OVERLAP_RATIO
            else None
        )

    def _load_sink(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Native ``attn_sink [H]`` -> this rank's heads."""
        if loaded.shape != (self.n_heads,):
            raise ValueError(f"attn_sink: expected shape {(self.n_heads,)}, got {tuple(loaded.shape)}")
        start = get_tensor_model_parallel_rank() * self.n_local_heads
        param.data.copy_(loaded[start : start + self.n_local_heads].float())

    def pack(self) -> None:
        """After loading: a float32 model's ``wo_b`` (a sum TP splits) in float64 (``model/split_sums.py``)."""
        self._wo_b_wide = wide_layer(self.wo_b)

    # ----------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token projections. ``x: [T, D]``, ``rot``: the tokens' rope rotations -> ``q [T, H_local, d]``,
        ``qr [T, q_lora]``, ``rows [T, W]``."""
        qr_kv = self.fused_wqa_wkv(x)
        qr, kv = qr_kv.split([qr_kv.shape[-1] - self.head_dim, self.head_dim], dim=-1)
        qr = rms_norm(qr, self.q_norm)
        kv = rms_norm(kv, self.kv_norm)
        q = self.wq_b(qr).view(-1, self.n_local_heads, self.head_dim)
        q = rms_normalise(q, self.eps)
        # one rotation for the query heads and the latent: [T, H_local + 1, d]
        qkv = self.rope.apply_(torch.cat([q, kv.unsqueeze(1)], dim=1), rot)
        q, kv = qkv[:, :-1], qkv[:, -1]
        parts = [kv]
        if self.compressor is not None:
            parts.append(self.compressor.project(x))
        if self.indexer is not None:
            parts.append(self.indexer.compressor.project(x))
        return q, qr, parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def write_latent(self, md: PortableAttentionMetadata, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Only the cache write of :meth:`forward_paged`, for a sliding-window layer (the MTP block) at a step whose
        output is never read: ``kv = rope(kv_norm(x @ wkv))`` into the step's rows; no query, no attention."""
        if self.compress_ratio != 0:
            raise ValueError("write_latent: a sliding-window layer's cache (compress_ratio 0) only")
        md.check_positions(positions)
        x = x[: md.num_tokens]
        kv = rms_norm(self.fused_wqa_wkv(x)[:, -self.head_dim :], self.kv_norm)
        rot = self.rope.step_rotation(md.derived.rotations, "tokens", md.positions)
        kv = self.rope.apply_(kv.unsqueeze(1), rot).squeeze(1)
        kernel = self.window_kernel()
        if kernel is not None:
            kernel.write(md, kv)
        else:
            self.cache.write(md, kv)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: ``o: [T, H_local, d]`` -> ``[T, D]`` (all-reduced over TP)."""
        t = o.shape[0]
        o = o.reshape(t, self.n_local_groups, -1)  # [T, G_local, (H/G) d]
        if self._wo_b_wide is None:
            return self.wo_b(self.wo_a(o))
        return all_reduce(self._wo_b_wide(self.wo_a(o))).to(o.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]`` (the normed sub-layer input) at ``positions: [T]`` -> ``[T, D]``.

        Writes the step's rows, completes the blocks its tokens close (entries and indexer keys into the
        completing rows), then attends; vLLM's profile / dummy runs (no metadata) only project.
        """
        md = self.cache.metadata()
        if md is None:
            q, _, _ = self.project(x, self.rope.rotation(positions))
            return self.output(torch.zeros_like(q))
        return self.forward_paged(md, positions, x)

    def window_kernel(self) -> WindowKernel | None:
        """vLLM's CPU attention kernel over this layer's bound cache where it applies (a SWA layer:
        ``cpu/paged_window.py``), else None; decided once per bound cache."""
        cache = self.cache.kv_cache
        if self._window_kernel is None or self._window_kernel[0] is not cache:
            kernel = (
                WindowKernel(cache, self.head_dim, self.window, self.scale)
                if self.compress_ratio == 0 and KIT.paged_window(cache, self.head_dim)
                else None
            )
            self._window_kernel = (cache, kernel)
        return self._window_kernel[1]

    def uses_sink_kernel(self) -> bool:
        """Whether the segments attend through the compiled kernel (``cpu/sink_loop.py``) over this
        layer's bound cache: the kit's answer for its rows (kept per process, so asked every step). Every segment
        may: it is at most ``attention_metadata.SEGMENT`` = 32 queries, where the kernel is faster than torch's
        flash kernel, which only pays for segments several times longer (docs/benchmarks.md)."""
        cache = self.cache.kv_cache
        return KIT.sink_loop(cache.dtype, self.head_dim, cache.device)

    def forward_paged(self, md: PortableAttentionMetadata, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for explicit metadata (a ``PortableAttentionMetadata``) over the bound cache."""
        md.check_positions(positions)
        n = md.num_tokens
        x_real = x[:n]
        rot = self.rope.step_rotation(md.derived.rotations, "tokens", md.positions)
        q, qr, rows = self.project(x_real, rot)
        kernel = self.window_kernel()
        if kernel is not None:  # a SWA layer (its rows are the latent alone) through vLLM's CPU kernel
            kernel.write(md, rows)
            o = kernel.attend(md, q, self.attn_sink)
        else:
            self.cache.write(md, rows)
            ch = self.channels
            index_q = index_w = None
            if self.compressor is not None:
                self.compressor.complete(
                    md, self.cache, self.rope, kv_gate_channel=ch["kv_gate"], entry_channel=ch["entry"]
                )
            if self.indexer is not None:
                self.indexer.compressor.complete(
                    md, self.cache, self.rope, kv_gate_channel=ch["index_kv_gate"], entry_channel=ch["ikey"]
                )
                index_q, index_w = self.indexer.queries(qr, x_real, rot, self.rope)
            o = self.attend(md, q, index_q, index_w)
        o = self.rope.apply_(o, self.rope.step_rotation(md.derived.rotations, "tokens", md.positions, inverse=True))
        if n < x.shape[0]:  # padding tokens: output 0
            o = torch.cat([o, o.new_zeros(x.shape[0] - n, *o.shape[1:])])
        return self.output(o)

    # ----------------------------------------------------------------------------------------------
    def attend(
        self, md: PortableAttentionMetadata, q: torch.Tensor, index_q: torch.Tensor | None, index_w: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of the step's queries ``q: [n, H_local, d]`` over the paged rows -> ``[n, H_local, d]``
        (rope still applied at the query positions). ``index_q, index_w``: the indexer's (C4 only)."""
        b, s = md.num_segments, md.seg_len
        if b == 0:
            return q.new_zeros(q.shape)

        def segments(t: torch.Tensor | None) -> torch.Tensor | None:  # [n, ...] -> [n_seg, S, ...]
            if t is None:
                return None
            t = t if md.query_index is None else t.index_select(0, md.query_index)
            return t.view(b, s, *t.shape[1:])

        qs, iq, iw = segments(q), segments(index_q), segments(index_w)
        n_win = md.window(self.window).slots.shape[1]
        n_ent = md.entries(self.compress_ratio).count if self.compress_ratio else 0
        k = min(self.indexer.topk, n_ent) if self.indexer is not None else n_ent
        shared = n_win + k  # keys every query scores
        per_seg = s * self.n_local_heads * (shared + 1) + shared * self.head_dim
        if self.indexer is not None:
            per_seg = max(per_seg, s * self.indexer.n_heads * n_ent, s * k * self.head_dim)
        groups = md.segment_groups(per_seg, GROUP_BUDGET)
        outs = [
            self._attend_group(
                md, slice(lo, hi), qs[lo:hi], None if iq is None else iq[lo:hi], None if iw is None else iw[lo:hi]
            )
            for lo, hi in groups
        ]
        o = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(b * s, *q.shape[1:])
        return o if md.output_index is None else o.index_select(0, md.output_index)

    def _shared_keys(self, md: PortableAttentionMetadata, additive: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys every query of a segment may see: the window and (C128-style layers) every complete entry, as
        one cache-piece index ``[n_seg, K]`` (one gather reads both) and which each query may not see,
        ``[n_seg, S, K]``: bool (True = masked), or with ``additive`` the additive mask in the cache dtype; the
        same for every layer of this kind, so made once per step (:class:`SharedKeys`)."""
        made = md.derived.shared_keys
        key = (self.window, 0 if self.indexer is not None else self.compress_ratio)
        if key not in made:
            ch = self.channels
            win = md.window(self.window)
            index, masked = [self.cache.piece_index(win.slots, ch["kv"])], [win.masked]
            ent = md.entries(self.compress_ratio) if self.compress_ratio and self.indexer is None else None
            if ent is not None and ent.count:
                index.append(self.cache.piece_index(ent.slots, ch["entry"]))
                masked.append(ent.masked)
            made[key] = SharedKeys(torch.cat(index, dim=1), torch.cat(masked, dim=-1))
        keys = made[key]
        if not additive:
            return keys.index, keys.masked
        if keys.additive is None:
            keys.additive = additive_mask(keys.masked, self.cache.dtype)
        return keys.index, keys.additive

    def _attend_group(
        self,
        md: PortableAttentionMetadata,
        seg: slice,
        q: torch.Tensor,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
    ) -> torch.Tensor:
        """One group of segments: ``q: [B, S, H_local, d]`` -> ``[B, S, H_local, d]``."""
        ch = self.channels
        kernel = self.uses_sink_kernel()
        index, mask = (t[seg] for t in self._shared_keys(md, additive=not kernel))
        per_query = None
        picked = unseen = None
        ent = md.entries(self.compress_ratio) if self.indexer is not None else None
        if ent is not None and ent.count:  # C4: each query's indexer picks among the complete entries
            slots = ent.slots[seg]
            index_keys = self.cache.gather(slots, ch["ikey"], self.indexer.head_dim)
            picks, unseen = indexer_topk(iq, iw, index_keys, ent.masked[seg], ent.limit[seg], topk=self.indexer.topk)
            bsz, s, k = picks.shape
            picked = self.cache.piece_index(torch.gather(slots, 1, picks.reshape(bsz, s * k)), ch["entry"])
            if kernel:  # each query reads its own picks by index
                picked = picked.view(bsz, s, k)
            else:
                per_query = (self.cache.gather_pieces(picked.view(bsz, s, k)), unseen)
        if kernel:  # keys read from the cache by index, masks as they are
            return sink_loop.attend_rows(
                q, self.cache.piece_table(), index, mask, picked, unseen, self.attn_sink, self.scale
            )
        keys = self.cache.gather_pieces(index)
        return sink_attention(q, (keys, mask), per_query, self.attn_sink, self.scale)
