"""Manifold-constrained hyper-connections (mHC): ``hc_pre``, ``hc_post`` and ``hc_head``.

DeepSeek-V4 carries ``hc_mult`` residual streams per token, ``X: [T, hc, D]``. Each sub-layer (attention,
MoE) reads one collapsed input ``u = sum_i pre_i X_i`` and writes back ``X' = post (x) F(u) + comb^T X``,
where ``pre``, ``post`` and ``comb`` are computed from ``X`` itself by a one-layer perceptron over the
RMS-normalised flattened streams; ``comb`` is projected towards a doubly-stochastic matrix by Sinkhorn.
The final ``hc_head`` collapses the streams once more (no Sinkhorn, no post) before the final norm.

All mixing weights are computed in float32 (the checkpoint stores ``hc_*`` tensors in F32), whatever
the activation dtype. See docs ``dsv4-architecture.md`` section 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim, in float32. ``x: [..., N] -> [..., N]`` float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for one sub-layer and compute the weights to expand its output.

    Args:
        x: ``[T, hc, D]`` residual streams (activation dtype).
        fn: ``[(2 + hc) * hc, hc * D]`` float32 mixing projection.
        base: ``[(2 + hc) * hc]`` float32 bias; ``scale``: ``[3]`` float32 (pre, post, comb).

    Returns:
        ``u [T, D]`` (activation dtype), ``post [T, hc]`` float32, ``comb [T, hc, hc]`` float32 indexed
        ``comb[t, i, j]`` = weight of input stream ``i`` in output stream ``j``.
    """
    hc = x.shape[-2]
    mixes = F.linear(_rms_normalize(x.flatten(-2), norm_eps), fn.float())  # [T, (2+hc)*hc]
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * scale[1] + post_b)
    comb_logits = comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc)
    comb = sinkhorn(comb_logits, iters=sinkhorn_iters, eps=hc_eps)
    u = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return u, post, comb


def sinkhorn(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then alternate column/row normalisation; ends on a column normalisation.

    ``logits: [..., hc, hc]`` float32 -> same shape, approximately doubly stochastic.
    """
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sub-layer output back to the streams: ``X'[:, j] = post_j * f + sum_i comb[i, j] X_i``.

    ``f: [T, D]``, ``x: [T, hc, D]``, ``post: [T, hc]``, ``comb: [T, hc, hc]`` -> ``[T, hc, D]`` in
    ``x.dtype`` (the weights are cast to the activation dtype first, as the reference does).
    """
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the streams: ``y = sum_i (sigmoid(m_i * scale + base_i) + eps) X_i``.

    ``x: [T, hc, D]``, ``fn: [hc, hc * D]``, ``base: [hc]``, ``scale: [1]`` -> ``[T, D]`` in ``x.dtype``.
    """
    mixes = F.linear(_rms_normalize(x.flatten(-2), norm_eps), fn.float())  # [T, hc]
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


class HyperConnection(nn.Module):
    """One mHC site (``attn`` or ``ffn``) of a block: parameters ``fn``, ``base``, ``scale`` (float32).

    Native names: ``layers.N.hc_{site}_fn / _base / _scale``.
    """

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mix, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(mix, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [T, hc, D]`` -> ``(u [T, D], post [T, hc], comb [T, hc, hc])``; see :func:`hc_pre`."""
        return hc_pre(
            x, self.fn, self.base, self.scale,
            sinkhorn_iters=self.sinkhorn_iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps,
        )

    @staticmethod
    def post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """See :func:`hc_post`."""
        return hc_post(f, x, post, comb)


class HyperHead(nn.Module):
    """The final stream collapse (``hc_head_fn [hc, hc*D]``, ``hc_head_base [hc]``, ``hc_head_scale [1]``)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, hc, D]`` -> ``[T, D]``."""
        return hc_head(x, self.fn, self.base, self.scale, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
