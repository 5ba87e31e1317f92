"""Softmax attention with a per-head sink logit, K = V (DeepSeek-V4's latent is key and value at once).

For a query ``q`` (one head) over key sets ``K_1 .. K_n`` (the window, the compressed entries, the C4 picks)
with a sink logit ``s``::

    o = sum_j exp(l_j) k_j / (sum_j exp(l_j) + exp(s)),   l_j = scale * q . k_j   (masked keys left out)

Each key set can be attended on its own, giving its normalised output ``o_i`` and log-sum-exp ``L_i``; the
sets then combine exactly: ``o = sum_i exp(L_i) o_i / (sum_i exp(L_i) + exp(s))``. With one set that is
``o_1 * sigmoid(L_1 - s)``.

On CPU every set runs through torch's fused flash-attention kernel (``aten::_scaled_dot_product_flash_
attention_for_cpu``, the kernel behind ``F.scaled_dot_product_attention`` on CPU; the one form that also returns
the log-sum-exp the sink needs): bfloat16 rows are read as they are stored, scores and softmax are float32,
and in bfloat16 the probabilities enter the value product in bfloat16, as in the GPU flash kernels. On other
devices, and as the reference the tests compare against, :func:`sink_attention_reference` computes the same
in plain float32 matmuls.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def additive_mask(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``masked`` bool (True = masked) -> the same shape in ``dtype``: 0 where visible, -inf where masked."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, NEG_INF)


def flash_lse(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One key set per batch row: ``q [N, M, H, d]`` over ``keys [N, K, d]`` (shared by the row's ``M``
    queries and ``H`` heads) with ``mask [N, M, K]`` additive (:func:`additive_mask`, ``q.dtype``) ->
    ``(o [N, M, H, d]`` in ``q.dtype``, ``lse [N, M, H]`` float32). A query whose keys are all masked gets
    ``o = 0`` and ``lse = 0`` from the kernel: callers mask such rows' ``lse`` themselves.

    The key set is one latent for every head, so the kernel sees one "head" whose ``M * H`` queries are the
    row's (query, head) pairs: one pass over the keys per row instead of one per head (less time for a verify
    window than heads over an expanded key tensor: docs/benchmarks.md).
    """
    n, m, h, d = q.shape
    k = keys.shape[1]
    if m == 1:
        mask = mask.unsqueeze(1).expand(n, 1, h, k)
    else:
        mask = mask.unsqueeze(2).expand(n, m, h, k).reshape(n, 1, m * h, k)
    kv = keys.unsqueeze(1)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(n, 1, m * h, d), kv, kv, attn_mask=mask, scale=scale
    )
    return o.view(n, m, h, d), lse.view(n, m, h)


def combine_with_sink(
    parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Key sets' ``(o [..., H, d], lse [..., H])`` and the sink logits ``sink [H]`` -> ``[..., H, d]`` in
    ``dtype`` (computed in float32)."""
    sink = sink.float()
    if len(parts) == 1:
        o, lse = parts[0]
        return (o.float() * torch.sigmoid(lse - sink).unsqueeze(-1)).to(dtype)
    top = sink.expand_as(parts[0][1])
    for _, lse in parts:
        top = torch.maximum(top, lse)
    weights = [torch.exp(lse - top) for _, lse in parts]
    denom = torch.exp(sink - top)
    for w in weights:
        denom = denom + w
    out = None
    for (o, _), w in zip(parts, weights):
        term = o.float() * (w / denom).unsqueeze(-1)
        out = term if out is None else out.add_(term)
    return out.to(dtype)


def sink_attention(
    q: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    per_query: tuple[torch.Tensor, torch.Tensor] | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q [B, S, H, d]`` (``B`` segments of ``S`` queries) over ``shared = (keys [B, K, d], mask [B, S, K])``
    (keys every query of a segment may see; ``mask`` additive in ``q.dtype``, :func:`additive_mask`) and
    optionally ``per_query = (keys [B, S, k, d], masked [B, S, k] bool)`` (one key set per query: the C4
    picks; True = masked); ``sink [H]`` float32 -> ``[B, S, H, d]`` in ``q.dtype``."""
    keys, mask = shared
    if q.device.type != "cpu":
        parts = [(keys, mask.isneginf())] + ([] if per_query is None else [per_query])
        return sink_attention_reference(q, parts, sink, scale)
    parts = [flash_lse(q, keys, mask, scale)]
    if per_query is not None:
        b, s, h, d = q.shape
        pkeys, pmasked = per_query
        k = pkeys.shape[2]
        o, lse = flash_lse(
            q.reshape(b * s, 1, h, d),
            pkeys.reshape(b * s, k, d),
            additive_mask(pmasked.reshape(b * s, 1, k), q.dtype),
            scale,
        )
        # a query with no visible pick: its set contributes nothing (the kernel reports lse = 0 for it)
        lse = lse.view(b, s, h).masked_fill(pmasked.all(dim=-1, keepdim=True), NEG_INF)
        parts.append((o.reshape(b, s, h, d), lse))
    return combine_with_sink(parts, sink, q.dtype)


def sink_attention_reference(
    q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same function in float32 matmuls over concatenated logits: ``parts`` are ``(keys, masked)`` with
    ``keys`` either ``[B, K, d]`` (shared by a segment's queries) or ``[B, S, k, d]`` (one set per query)."""
    b, s, h, d = q.shape
    qf = q.float()
    keys = [k.float() for k, _ in parts]
    logits = [
        torch.bmm(qf.reshape(b, s * h, d), k.transpose(1, 2)).view(b, s, h, -1)
        if k.dim() == 3
        else torch.matmul(qf, k.transpose(-1, -2))
        for k in keys
    ]
    sizes = [x.shape[-1] for x in logits]
    masked = torch.cat([m for _, m in parts], dim=-1)
    logits = torch.cat(logits, dim=-1).mul_(scale).masked_fill_(masked.unsqueeze(2), NEG_INF)
    # the sink is one more logit per head whose value carries nothing: softmax over [logits | sink]
    logits = torch.cat([logits, sink.float().view(1, 1, h, 1).expand(b, s, h, 1)], dim=-1)
    p = torch.softmax(logits, dim=-1).split([*sizes, 1], dim=-1)
    out = None
    for pi, k in zip(p, keys):
        oi = torch.bmm(pi.reshape(b, s * h, -1), k).view(b, s, h, d) if k.dim() == 3 else torch.matmul(pi, k)
        out = oi if out is None else out.add_(oi)
    return out.to(q.dtype)
