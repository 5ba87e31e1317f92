"""DeepSeek-V4 attention layer (portable path): SWA, C4 (indexer top-k) and C128, with an attention sink.

Per token ``t`` at position ``p``::

    qr  = q_norm(wq_a(x))                         # [q_lora]
    q   = wq_b(qr).view(H, d);  q = q / rms(q)    # per-head RMS, no weight
    q   = rope(q, p)                              # last 64 channels, interleaved
    kv  = rope(kv_norm(wkv(x)), p)                # ONE 512-d latent: key and value at once
    topk_idxs(t) = window {p-127 .. p}  ++  C128: every complete entry | C4: the indexer's top-k entries
    o   = sparse_attn(q, kv, attn_sink, topk_idxs, d^-0.5);  o = rope^-1(o, p)
    out = wo_b(grouped wo_a(o))                   # G groups of H/G heads, o_lora rank each

``wq_a`` and ``wkv`` are one stacked replicated GEMM (``fused_wqa_wkv``); heads (``wq_b``, ``attn_sink``)
and output groups (``wo_a``) are split across tensor-parallel ranks, ``wo_b`` reduces. The paged cache, the
step's indices and the choice of kernel are the attention backend's (``attention/backend.py``): this file
holds the maths.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

from vllm_dsv4_mtp.attention.backend import DeepseekV4SparseAttention
from vllm_dsv4_mtp.attention.rows import cache_row_width, entry_channels, layer_row_width
from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO
from vllm_dsv4_mtp.cpu.linear import GroupedLinear, Linear, prepared_linear
from vllm_dsv4_mtp.cpu.norm import rms_norm, rms_normalise
from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.indexer import Indexer
from vllm_dsv4_mtp.model.rope import layer_rope
from vllm_dsv4_mtp.model.split_sums import all_reduce, wide_layer


class DeepseekV4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (native ``layers.N.attn.*``, or ``mtp.0.attn.*`` with ratio 0)."""

    def __init__(self, vllm_config: VllmConfig, spec: DeepseekV4Spec, *, compress_ratio: int, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.n_heads, self.head_dim, self.n_groups = spec.num_attention_heads, spec.head_dim, spec.o_groups
        if self.n_heads % tp or self.n_groups % tp:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) and o_groups ({self.n_groups}) must be divisible by the "
                f"tensor-parallel size ({tp})"
            )
        self.n_local_heads, self.n_local_groups = self.n_heads // tp, self.n_groups // tp
        self.eps = spec.rms_norm_eps
        self.compress_ratio = ratio = compress_ratio if compress_ratio > 1 else 0
        hidden, d, q_lora, o_lora = spec.hidden_size, spec.head_dim, spec.q_lora_rank, spec.o_lora_rank
        # wq_a and wkv read the same x: one stacked replicated GEMM
        self.fused_wqa_wkv = prepared_linear(
            MergedColumnParallelLinear(
                hidden, [q_lora, d], bias=False, prefix=f"{prefix}.fused_wqa_wkv", disable_tp=True, return_bias=False
            )
        )
        self.q_norm = RMSNorm(q_lora, eps=self.eps)
        self.kv_norm = RMSNorm(d, eps=self.eps)
        self.wq_b = prepared_linear(
            ColumnParallelLinear(q_lora, self.n_heads * d, bias=False, prefix=f"{prefix}.wq_b", return_bias=False)
        )
        self.wo_a = GroupedLinear(self.n_heads * d // self.n_groups, o_lora, self.n_groups, self.n_local_groups)
        self.wo_b = prepared_linear(
            RowParallelLinear(self.n_groups * o_lora, hidden, bias=False, prefix=f"{prefix}.wo_b", return_bias=False)
        )
        self._wo_b_wide: Linear | None = None  # float32 models: wo_b in float64, set by pack()
        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = self._load_sink  # type: ignore[attr-defined]
        self.rope = layer_rope(spec, ratio)  # YaRN on compressed layers
        self.compressor = Compressor(hidden, d, ratio, self.eps, self.rope, f"{prefix}.compressor") if ratio else None
        self.indexer = Indexer(spec, self.rope, f"{prefix}.indexer") if ratio == OVERLAP_RATIO else None
        # the row after kv: each compressor's [c | z], pooled into its entries at the block's completing row
        self.channels = ch = entry_channels(ratio, d, spec.index_head_dim)
        self.pools = [(self.compressor, ch["kv_gate"], ch["entry"])] if ratio else []
        if self.indexer is not None:
            self.pools.append((self.indexer.compressor, ch["index_kv_gate"], ch["ikey"]))
        # every layer pads its rows to one width, so target and draft share one KV-cache group
        self.row_width = layer_row_width(ratio, d, spec.index_head_dim)
        cache_width = cache_row_width(list(spec.compress_ratios[: spec.num_hidden_layers]), d, spec.index_head_dim)
        self.sparse_attn = DeepseekV4SparseAttention(
            vllm_config,
            prefix=prefix,
            num_heads=self.n_local_heads,
            head_dim=d,
            window=spec.sliding_window,
            compress_ratio=ratio,
            row_width=self.row_width,
            cache_width=cache_width,
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
        parts = [kv] + [c.fused_wkv_wgate(x) for c, _, _ in self.pools]  # the row: kv, then each [c | z]
        return q, qr, torch.cat(parts, dim=-1) if len(parts) > 1 else kv

    def write_latent(self, md, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Only the cache write of :meth:`forward_paged`, for a sliding-window layer (the MTP block) at a step whose
        output is never read: ``kv = rope(kv_norm(x @ wkv))`` into the step's rows; no query, no attention."""
        if self.compress_ratio != 0:
            raise ValueError("write_latent: a sliding-window layer's cache (compress_ratio 0) only")
        x = x[: md.num_tokens]
        kv = rms_norm(self.fused_wqa_wkv(x)[:, -self.head_dim :], self.kv_norm)
        kv = self.rope.apply_(kv.unsqueeze(1), self.rope.rotation(positions[: md.num_tokens])).squeeze(1)
        self.sparse_attn.write(md, positions, kv)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: ``o: [T, H_local, d]`` -> ``[T, D]`` (all-reduced over TP)."""
        t = o.shape[0]
        o = o.reshape(t, self.n_local_groups, -1)  # [T, G_local, (H/G) d]
        if self._wo_b_wide is None:
            return self.wo_b(self.wo_a(o))
        return all_reduce(self._wo_b_wide(self.wo_a(o))).to(o.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]`` (the normed sub-layer input) at ``positions: [T]`` -> ``[T, D]``; vLLM's profile / dummy
        runs (no metadata) only project."""
        md = self.sparse_attn.metadata()
        if md is None:
            q, _, _ = self.project(x, self.rope.rotation(positions))
            return self.output(torch.zeros_like(q))
        return self.forward_paged(md, positions, x)

    def forward_paged(self, md, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` over the step's metadata ``md`` (the backend's): write the step's rows, pool the
        blocks they complete, pick (C4), attend. Padding tokens (vLLM's, after the step's own) are projected as
        they come; the backend never stores or attends them, and their output is 0."""
        rot = self.rope.rotation(positions)
        q, qr, rows = self.project(x, rot)
        self.sparse_attn.write(md, positions, rows)
        for c, kv_gate, entry in self.pools:
            self.sparse_attn.compress(md, c, ratio=c.ratio, kv_gate=kv_gate, width=c.row_width, entry=entry)
        picks = None
        if self.indexer is not None:
            iq, iw = self.indexer.queries(qr, x, rot)
            picks = self.sparse_attn.indexer_picks(md, iq, iw, self.indexer.select, ikey=self.channels["ikey"])
        o = self.sparse_attn(md, q, self.attn_sink, picks)
        return self.output(self.rope.apply_(o, rot.conj_physical()))
