"""Lightning indexer of the C4 layers: picks, per query, the top-``index_topk`` compressed entries.

``qI = wq_b(qr)`` (``[T, nI, dI]``, rope at the query position), ``w = weights_proj(x) * nI^-0.5`` and the
indexer's own C4 compressor (``hd = dI``) produce keys ``KI [n, dI]``; the score of entry ``j`` for query
``t`` is ``sum_h relu(qI[t,h] . KI[j]) * dI^-0.5 * w[t,h]``, restricted to entries that are complete
(``j < (t + 1) // 4``). Picks beyond the causal limit (too few ready entries) are returned as ``-1``.

The reference also rotates ``qI`` and ``KI`` by a Hadamard matrix and fake-quantises them to FP4 (QAT);
the rotation is orthonormal, so the dot products are unchanged, and the FP4 rounding is not applied here
(nor by HF transformers, the project's oracle): this computes the exact-arithmetic scores.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from vllm_dsv4_mtp.model.compressor import Compressor
from vllm_dsv4_mtp.model.rope import DeepseekV4Rope


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *, ratio: int, topk: int
) -> torch.Tensor:
    """Top-k entry indices per query.

    Args:
        q: ``[T, nI, dI]`` rotated indexer queries; ``weights``: ``[T, nI]`` float32 (already scaled by nI^-0.5).
        keys: ``[n, dI]`` indexer entries of the sequence; ``positions``: ``[T]`` query positions.

    Returns:
        ``[T, min(topk, n)]`` int64 entry indices, ``-1`` where the pick is not visible to the query.
    """
    n = keys.shape[0]
    k = min(topk, n)
    if k == 0:
        return torch.empty(q.shape[0], 0, dtype=torch.int64, device=q.device)
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu_() * scale
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, n]
    limit = ((positions + 1) // ratio).unsqueeze(-1)  # [T, 1] number of visible entries
    entry = torch.arange(n, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(entry >= limit, float("-inf"))
    # stable sort: among equal scores (e.g. all heads ReLU'd to 0) the lowest entry index wins, so the picks
    # do not depend on how queries are batched (prefill vs chunked prefill vs decode)
    picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(picks >= limit, torch.full_like(picks, -1), picks)


class Indexer(nn.Module):
    """Native ``layers.N.attn.indexer.{wq_b, weights_proj, compressor.*}``."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, norm_eps: float, prefix: str
    ):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.topk = topk
        self.ratio = 4
        self.wq_b = ReplicatedLinear(
            q_lora_rank, n_heads * head_dim, bias=False, quant_config=None, prefix=f"{prefix}.wq_b", return_bias=False
        )
        self.weights_proj = ReplicatedLinear(
            hidden_size, n_heads, bias=False, quant_config=None, prefix=f"{prefix}.weights_proj", return_bias=False
        )
        self.compressor = Compressor(hidden_size, head_dim, self.ratio, norm_eps, prefix=f"{prefix}.compressor")

    def queries(
        self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rope: DeepseekV4Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qr: [T, q_lora]``, ``x: [T, D]`` -> ``(qI [T, nI, dI], w [T, nI] float32)``."""
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = rope(q, positions)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def select(
        self, q: torch.Tensor, w: torch.Tensor, cz: torch.Tensor, positions: torch.Tensor, rope: DeepseekV4Rope
    ) -> torch.Tensor:
        """Entry picks for the queries of one sequence whose indexer rows ``[c | z]`` are ``cz: [L, ...]``."""
        keys = self.compressor.entries(cz, rope)
        return indexer_topk(q, w, keys, positions, ratio=self.ratio, topk=self.topk)
