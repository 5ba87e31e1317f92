"""The routed experts' fast implementation, below the model: ``E`` SwiGLU experts' GEMMs packed once after loading,
and a step's routed sum computed the cheaper of two ways for its size, chosen here.

    y[t] = sum_j weights[t, j] * w2_e( act( w13_e x[t] ) ),   e = ids[t, j] on this rank        (``act``: the
                                                                    model's SwiGLU, and its rounding under W4A4)

* **grouped**, any step: the ``T k`` picks sorted by expert once (``bincount`` gives each expert's run of rows);
  every expert that was hit runs its two GEMMs once on its contiguous rows, ``act`` once over all of them (one
  call for the step, not one per expert). Each token's terms are added in expert order, in float32 (float64
  where the experts' parts are float64: a float32 model, ``model/split_sums.py``).
* **all experts**, few tokens of small experts (:func:`all_experts_pay`): ``w13`` of every expert as one GEMM
  over every token; ``act`` on the routed rows only, each scaled by its routing weight, put back into zeros; then
  ``w2`` of every expert as one GEMM over those rows, whose sum over its inputs is the sum over the experts. No
  sort and no per-expert call: the embedded model's MoE (8 experts of 128 x 128) takes it for decode steps, where
  per-call costs outweigh computing every expert (docs/benchmarks.md). It rounds each scaled row to ``x.dtype``
  where the grouped way rounds each expert's output: the same bound. DeepSeek-V4's own experts never take it.

Every GEMM is one dispatched linear (``cpu/linear.py``); ``down`` makes the ``w2`` ones (the model's choice of a
float64 GEMM for float32 models).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_dsv4_mtp.cpu.linear import Linear, dispatched_linear, slice_linears

# The all-experts way while its GEMMs cost at most this many multiply-adds: ~85 tokens of the embedded model's
# MoE (8 experts of 128 x 128), short of where the grouped way was measured to overtake it (docs/benchmarks.md).
ALL_EXPERTS_MACS = 1 << 25


def all_experts_pay(tokens: int, experts: int, intermediate: int, hidden: int) -> bool:
    """Whether every one of ``experts`` SwiGLU experts (``intermediate x hidden``) over all ``tokens`` tokens costs
    less than the grouped way: their GEMMs within :data:`ALL_EXPERTS_MACS` multiply-adds."""
    return tokens * experts * 3 * intermediate * hidden <= ALL_EXPERTS_MACS


class PackedExperts:
    """A rank's ``E`` experts, ``w13: [E, 2 I, D]`` (``[w1; w3]`` rows) and ``w2: [E, D, I]``, packed: one linear
    per expert and GEMM, and for experts small enough (:func:`all_experts_pay` at one token) every expert's side by
    side as one more pair (their bytes once more). ``first``: the global id of expert 0; ``num_experts``: the
    experts of all ranks; ``out_dtype``: the dtype of a rank's part (``down``'s)."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        first: int,
        num_experts: int,
        out_dtype: torch.dtype,
        down: Callable[[torch.Tensor], Linear] = dispatched_linear,
    ):
        n, two_i, d = w13.shape
        self.n, self.i, self.first, self.out_dtype = n, two_i // 2, first, out_dtype
        self.elsewhere = n < num_experts  # expert parallel: some picks are other ranks'
        self.up = slice_linears(w13)
        self.down = [down(w) for w in w2]
        self.all: tuple[Linear, Linear] | None = None
        if all_experts_pay(1, n, self.i, d):
            self.all = (dispatched_linear(w13.reshape(n * two_i, d)), down(w2.permute(1, 0, 2).reshape(d, n * self.i)))

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``x: [T, D]`` (already rounded where the experts' GEMMs want it), ``weights: [T, k]`` float32, ``ids:
        [T, k]`` global expert ids, ``act: [A, 2 I] -> [A, I]`` -> this rank's part of the routed sum ``[T, D]``
        in ``out_dtype``."""
        t = ids.shape[0]
        local = ids - self.first if self.first else ids  # read only below
        if self.all is not None and t > 0 and all_experts_pay(t, self.n, self.i, x.shape[-1]):
            return self._all_experts(x, weights, local, act)
        return self._grouped(x, weights, local, act)

    def _grouped(
        self, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        t, k = local.shape
        expert = local.reshape(-1)
        token = torch.arange(t * k, device=x.device) // k
        weight = weights.reshape(-1)
        if self.elsewhere:
            keep = ((expert >= 0) & (expert < self.n)).nonzero().squeeze(-1)
            expert, token, weight = expert[keep], token[keep], weight[keep]
        out = torch.zeros(t, x.shape[-1], dtype=torch.promote_types(self.out_dtype, torch.float32), device=x.device)
        if not expert.numel():
            return out.to(self.out_dtype)
        order = torch.argsort(expert, stable=True)
        token, weight = token[order], weight[order]
        runs, start = [], 0
        for e, count in enumerate(torch.bincount(expert, minlength=self.n).tolist()):
            if count:
                runs.append((e, slice(start, start + count)))
                start += count
        xs = x[token]
        h = act(torch.cat([self.up[e](xs[rows]) for e, rows in runs]))
        y = torch.cat([self.down[e](h[rows]) for e, rows in runs])
        return out.index_add_(0, token, y.to(out.dtype) * weight.unsqueeze(-1)).to(self.out_dtype)

    def _all_experts(
        self, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``act`` (~5 elementwise ops, ~20 under W4A4: most of the pass's cost) runs on the ``T k`` routed rows
        only, so an expert no token picked cannot reach the sum (not even as ``0 * inf``); ``index_add_``: a token
        that picked one expert twice (a hash table may) gets both rows, as in the grouped way."""
        t, n, i = local.shape[0], self.n, self.i
        # a float32 model's parts are float64 (model/split_sums.py): its scaled rows stay float64 into the float64
        # ``w2``, so that this way and the grouped one differ by float64 roundings only, whichever way a rank's
        # slice takes (tensor parallelism halves a rank's GEMMs, and so moves where this way pays)
        wide = self.out_dtype == torch.float64
        acc = torch.float64 if wide else torch.float32
        scale = weights.to(acc)  # weights itself where already that dtype: never written below
        mine = None
        if self.elsewhere:  # other ranks' picks read expert 0, then 0
            mine = (local >= 0) & (local < n)
            local = local.where(mine, 0)
        rows = (local + torch.arange(0, t * n, n, device=x.device).unsqueeze(1)).reshape(-1)  # of h [T n, 2 I]
        h = self.all[0](x).view(t * n, 2 * i)
        a = act(h.index_select(0, rows)).to(acc).mul_(scale.reshape(-1, 1))
        if mine is not None:
            a.masked_fill_(~mine.reshape(-1, 1), 0.0)
        down_dtype = acc if wide else x.dtype
        down_in = torch.zeros(t * n, i, dtype=down_dtype, device=x.device).index_add_(0, rows, a.to(down_dtype))
        return self.all[1](down_in.view(t, n * i))
