"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing ``rope_dim`` channels.

* Pairs are ``(2i, 2i+1)`` (GPT-J style) over the **last** ``qk_rope_head_dim`` (64) channels of a head;
  the leading "nope" channels are untouched.
* Sliding-window layers (and the MTP layer) use ``rope_theta`` without scaling; compressed layers (C4, C128)
  use ``compress_rope_theta`` with YaRN frequency interpolation and **no** attention factor (mscale 0).
* One rope serves a whole layer: queries, window kv, compressed entries (at position ``ratio * j``) and the
  indexer. The attention output is rotated back by the inverse rotation at the query position.

cos/sin are computed on the fly from ``positions * inv_freq`` in float32 (no table up to
``max_position_embeddings``, which is 1M for the real models). The YaRN ramp uses vLLM's public helpers.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.rotary_embedding.common import yarn_find_correction_range, yarn_linear_ramp_mask

from vllm_dsv4_mtp.config import DeepseekV4Spec


def rope_inv_freq(rope_dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` (float32); YaRN-interpolated when ``yarn`` is given.

    ``yarn`` keys (the checkpoint's ``rope_scaling``): ``factor``, ``original_max_position_embeddings``,
    ``beta_fast`` (32), ``beta_slow`` (1).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if not yarn:
        return inv_freq
    factor = float(yarn["factor"])
    low, high = yarn_find_correction_range(
        yarn.get("beta_fast") or 32,
        yarn.get("beta_slow") or 1,
        rope_dim,
        theta,
        yarn["original_max_position_embeddings"],
        truncate=yarn.get("truncate", True),
    )
    # extrapolation weight is 1 for high-frequency pairs (kept), 0 for low-frequency ones (interpolated)
    keep = 1.0 - yarn_linear_ramp_mask(low, high, rope_dim // 2, torch.float32)
    return (inv_freq / factor) * (1.0 - keep) + inv_freq * keep


class DeepseekV4Rope(nn.Module):
    """Interleaved partial rotary embedding of one layer (``rope_dim`` trailing channels).

    The rotation of pair ``(2i, 2i+1)`` at position ``p`` is the complex factor ``exp(i p f_i)`` (float32):
    :meth:`rotation` computes those factors once for a set of positions (a layer shares them across its
    queries, keys and output), :meth:`apply_` multiplies by them.
    """

    def __init__(self, rope_dim: int, theta: float, yarn: dict | None = None):
        super().__init__()
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, theta, yarn), persistent=False)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions: [N]`` -> complex64 ``[N, rope_dim // 2]`` factors ``exp(i p f)``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        return torch.complex(freqs.cos(), freqs.sin())

    def apply_(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """Rotate, in place, the last ``rope_dim`` channels of ``x: [N, ..., C]`` by ``rot: [N, rope_dim // 2]``
        (computed in float32, stored in ``x.dtype``); returns ``x``."""
        extra = x.dim() - 2  # broadcast over head dims between N and C
        rot = rot.view(rot.shape[0], *([1] * extra), rot.shape[-1])
        part = x[..., -self.rope_dim :]
        pairs = torch.view_as_complex(part.float().unflatten(-1, (-1, 2)))
        part.copy_(torch.view_as_real(pairs * rot).flatten(-2))
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` channels of ``x: [N, ..., C]`` at ``positions: [N]``.

        Computed in float32, returned in ``x.dtype``; ``inverse=True`` applies the conjugate rotation.
        """
        rot = self.rotation(positions)
        return self.apply_(x.clone(), rot.conj_physical() if inverse else rot)


def layer_rope(spec: DeepseekV4Spec, compress_ratio: int) -> DeepseekV4Rope:
    """The rope of a layer: plain ``rope_theta`` for SWA (ratio 0/1), YaRN ``compress_rope_theta`` otherwise
    (the validated spec's ``rope_scaling``: a YaRN dict, or None for plain rope on every layer)."""
    if compress_ratio > 1:
        return DeepseekV4Rope(spec.qk_rope_head_dim, spec.compress_rope_theta, spec.rope_scaling)
    return DeepseekV4Rope(spec.qk_rope_head_dim, spec.rope_theta, None)
