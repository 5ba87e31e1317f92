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
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

from vllm_dsv4_mtp.attention.backend import DeepseekV4SparseAttention
from vllm_dsv4_mtp.attention.rows import cache_row_width, entry_channels, layer_row_width
from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO
from vllm_dsv4_mtp.cpu.linear import Linear, grouped_linears, plain_linears, prepared_linear
from vllm_dsv4_mtp.cpu.norm import rms_norm, rms_normalise
from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.indexer import Indexer
from vllm_dsv4_mtp.model.rope import layer_rope
from vllm_dsv4_mtp.model.split_sums import all_reduce, wide_layer


class GroupedLinear(nn.Module):
    """Block-diagonal ``wo_a``: group ``g`` maps its ``(H/G) d`` inputs to ``o_lora`` outputs. ``weight:
    [G_local * o_lora, (H/G) d]`` (this rank's groups' rows), a plain parameter: the kit runs the groups."""

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
        """After loading: the groups' linears as the kit runs them (``cpu/linear.py:grouped_linears``)."""
        self._linears = grouped_linears(self._grouped_weight())

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
        self.n_groups = spec.o_groups
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
        self._build_projections(spec, prefix)
        self._build_compression(spec, prefix)
        ratios = list(spec.compress_ratios[: spec.num_hidden_layers])
        self.row_width = layer_row_width(self.compress_ratio, self.head_dim, spec.index_head_dim)
        self.channels = ch = entry_channels(self.compress_ratio, self.head_dim, spec.index_head_dim)
        # (compressor, channel of its [c | z] rows, channel of its entries) of the row's parts after kv
        pools = [
            (self.compressor, "kv_gate", "entry"),
            (self.indexer and self.indexer.compressor, "index_kv_gate", "ikey"),
        ]
        self.pools = [(c, ch[a], ch[b]) for c, a, b in pools if c is not None]
        # every layer pads its rows to one width, so target and draft share one KV-cache group
        self.sparse_attn = DeepseekV4SparseAttention(
            vllm_config,
            prefix=prefix,
            num_heads=self.n_local_heads,
            head_dim=self.head_dim,
            window=self.window,
            compress_ratio=self.compress_ratio,
            row_width=self.row_width,
            cache_width=cache_row_width(ratios, self.head_dim, spec.index_head_dim),
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
            self.n_heads * self.head_dim // self.n_groups, spec.o_lora_rank, self.n_groups, self.n_local_groups
        )
        self.wo_b = prepared_linear(
            RowParallelLinear(
                self.n_groups * spec.o_lora_rank,
                self.hidden_size,
                bias=False,
                prefix=f"{prefix}.wo_b",
                return_bias=False,
            )
        )
        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = self._load_sink  # type: ignore[attr-defined]
        self._wo_b_wide: Linear | None = None  # float32 models: wo_b in float64, set by pack()

    def _build_compression(self, spec: DeepseekV4Spec, prefix: str) -> None:
        """The layer's rope (YaRN on compressed layers), its compressor (C4 / C128) and, on C4, the indexer."""
        self.rope = layer_rope(
            compress_ratio=self.compress_ratio,
            rope_dim=spec.qk_rope_head_dim,
            rope_theta=spec.rope_theta,
            compress_rope_theta=spec.compress_rope_theta,
            rope_scaling=spec.rope_scaling,
        )
        self.compressor = (
            Compressor(
                self.hidden_size, self.head_dim, self.compress_ratio, self.eps, self.rope, prefix=f"{prefix}.compressor"
            )
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
                self.rope,
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
        blocks they complete, pick (C4), attend."""
        n = md.num_tokens
        rot = self.rope.rotation(positions[:n])
        q, qr, rows = self.project(x[:n], rot)
        self.sparse_attn.write(md, positions, rows)
        picks = None
        for c, kv_gate, entry in self.pools:
            self.sparse_attn.compress(md, c, ratio=c.ratio, kv_gate=kv_gate, width=c.row_width, entry=entry)
        if self.indexer is not None:
            iq, iw = self.indexer.queries(qr, x[:n], rot)
            picks = self.sparse_attn.indexer_picks(md, iq, iw, self.indexer.select, ikey=self.channels["ikey"])
        o = self.sparse_attn(md, q, self.attn_sink, picks)
        o = self.rope.apply_(o, rot.conj_physical())
        if n < x.shape[0]:  # padding tokens: output 0
            o = torch.cat([o, o.new_zeros(x.shape[0] - n, *o.shape[1:])])
        return self.output(o)
