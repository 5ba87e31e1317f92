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
part is :class:`vllm_dsv4_mtp.kernels.attention_core.PagedRowCache`; this file holds the maths, which
:meth:`DeepseekV4Attention.attend_sequence` applies to one sequence's rows.
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

from vllm_dsv4_mtp.kernels.attention_core import PagedRowCache, cache_row_width, layer_row_width
from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.indexer import Indexer
from vllm_dsv4_mtp.model.rope import layer_rope

# queries are processed in chunks of this many, so a long prefill's score matrix stays
# [chunk, H, chunk + window + entries] instead of [L, H, L]
QUERY_CHUNK = 256


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention with a per-head sink logit in the denominator only; K = V = ``keys``.

    ``q: [T, H, d]``, ``keys: [K, d]``, ``mask: [T, K]`` bool (True = visible), ``sink: [H]`` float32
    -> ``[T, H, d]`` in ``q.dtype``. Computed in float32.
    """
    k = keys.float()
    logits = torch.einsum("thd,kd->thk", q.float(), k) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1)
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    return torch.einsum("thk,kd->thd", p / denom, k).to(q.dtype)


class GroupedLinear(nn.Module):
    """Block-diagonal ``wo_a``: group ``g`` maps its ``(H/G) d`` inputs to ``o_lora`` outputs.

    ``weight: [G_local * o_lora, (H/G) d]`` (native ``wo_a.weight`` rows of this rank's groups); applied as a
    batched matmul, so it is a plain parameter rather than a vLLM linear layer.
    """

    def __init__(self, in_per_group: int, out_per_group: int, n_groups: int, n_local_groups: int):
        super().__init__()
        self.out_per_group = out_per_group
        self.n_groups = n_groups
        self.n_local_groups = n_local_groups
        self.weight = nn.Parameter(torch.empty(n_local_groups * out_per_group, in_per_group), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        full = (self.n_groups * self.out_per_group, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"wo_a: expected shape {full}, got {tuple(loaded.shape)}")
        rows = param.shape[0]
        start = get_tensor_model_parallel_rank() * rows
        param.data.copy_(loaded[start : start + rows])

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """``o: [T, G_local, (H/G) d]`` -> ``[T, G_local, o_lora]``."""
        w = self.weight.view(self.n_local_groups, self.out_per_group, -1)
        return torch.einsum("tgk,grk->tgr", o, w)


class DeepseekV4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (native ``layers.N.attn.*``, or ``mtp.0.attn.*`` with ratio 0)."""

    def __init__(self, vllm_config: VllmConfig, *, compress_ratio: int, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        tp = get_tensor_model_parallel_world_size()
        self.hidden_size = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.n_groups = config.o_groups
        self.o_lora_rank = config.o_lora_rank
        self.window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.compress_ratio = compress_ratio if compress_ratio > 1 else 0
        if self.n_heads % tp or self.n_groups % tp:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) and o_groups ({self.n_groups}) must be divisible by the "
                f"tensor-parallel size ({tp})"
            )
        self.n_local_heads = self.n_heads // tp
        self.n_local_groups = self.n_groups // tp
        self.scale = self.head_dim**-0.5

        self.fused_wqa_wkv = MergedColumnParallelLinear(
            self.hidden_size, [config.q_lora_rank, self.head_dim], bias=False, quant_config=None,
            prefix=f"{prefix}.fused_wqa_wkv", disable_tp=True, return_bias=False,
        )
        self.q_norm = RMSNorm(config.q_lora_rank, eps=self.eps)
        self.kv_norm = RMSNorm(self.head_dim, eps=self.eps)
        self.wq_b = ColumnParallelLinear(
            config.q_lora_rank, self.n_heads * self.head_dim, bias=False, quant_config=None,
            prefix=f"{prefix}.wq_b", return_bias=False,
        )
        # grouped low-rank output: wo_a is block-diagonal over groups, applied as a batched matmul
        self.wo_a = GroupedLinear(
            self.n_heads * self.head_dim // self.n_groups, self.o_lora_rank, self.n_groups, self.n_local_groups
        )
        self.wo_b = RowParallelLinear(
            self.n_groups * self.o_lora_rank, self.hidden_size, bias=False, quant_config=None,
            prefix=f"{prefix}.wo_b", return_bias=False,
        )
        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = self._load_sink  # type: ignore[attr-defined]

        self.rope = layer_rope(
            compress_ratio=self.compress_ratio, rope_dim=self.rope_dim, rope_theta=config.rope_theta,
            compress_rope_theta=getattr(config, "compress_rope_theta", config.rope_theta),
            rope_scaling=getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None),
        )
        self.compressor = (
            Compressor(self.hidden_size, self.head_dim, self.compress_ratio, self.eps, prefix=f"{prefix}.compressor")
            if self.compress_ratio
            else None
        )
        self.indexer = (
            Indexer(
                self.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
                config.index_topk, self.eps, prefix=f"{prefix}.indexer",
            )
            if self.compress_ratio == 4
            else None
        )
        ratios = list(config.compress_ratios[: config.num_hidden_layers])
        self.row_width = layer_row_width(self.compress_ratio, self.head_dim, config.index_head_dim)
        self.cache = PagedRowCache(
            row_width=self.row_width,
            cache_width=cache_row_width(ratios, self.head_dim, config.index_head_dim),
            prefix=prefix,
            vllm_config=vllm_config,
        )

    def _load_sink(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Native ``attn_sink [H]`` -> this rank's heads."""
        if loaded.shape != (self.n_heads,):
            raise ValueError(f"attn_sink: expected shape {(self.n_heads,)}, got {tuple(loaded.shape)}")
        start = get_tensor_model_parallel_rank() * self.n_local_heads
        param.data.copy_(loaded[start : start + self.n_local_heads].float())

    # ----------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token projections. ``x: [T, D]`` -> ``q [T, H_local, d]``, ``qr [T, q_lora]``, ``rows [T, W]``."""
        qr_kv = self.fused_wqa_wkv(x)
        qr, kv = qr_kv.split([qr_kv.shape[-1] - self.head_dim, self.head_dim], dim=-1)
        qr = self.q_norm(qr)
        kv = self.rope(self.kv_norm(kv), positions)
        q = self.wq_b(qr).view(-1, self.n_local_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = self.rope(q, positions)
        parts = [kv]
        if self.compressor is not None:
            parts.append(self.compressor.project(x))
        if self.indexer is not None:
            parts.append(self.indexer.compressor.project(x))
        return q, qr, torch.cat(parts, dim=-1)

    def attend_sequence(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        index_q: torch.Tensor | None = None,
        index_w: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one sequence's queries over its rows.

        Args:
            q: ``[Tq, H_local, d]`` roped queries at ``positions: [Tq]`` (consecutive).
            rows: ``[L, row_width]`` rows of positions ``0 .. L-1`` (``L > positions.max()``).
            index_q, index_w: the indexer's queries and head weights of these tokens (C4 only).

        Returns:
            ``[Tq, H_local, d]``, rope removed at the query positions.
        """
        d = self.head_dim
        kv = rows[:, :d]
        entries = None
        picks = None
        if self.compressor is not None:
            cw = self.compressor.row_width
            entries = self.compressor.entries(rows[:, d : d + cw], self.rope)  # [n, d]
            if self.indexer is not None:
                picks = self.indexer.select(index_q, index_w, rows[:, d + cw :], positions, self.rope)
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], QUERY_CHUNK):
            b = min(a + QUERY_CHUNK, q.shape[0])
            pos = positions[a:b]
            lo = max(int(pos[0]) - self.window + 1, 0)
            hi = int(pos[-1]) + 1
            key_pos = torch.arange(lo, hi, device=q.device)
            diff = pos.unsqueeze(1) - key_pos.unsqueeze(0)
            mask = (diff >= 0) & (diff < self.window)  # [tq, hi - lo]
            keys = kv[lo:hi]
            if entries is not None and entries.shape[0] > 0:
                entry = torch.arange(entries.shape[0], device=q.device)
                if picks is None:  # C128: every complete entry
                    emask = entry.unsqueeze(0) < ((pos + 1) // self.compress_ratio).unsqueeze(1)
                else:  # C4: the indexer's picks (-1 = none)
                    p = picks[a:b]
                    emask = torch.zeros(b - a, entries.shape[0] + 1, dtype=torch.bool, device=q.device)
                    emask.scatter_(1, torch.where(p >= 0, p, entries.shape[0]), True)
                    emask = emask[:, :-1]
                keys = torch.cat([keys, entries.to(keys.dtype)], dim=0)
                mask = torch.cat([mask, emask], dim=1)
            out[a:b] = sink_attention(q[a:b], keys, mask, self.attn_sink, self.scale)
        return self.rope(out, positions, inverse=True)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: ``o: [T, H_local, d]`` -> ``[T, D]`` (all-reduced over TP)."""
        t = o.shape[0]
        o = o.reshape(t, self.n_local_groups, -1)  # [T, G_local, (H/G) d]
        return self.wo_b(self.wo_a(o).flatten(1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]`` (the normed sub-layer input) at ``positions: [T]`` -> ``[T, D]``."""
        q, qr, rows = self.project(x, positions)
        index_q = index_w = None
        if self.indexer is not None:
            index_q, index_w = self.indexer.queries(qr, x, positions, self.rope)

        def sequence_fn(seq_rows: torch.Tensor, tokens: slice) -> torch.Tensor:
            return self.attend_sequence(
                q[tokens], positions[tokens], seq_rows,
                None if index_q is None else index_q[tokens],
                None if index_w is None else index_w[tokens],
            )

        o = torch.zeros_like(q)
        self.cache(rows, o, sequence_fn)  # profile / dummy runs leave o = 0
        return self.output(o)
