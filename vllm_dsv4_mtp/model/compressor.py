"""KV compressor of the compressed layers: C4 (overlapping blocks) and C128 (disjoint blocks).

Per token the compressor projects ``c = wkv(x)`` and ``z = wgate(x)`` (``blocks_per_entry * hd`` channels
each: an overlapping C4 entry reads 2 blocks, so ``blocks_per_entry = 2``; 1 otherwise). A complete block
``j`` of ``ratio`` tokens becomes one entry, the softmax-gated (over tokens, per channel; ``z + ape`` as logits) sum
of the ``c`` rows:

* ratio 128 (disjoint): block ``j`` = tokens ``[128 j, 128 j + 128)``;
* ratio 4 (overlapping): block ``j`` mixes ``2 * ratio`` rows, the previous block's tokens through the first
  ``hd`` channels and its own tokens through the last ``hd`` channels (block 0 has no previous half).

The entry is RMS-normalised (``norm.weight``) and rotated at position ``ratio * j``. An entry exists only
once its block is complete; a query at position ``t`` sees entries ``j < (t + 1) // ratio``.

The portable attention keeps ``[c | z]`` per token in the paged KV cache; the backend gathers a block's rows
once, in the step that writes its last token, :meth:`Compressor.forward` pools them, and the backend stores the
entry in that token's row (``attention/rows.py``). Also used, at ``hd = index_head_dim``, by the lightning
indexer.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear

from vllm_dsv4_mtp.config.spec import OVERLAP_RATIO, blocks_per_entry
from vllm_dsv4_mtp.cpu.linear import prepared_linear
from vllm_dsv4_mtp.cpu.norm import rms_norm
from vllm_dsv4_mtp.model.rope import DeepseekV4Rope


def pool_gathered(
    kv_gate: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor, *, ratio: int, head_dim: int
) -> torch.Tensor:
    """Gated pooling of ``M`` completed blocks from their gathered rows (before norm and rope).

    Args:
        kv_gate: ``[M, span, 2 * blocks_per_entry * head_dim]`` per-token ``[c | z]`` rows ending at each
            block's last token (``span = blocks_per_entry * ratio``: with overlap, the previous block's rows
            then the block's own).
        valid: ``[M, span, 1]`` bool, False for rows before position 0 (block 0's previous half).
        ape: ``[ratio, blocks_per_entry * head_dim]`` float32 position bias added to ``z``.

    Returns:
        ``[M, head_dim]`` pooled entries in ``kv_gate.dtype`` (softmax weights in float32, cast to the activation
        dtype before the weighted sum, as the reference does).
    """
    width = blocks_per_entry(ratio) * head_dim
    c, z = kv_gate[..., :width], kv_gate[..., width:].float()
    if ratio == OVERLAP_RATIO:
        # rows [0, ratio): previous block, first half of the channels; rows [ratio, 2 ratio): this block,
        # second half; ape by the row's place in its own block
        c = torch.cat([c[:, :ratio, :head_dim], c[:, ratio:, head_dim:]], dim=1)
        z = torch.cat([z[:, :ratio, :head_dim], z[:, ratio:, head_dim:]], dim=1)
        ape = torch.cat([ape[:, :head_dim], ape[:, head_dim:]], dim=0)
    z = (z + ape.float()).masked_fill(~valid, float("-inf"))  # weight 0 for rows before position 0
    c = c.masked_fill(~valid, 0)
    weights = torch.softmax(z, dim=1).to(c.dtype)
    return (c * weights).sum(dim=1)


class Compressor(nn.Module):
    """Parameters and maths of one compressor (native ``...compressor.{wkv, wgate, ape, norm}``).

    ``wkv`` and ``wgate`` are stacked into one replicated GEMM ``fused_wkv_wgate`` (output ``[c | z]``).
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, norm_eps: float, rope: DeepseekV4Rope, prefix: str):
        super().__init__()
        self.rope = rope  # the layer's
        self.ratio = ratio
        self.head_dim = head_dim
        self.blocks_per_entry = blocks_per_entry(ratio)
        width = self.blocks_per_entry * head_dim
        self.row_width = 2 * width  # [c | z] per token
        self.fused_wkv_wgate = prepared_linear(
            MergedColumnParallelLinear(
                hidden_size,
                [width, width],
                bias=False,
                prefix=f"{prefix}.fused_wkv_wgate",
                disable_tp=True,
                return_bias=False,
            )
        )
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, eps=norm_eps)

    def forward(self, rows: torch.Tensor, valid: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
        """Entries of ``M`` completed blocks from their rows ``[M, span, row_width]`` (``valid [M, span, 1]``) ->
        ``[M, head_dim]``, normed and roped at ``block_pos [M]``."""
        pooled = pool_gathered(rows, valid, self.ape, ratio=self.ratio, head_dim=self.head_dim)
        return self.rope.apply_(rms_norm(pooled, self.norm), self.rope.rotation(block_pos))
