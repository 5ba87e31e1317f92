"""Lightning indexer of the C4 layers: picks, per query, the top-``index_topk`` compressed entries.

``qI = wq_b(qr)`` (``[T, nI, dI]``, rope at the query position), ``w = weights_proj(x) * nI^-0.5`` and the
indexer's own C4 compressor (``hd = dI``) produce keys ``KI [n, dI]``; the score of entry ``j`` for query
``t`` is ``sum_h relu(qI[t,h] . KI[j]) * dI^-0.5 * w[t,h]``, restricted to entries that are complete
(``j < (t + 1) // 4``). Picks beyond the causal limit (too few ready entries) are flagged invalid. The keys
are made once per block (the indexer's compressor, in the block's completing row of the paged cache; see
``attention/rows.py``) and gathered per segment of queries.

The reference also rotates ``qI`` and ``KI`` by a Hadamard matrix and fake-quantises them to FP4 (QAT);
the rotation is orthonormal, so the dot products are unchanged, and the FP4 rounding is not applied here
(nor by HF transformers, the project's oracle): this computes the exact-arithmetic scores.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO
from vllm_dsv4_mtp.cpu.linear import prepared_linear
from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.rope import DeepseekV4Rope


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    masked: torch.Tensor,
    limit: torch.Tensor,
    *,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k entry indices per query, for ``B`` segments of ``S`` queries over ``n`` candidate entries each.

    Args:
        q: ``[B, S, nI, dI]`` roped indexer queries; ``weights``: ``[B, S, nI]`` float32 (scaled by nI^-0.5).
        keys: ``[B, n, dI]`` indexer keys of each segment's sequence (entries ``0 .. n-1``, padded).
        masked: ``[B, S, n]`` bool, True where entry ``j`` is not complete for the query (``j >= limit``).
        limit: ``[B, S, 1]`` int64 number of entries complete for each query.

    Returns:
        ``picks [B, S, min(topk, n)]`` int64 entry indices and ``unseen`` (same shape, bool: True where the
        pick lies beyond its query's causal limit, i.e. is not a pick).
    """
    n = keys.shape[1]
    k = min(topk, n)
    scale = q.shape[-1] ** -0.5
    b, s, heads, dim = q.shape
    scores = torch.bmm(q.float().view(b, s * heads, dim), keys.float().transpose(1, 2)).view(b, s, heads, n)
    scores = scores.relu_() * scale
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill_(masked, float("-inf"))  # [B, S, n]
    picks = top_entries(scores, k)
    return picks, picks >= limit


# from this many scores in a call, top-k over int64 keys is faster than sorting every query's scores; below, the
# sort is faster (on CPU: docs/benchmarks.md)
KEYED_TOPK_FROM = 1 << 13


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the ``k`` largest of ``scores [..., n]`` (float32), highest first; among equal
    scores (e.g. all heads ReLU'd to 0) the lowest index first, as a stable descending sort orders them, so
    the picks do not depend on how queries are batched (prefill vs chunked prefill vs decode). NaN (only from
    a non-finite input) ranks above everything, as in the sort.

    Large calls take top-k over unique int64 keys: the score's bits in an order-preserving integer form, then
    the index reversed (so the lower index is the larger key on a tie): the same order, no full sort."""
    if scores.numel() < KEYED_TOPK_FROM:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    n = scores.shape[-1]
    # + 0.0: -0.0 ties with +0.0, as in the sort; every NaN made the positive one (x86's inf - inf is negative)
    scores = (scores + 0.0).masked_fill_(scores.isnan(), float("nan"))
    bits = scores.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # negative floats: magnitude bits flipped
    keys = (ordered << 32) | torch.arange(n - 1, -1, -1, device=scores.device)
    return (n - 1) - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)


class Indexer(nn.Module):
    """Native ``layers.N.attn.indexer.{wq_b, weights_proj, compressor.*}``."""

    def __init__(self, spec: DeepseekV4Spec, rope: DeepseekV4Rope, prefix: str):
        super().__init__()
        self.rope = rope  # the layer's
        self.n_heads, self.head_dim, self.topk = spec.index_n_heads, spec.index_head_dim, spec.index_topk
        self.ratio = OVERLAP_RATIO
        self.wq_b = prepared_linear(
            ReplicatedLinear(
                spec.q_lora_rank, self.n_heads * self.head_dim, bias=False, prefix=f"{prefix}.wq_b", return_bias=False
            )
        )
        self.weights_proj = prepared_linear(
            ReplicatedLinear(
                spec.hidden_size, self.n_heads, bias=False, prefix=f"{prefix}.weights_proj", return_bias=False
            )
        )
        self.compressor = Compressor(
            spec.hidden_size, self.head_dim, self.ratio, spec.rms_norm_eps, rope, prefix=f"{prefix}.compressor"
        )

    def queries(self, qr: torch.Tensor, x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``qr: [T, q_lora]``, ``x: [T, D]``, ``rot``: the tokens' rotations -> ``(qI [T, nI, dI], w [T, nI]
        float32)``."""
        q = self.rope.apply_(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), rot)
        return q, self.weights_proj(x).float() * self.n_heads**-0.5

    def select(self, q, weights, keys, masked, limit) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`indexer_topk` with this indexer's ``index_topk``."""
        return indexer_topk(q, weights, keys, masked, limit, topk=self.topk)
