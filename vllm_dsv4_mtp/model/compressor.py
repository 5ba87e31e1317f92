"""KV compressor of the compressed layers: C4 (overlapping blocks) and C128 (disjoint blocks).

Per token the compressor projects ``c = wkv(x)`` and ``z = wgate(x)`` (``coff * hd`` channels each, with
``coff = 2`` for overlapping C4 and 1 otherwise). A complete block ``j`` of ``ratio`` tokens becomes one
entry, the softmax-gated (over tokens, per channel; ``z + ape`` as logits) sum of the ``c`` rows:

* ratio 128 (disjoint): block ``j`` = tokens ``[128 j, 128 j + 128)``;
* ratio 4 (overlapping): block ``j`` mixes ``2 * ratio`` rows, the previous block's tokens through the first
  ``hd`` channels and its own tokens through the last ``hd`` channels (block 0 has no previous half).

The entry is RMS-normalised (``norm.weight``) and rotated at position ``ratio * j``. An entry exists only
once its block is complete; a query at position ``t`` sees entries ``j < (t + 1) // ratio``.

The portable attention core keeps ``[c | z]`` per token in the paged KV cache and calls :meth:`pool` over
a whole sequence's rows, so no partial-block state lives outside the cache (see
``kernels/attention_core.py``). Also used, at ``hd = index_head_dim``, by the lightning indexer.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear

from vllm_dsv4_mtp.model.rope import DeepseekV4Rope


def pool_blocks(
    cz: torch.Tensor, ape: torch.Tensor, *, ratio: int, head_dim: int, overlap: bool
) -> torch.Tensor:
    """Gated pooling of every complete block of a sequence (before norm and rope).

    Args:
        cz: ``[L, 2 * coff * head_dim]`` per-token ``[c | z]`` rows of positions ``0 .. L-1``.
        ape: ``[ratio, coff * head_dim]`` float32 position bias added to ``z``.

    Returns:
        ``[L // ratio, head_dim]`` pooled entries in ``cz.dtype`` (softmax weights in float32, cast to the
        activation dtype before the weighted sum, as the reference does).
    """
    coff = 2 if overlap else 1
    width = coff * head_dim
    n = cz.shape[0] // ratio
    c = cz[: n * ratio, :width].reshape(n, ratio, width)
    z = cz[: n * ratio, width:].reshape(n, ratio, width).float() + ape.float()
    if overlap:
        # rows [0, ratio): previous block, first half of the channels; rows [ratio, 2 ratio): this block,
        # second half. Block 0's previous half is empty: c = 0, z = -inf (softmax weight 0).
        prev_c = c.new_zeros(n, ratio, head_dim)
        prev_z = z.new_full((n, ratio, head_dim), float("-inf"))
        prev_c[1:] = c[:-1, :, :head_dim]
        prev_z[1:] = z[:-1, :, :head_dim]
        c = torch.cat([prev_c, c[..., head_dim:]], dim=1)
        z = torch.cat([prev_z, z[..., head_dim:]], dim=1)
    weights = torch.softmax(z, dim=1).to(c.dtype)
    return (c * weights).sum(dim=1)


class Compressor(nn.Module):
    """Parameters and maths of one compressor (native ``...compressor.{wkv, wgate, ape, norm}``).

    ``wkv`` and ``wgate`` are stacked into one replicated GEMM ``fused_wkv_wgate`` (output ``[c | z]``).
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, norm_eps: float, prefix: str):
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.row_width = 2 * coff * head_dim  # [c | z] per token
        self.fused_wkv_wgate = MergedColumnParallelLinear(
            hidden_size, [coff * head_dim, coff * head_dim], bias=False, quant_config=None,
            prefix=f"{prefix}.fused_wkv_wgate", disable_tp=True, return_bias=False,
        )
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, eps=norm_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]`` -> ``[T, row_width]`` rows ``[c | z]`` to store per token."""
        return self.fused_wkv_wgate(x)

    def entries(self, cz: torch.Tensor, rope: DeepseekV4Rope) -> torch.Tensor:
        """All complete entries of one sequence: ``cz: [L, row_width]`` -> ``[L // ratio, head_dim]``."""
        pooled = pool_blocks(cz, self.ape, ratio=self.ratio, head_dim=self.head_dim, overlap=self.overlap)
        pooled = self.norm(pooled)
        positions = torch.arange(pooled.shape[0], device=cz.device) * self.ratio
        return rope(pooled, positions)
