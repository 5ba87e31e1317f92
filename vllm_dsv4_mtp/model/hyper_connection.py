"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4: ``hc_pre``, Sinkhorn, ``hc_post``, ``hc_head``.

A DeepSeek-V4 token carries ``hc`` residual streams ``X: [T, hc, D]`` instead of one. Around each sub-layer
``F`` (attention, MoE) the streams are mixed by weights that are themselves computed from ``X``, all in
float32 whatever the activation dtype (the checkpoint stores the ``hc_*`` tensors in F32)::

    a    = (vec(X) @ fn^T) / rms(vec(X))      # [T, M], M = (2 + hc) * hc; one RMS over all hc*D values
    z    = a * scale[group] + base           # groups of columns: hc "pre" | hc "post" | hc*hc "comb"
    pre  = sigmoid(z_pre) + hc_eps           # [T, hc]     how much of each stream F reads
    post = 2 * sigmoid(z_post)               # [T, hc]     how much of F's output each stream receives
    comb = sinkhorn(z_comb as [hc, hc])      # [T, hc, hc] near doubly-stochastic stream-to-stream mixing
    u    = sum_i pre_i X_i                   # F's input [T, D], rounded once to the activation dtype
    X'_j = post_j F(u) + sum_i comb_ij X_i   # hc_post: float32 sum, rounded once to the activation dtype

``hc_head`` (the model's last step, and the MTP layer's) collapses the streams once more with only a
"pre" group (``fn: [hc, hc*D]``, ``scale: [1]``): no post, no Sinkhorn. The definition is DeepSeek-V4's
(https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/inference/model.py: ``Block.hc_pre``,
``Block.hc_post``, ``ParallelHead.hc_head``); the functions here restate it in one pass over ``a``.

These functions are the readable reference, and what the modules compute: through the implementation the CPU
kit hands them when they are built (``cpu/kit.py:CpuKit.mhc``: vLLM's fused CPU kernels for 16-bit streams where
this vLLM build has them, the same function within float32 rounding, ``tests/test_hyper_connection.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4_mtp.cpu.kit import KIT


def _mixing(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``a = (vec(X) @ fn^T) * rsqrt(mean(vec(X)^2) + eps)``: ``x: [T, hc, D]``, ``fn: [M, hc*D]`` -> ``[T, M]``
    float32. The RMS scales the ``M`` outputs, not the ``hc*D`` inputs: same value, fewer multiplies."""
    xf = x.flatten(1).float()
    return torch.mm(xf, fn.t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)


def _weighted_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_i w[t, i] X[t, i]``: ``w: [T, hc]`` float32, ``x: [T, hc, D]`` -> ``[T, D]`` in ``x.dtype``
    (float32 sum, one rounding)."""
    return torch.bmm(w.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)


def sinkhorn(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn projection of ``logits: [T, n, n]`` (float32) towards the doubly-stochastic matrices.

    ``C = softmax over each row + eps``, then ``2 * iters - 1`` alternating normalisations that divide by
    ``sum + eps``, starting and ending with the columns (sum over the first index): DeepSeek-V4's rounds are
    one column normalisation, then ``iters - 1`` (row, column) pairs. Returns ``[T, n, n]``: column sums
    ``s / (s + eps)`` (just under 1), row sums within the bound stated in ``tests/test_hyper_connection.py``.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn: iters must be >= 1 (hc_sinkhorn_iters), got {iters}")
    c = torch.softmax(logits, dim=-1).add_(eps)
    t, n, _ = c.shape
    # sum + eps in one op: baddbmm(eps, ones^T, C) = column sums [T, 1, n], baddbmm(eps, C, ones) = row sums
    # [T, n, 1]. The loop is 40 tiny ops per site at the default 20 iterations; this halves their count.
    ones_col = c.new_ones(1, n, 1).expand(t, n, 1)
    ones_row = ones_col.transpose(1, 2)
    eps_row = c.new_full((1, 1, 1), eps).expand(t, 1, n)
    eps_col = eps_row.transpose(1, 2)
    for step in range(2 * iters - 1):
        if step % 2 == 0:
            c.div_(torch.baddbmm(eps_row, ones_row, c))  # columns
        else:
            c.div_(torch.baddbmm(eps_col, c, ones_col))  # rows
    return c


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
    """One mHC site's input and mixing weights (torch reference; see the module docstring).

    Args:
        x: ``[T, hc, D]`` residual streams (activation dtype).
        fn: ``[(2 + hc) * hc, hc * D]``, ``base: [(2 + hc) * hc]``, ``scale: [3]`` float32 (pre, post, comb).

    Returns:
        ``u [T, D]`` (``x.dtype``), ``post [T, hc]`` float32, ``comb [T, hc, hc]`` float32 with ``comb[t, i, j]``
        the weight of input stream ``i`` in output stream ``j``.
    """
    t, hc, _ = x.shape
    a = _mixing(x, fn, norm_eps)
    gates = torch.sigmoid(torch.addcmul(base[: 2 * hc], a[:, : 2 * hc], scale[:2].repeat_interleave(hc)))
    pre = gates[:, :hc] + hc_eps
    post = gates[:, hc:] * 2.0
    comb_logits = torch.addcmul(base[2 * hc :], a[:, 2 * hc :], scale[2]).view(t, hc, hc)
    return _weighted_sum(pre, x), post, sinkhorn(comb_logits, iters=sinkhorn_iters, eps=hc_eps)


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``X'[:, j] = post_j * f + sum_i comb[:, i, j] * X[:, i]``.

    ``f: [T, D]``, ``x: [T, hc, D]``, ``post: [T, hc]``, ``comb: [T, hc, hc]`` (float32) -> ``[T, hc, D]`` in
    ``x.dtype``: summed in float32 and rounded once, as DeepSeek-V4's reference does.
    """
    spread = post.unsqueeze(-1) * f.float().unsqueeze(1)  # [T, hc, D]
    return torch.baddbmm(spread, comb.transpose(1, 2), x.float()).to(x.dtype)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse ``y = sum_i (sigmoid(a_i * scale + base_i) + hc_eps) X_i`` (torch reference).

    ``x: [T, hc, D]``, ``fn: [hc, hc * D]``, ``base: [hc]``, ``scale: [1]`` (float32) -> ``[T, D]`` in ``x.dtype``.
    """
    pre = torch.sigmoid(torch.addcmul(base, _mixing(x, fn, norm_eps), scale)) + hc_eps
    return _weighted_sum(pre, x)


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
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.mhc = KIT.mhc(hc_pre, hc_post, hc_head)

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [T, hc, D]`` -> ``(u [T, D], post [T, hc], comb [T, hc, hc])``; see :func:`hc_pre`."""
        kw = dict(sinkhorn_iters=self.sinkhorn_iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        return self.mhc.pre(x, self.fn, self.base, self.scale, **kw)

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``-> [T, hc, D]``; see :func:`hc_post`."""
        return self.mhc.post(f, x, post, comb)


class HyperHead(nn.Module):
    """The final stream collapse (``hc_head_fn [hc, hc*D]``, ``hc_head_base [hc]``, ``hc_head_scale [1]``)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.mhc = KIT.mhc(hc_pre, hc_post, hc_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, hc, D]`` -> ``[T, D]``; see :func:`hc_head`."""
        return self.mhc.head(x, self.fn, self.base, self.scale, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
