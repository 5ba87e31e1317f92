"""The portable routed experts of a DeepSeek-V4 MoE layer, BF16 or OCP MXFP4 (W4A4 emulated).

Weights are dense in the model dtype: a checkpoint's MXFP4 / FP4 / FP8 experts are decoded once, exactly, at
load (``vllm_dsv4_mtp.formats.dequant``), which costs ``16 / 4.25 = 3.8x`` the packed bytes in BF16 (the
embedded model's 4 x 8 experts: 1.6 MB instead of 0.4 MB) and saves a decode of every hit expert at every
step. What the Quark W4A4 scheme adds at run time is kept: each GEMM's input is rounded to MXFP4 (dynamic,
groups of 32 along K: ``mxfp4.fake_quant``, through its compiled loop ``cpu/mxfp4_round.py`` on CPU) when
``activation_quant`` is set.

Parameters use the names and weight-loader signature of vLLM's fused experts (``w13_weight [E, 2 I, D]`` =
[w1; w3] rows, ``w2_weight [E, D, I]``; ``weight_loader(param, w, name, shard_id, expert_id)``), so the one
checkpoint loader fills them like vLLM's own. Tensor parallelism splits the intermediate dim; expert
parallelism instead gives each rank ``E / world`` whole experts. Either way a rank returns a partial sum and
the MoE all-reduces (a float32 model's in float64: ``model/split_sums.py``).

Dispatch: the step's assignments are sorted by expert once; each hit expert then runs its two GEMMs on its
contiguous run of rows, the SwiGLU (and the W4A4 rounding) once over all rows, the shared expert's included
where it has the routed experts' width and rounding (``dense`` in :meth:`PortableExperts.forward`). After
loading, :meth:`pack` gives each expert's matrices vLLM's CPU GEMM dispatch (``cpu/linear.py``; a
float32 model's ``w2`` a float64 linear instead, ``model/split_sums.py``).
Where every expert's GEMMs over every token cost little (small experts, few tokens: :meth:`takes_all`),
:meth:`forward_all` instead runs all experts, the shared one among them, as two GEMMs with the routing weights
applied between them (0 for an expert a token did not pick): no sort or per-expert call. Under W4A4 the
SwiGLU and its rounding between the GEMMs run on the picked rows only, gathered and put back by index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4_mtp.cpu.kit import round_to_mxfp4
from vllm_dsv4_mtp.cpu.linear import Linear, dispatched_linear, plain_linears, slice_linears
from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.model.split_sums import partial_dtype, wide_linear

# The all-expert pass (every expert's GEMMs over every token) while those cost at most this many multiply-adds;
# under W4A4 half of that: its SwiGLU and MXFP4 rounding run on the routed rows only, but its GEMMs still cover
# every expert. On the embedded model's MoE the pass beat the dispatch up to a number of tokens, for BF16 and for
# W4A4; the budgets (~150 and ~85 of its tokens) stop short of both crossovers (docs/benchmarks.md, "Why the code
# is as it is").
ALL_EXPERTS_MACS = 1 << 26
ALL_EXPERTS_MACS_W4A4 = 1 << 25


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``; ``limit <= 0`` disables the clamp."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _down_linear(weight: torch.Tensor) -> Linear:
    """A down projection ``weight: [D, I]`` (a sum tensor parallelism splits): :func:`dispatched_linear`, or for
    a float32 model a float64 one (``model/split_sums.py``)."""
    return wide_linear(weight) or dispatched_linear(weight)


def all_experts_pay(tokens: int, experts: int, intermediate: int, hidden: int, *, w4a4: bool) -> bool:
    """Whether running ``experts`` SwiGLU experts (``intermediate x hidden``) over all ``tokens`` tokens costs
    less than dispatching each token to its picks: their GEMMs within ``ALL_EXPERTS_MACS`` (W4A4:
    ``ALL_EXPERTS_MACS_W4A4``) multiply-adds. DeepSeek-V4's own 256+ experts of 2048 x 7168 never do; the
    embedded model's and other small MoEs' do, where per-expert calls and the dispatch's index ops cost more
    than computing every expert."""
    budget = ALL_EXPERTS_MACS_W4A4 if w4a4 else ALL_EXPERTS_MACS
    return tokens * experts * 3 * intermediate * hidden <= budget


class PortableExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``intermediate_size`` on ``hidden_size`` inputs.

    Args:
        tp_rank, tp_size: this rank's place in the MoE's parallel group.
        expert_parallel: split whole experts across ranks instead of the intermediate dim.
        activation_quant: round each GEMM's input to MXFP4 (the W4A4 scheme of a Quark checkpoint).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
        activation_quant: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        split = num_experts if expert_parallel else intermediate_size
        if split % tp_size:
            what = "n_routed_experts" if expert_parallel else "moe_intermediate_size"
            raise ValueError(f"{what} {split} not divisible by the parallel size {tp_size}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_experts = num_experts // tp_size if expert_parallel else num_experts
        self.first_expert = tp_rank * self.local_experts if expert_parallel else 0
        self.local_intermediate = intermediate_size if expert_parallel else intermediate_size // tp_size
        self.tp_rank = 0 if expert_parallel else tp_rank
        self.swiglu_limit = swiglu_limit
        self.activation_quant = activation_quant
        if activation_quant and (hidden_size % mxfp4.BLOCK_SIZE or self.local_intermediate % mxfp4.BLOCK_SIZE):
            raise ValueError(
                f"W4A4 experts need hidden_size ({hidden_size}) and the per-rank intermediate size "
                f"({self.local_intermediate}) to be multiples of {mxfp4.BLOCK_SIZE}"
            )
        dtype = dtype or torch.get_default_dtype()
        e, i = self.local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._linears: list[tuple[Linear, Linear]] | None = None  # per expert (w13, w2), set by pack()
        self._all: tuple[Linear, Linear] | None = None  # every expert at once, set by pack_all()
        self._all_shared = False

    # --------------------------------------------------------------------------------------------- loading
    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Store native ``experts.{expert_id}.{shard_id}.weight`` (full ``[I, D]`` / ``[D, I]``) in this rank's
        slice; returns False (with ``return_success``) for an expert held by another expert-parallel rank."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.local_experts:
            return False if return_success else None
        i = self.local_intermediate
        rows = slice(self.tp_rank * i, self.tp_rank * i + i)
        if shard_id == "w1":
            param.data[local, :i].copy_(loaded[rows])
        elif shard_id == "w3":
            param.data[local, i:].copy_(loaded[rows])
        elif shard_id == "w2":
            param.data[local].copy_(loaded[:, rows])
        else:
            raise ValueError(f"{weight_name}: unknown expert shard {shard_id!r}")
        return True if return_success else None

    # --------------------------------------------------------------------------------------------- compute
    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return round_to_mxfp4(x) if self.activation_quant else x

    def _swiglu(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self._act(swiglu_clamped(gate, up, self.swiglu_limit))

    def pack(self) -> None:
        """After loading: each expert's ``w13`` and ``w2`` as a linear of its own (``cpu/linear.py``;
        a float32 model's ``w2``, a sum TP splits, in float64: ``model/split_sums.py``)."""
        self._linears = list(zip(slice_linears(self.w13_weight), map(_down_linear, self.w2_weight.data)))

    def pack_all(self, shared: tuple[nn.Module, nn.Module] | None = None) -> None:
        """After loading: the all-expert pass's two linears (:meth:`forward_all`), every local expert side by
        side, then the shared expert ``shared = (gate_up_proj, down_proj)`` (its vLLM linears, of this rank's
        width, whose weights ``[2 I, D]``, ``[D, I]`` are read as loaded) as one more: ``w13 [(E + 1) 2 I, D]``,
        ``w2 [D, (E + 1) I]``. Nothing is made (and nothing read) for a MoE that would not take the pass for a
        single token (DeepSeek-V4's own, :meth:`packs_all`); otherwise its experts' bytes (and the shared
        expert's) come once more, as vLLM's packed copy (on CPU the concatenated copy is dropped after packing)."""
        n = self.local_experts + (shared is not None)
        if not self.packs_all(with_shared=shared is not None):
            self._all, self._all_shared = None, False
            return
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        if shared is not None:
            s13, s2 = (layer.weight.data for layer in shared)
            want = ((2 * self.local_intermediate, self.hidden_size), (self.hidden_size, self.local_intermediate))
            if (tuple(s13.shape), tuple(s2.shape)) != want:
                raise ValueError(
                    f"pack_all: the shared expert's weights are {[tuple(s13.shape), tuple(s2.shape)]},"
                    f" expected {list(want)}"
                )
            w13 = torch.cat([w13, s13.to(w13.dtype).unsqueeze(0)])
            w2 = torch.cat([w2, s2.to(w2.dtype).unsqueeze(0)])
        self._all_shared = shared is not None
        self._all = (
            dispatched_linear(w13.reshape(n * 2 * self.local_intermediate, self.hidden_size)),
            _down_linear(w2.permute(1, 0, 2).reshape(self.hidden_size, n * self.local_intermediate)),
        )

    def packs_all(self, with_shared: bool) -> bool:
        """Whether :meth:`pack_all` makes the all-expert pass (and reads the shared expert's weights, where
        ``with_shared``): where a single token would take it (:func:`all_experts_pay`)."""
        return all_experts_pay(
            1, self.local_experts + with_shared, self.local_intermediate, self.hidden_size, w4a4=self.activation_quant
        )

    def takes_all(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs :meth:`forward_all` (packed by :meth:`pack_all`, and
        :func:`all_experts_pay`)."""
        return (
            self._all is not None
            and tokens > 0
            and all_experts_pay(
                tokens,
                self.local_experts + self._all_shared,
                self.local_intermediate,
                self.hidden_size,
                w4a4=self.activation_quant,
            )
        )

    @property
    def all_includes_shared(self) -> bool:
        """Whether :meth:`forward_all` adds the shared expert (it was packed with it)."""
        return self._all_shared

    def forward_all(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, x_rounded: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`forward` as two GEMMs over every local expert (and the shared one, when packed with it) for
        every token: ``w13`` of all experts, SwiGLU over all, each expert's rows scaled by the token's routing
        weight (0 where not routed, 1 for the shared expert) in float32, then one ``w2`` GEMM whose sum over
        experts is the routed sum (plus the shared expert's output). Under W4A4 the SwiGLU and its rounding run
        on the routed rows only (:meth:`_forward_routed_rows`); otherwise the float32 SwiGLU over every row costs
        less at small batches than the index ops that would pick the rows (docs/benchmarks.md). The same
        function as the per-expert dispatch with no sort or per-expert call; it rounds each scaled row
        to ``x.dtype`` where the dispatch rounds each expert's output (the same bound; in float32 neither
        rounds there: the dispatch keeps each output in float64, the pass's scaled rows are float32 already).
        ``x: [T, D]`` -> this rank's part ``[T, D]`` in ``partial_dtype(x.dtype)``."""
        t = ids.shape[0]
        n, i = self.local_experts, self.local_intermediate
        local = ids - self.first_expert if self.first_expert else ids
        if self._all_shared:
            n += 1
        if self.activation_quant:
            return self._forward_routed_rows(x, weights, local, n, x_rounded)
        spare = self.local_experts < self.num_experts  # expert parallel: other ranks' experts to a spare column
        if spare:
            local = torch.where((local >= 0) & (local < self.local_experts), local, n)
        w = torch.zeros(t, n + spare, dtype=torch.float32, device=x.device).scatter_add_(1, local, weights.float())
        if self._all_shared:
            w[:, n - 1] = 1.0
        if spare:
            w = w[:, :n]
        # float32 (n times the dispatch's rows: torch's CPU bfloat16 elementwise ops are the slow ones)
        h = self._all[0](x).view(t, n, 2 * i).float()
        gate, up = h[..., :i], h[..., i:]
        if self.swiglu_limit > 0:
            gate.clamp_(max=self.swiglu_limit)
            up.clamp_(min=-self.swiglu_limit, max=self.swiglu_limit)
        a = F.silu(gate, inplace=True).mul_(up)  # [T, n, I], in h
        return self._all[1](a.mul_(w.unsqueeze(-1)).to(x.dtype).reshape(t, n * i))  # partial_dtype: _down_linear

    def _forward_routed_rows(
        self, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, n: int, x_rounded: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`forward_all` under W4A4: the first GEMM over every expert, then the SwiGLU and its MXFP4
        rounding (~20 elementwise ops, most of the pass's cost) only on the ``k`` rows each token routed to
        (and the shared expert's), each scaled by its routing weight in float32; the other experts' rows of the
        second GEMM's input stay 0. The rounding works per row, so every routed row is what the whole pass
        computes, and a non-routed expert's row cannot reach the sum (not even as ``0 * inf``).
        ``local: [T, k]`` this rank's expert index of each pick (out of range: another rank's)."""
        t = local.shape[0]
        i = self.local_intermediate
        scale = weights.float()  # weights itself where already float32: never written below
        mine = None
        if self.local_experts < self.num_experts:  # expert parallel: other ranks' picks read expert 0, then 0
            mine = (local >= 0) & (local < self.local_experts)
            local = local.where(mine, 0)
        if self._all_shared:  # the last expert of the pass, weight 1 for every token
            local = torch.cat([local, local.new_full((t, 1), n - 1)], dim=1)
            scale = torch.cat([scale, scale.new_ones(t, 1)], dim=1)
            mine = None if mine is None else torch.cat([mine, mine.new_ones(t, 1)], dim=1)
        rows = local.reshape(-1)  # [T k] rows of h [T n, 2 I]
        if t > 1:
            rows = (local + torch.arange(0, t * n, n, device=x.device).unsqueeze(1)).reshape(-1)
        h = self._all[0](x_rounded if x_rounded is not None else self._act(x)).view(t * n, 2 * i)
        # W4A4 rounds the SwiGLU as the dispatch computes it (in x.dtype): an MXFP4 step is coarse enough that
        # another rounding before it would move some elements a whole step
        a = self._swiglu(h.index_select(0, rows)).float().mul_(scale.reshape(-1, 1))
        if mine is not None:
            a.masked_fill_(~mine.reshape(-1, 1), 0.0)
        # index_add_: a token that picked one expert twice (a hash table may) gets both rows, as in the dispatch
        down_in = torch.zeros(t * n, i, dtype=x.dtype, device=x.device).index_add_(0, rows, a.to(x.dtype))
        return self._all[1](down_in.view(t, n * i))  # partial_dtype: _down_linear

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        x_rounded: torch.Tensor | None = None,
        dense: tuple[Linear, Linear] | None = None,
    ) -> torch.Tensor:
        """``x: [T, D]``, ``weights: [T, k]`` float32, ``ids: [T, k]`` global expert ids -> ``[T, D]``
        in ``partial_dtype(x.dtype)`` (this rank's part of ``sum_k weights[:, k] * expert_{ids[:, k]}(x)``).
        ``x_rounded``: ``x`` already rounded to MXFP4 (the MoE rounds it once for its routed and shared experts).
        ``dense``: the ``(w13, w2)`` linears of an expert every token goes through with weight 1 (the shared
        expert, of this rank's width and rounding), whose SwiGLU and rounding then run with the routed rows':
        its output is added to the routed sum in ``partial_dtype(x.dtype)``, as a separate module's would be."""
        t, k = ids.shape
        local = ids.reshape(-1) - self.first_expert
        token = torch.arange(t * k, device=x.device) // k
        weight = weights.reshape(-1)
        if self.local_experts < self.num_experts:  # expert parallel: only this rank's experts
            keep = ((local >= 0) & (local < self.local_experts)).nonzero().squeeze(-1)
            local, token, weight = local[keep], token[keep], weight[keep]
        part = partial_dtype(x.dtype)
        out = torch.zeros(t, x.shape[-1], dtype=torch.promote_types(part, torch.float32), device=x.device)
        if not local.numel() and dense is None:
            return out.to(part)
        xq = x_rounded if x_rounded is not None else self._act(x)
        counts = [0] * self.local_experts
        if local.numel():
            order = torch.argsort(local, stable=True)
            token, weight = token[order], weight[order]
            counts = torch.bincount(local, minlength=self.local_experts).tolist()
        y, y_dense = self._run(xq[token], counts, xq if dense is not None else None, dense)
        if local.numel():
            out.index_add_(0, token, y.to(out.dtype) * weight.unsqueeze(-1))
        return out.to(part) if y_dense is None else out.to(part) + y_dense

    def _run(
        self,
        xs: torch.Tensor,
        counts: list[int],
        dense_x: torch.Tensor | None = None,
        dense: tuple[Linear, Linear] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``xs: [A, D]`` sorted by expert, ``counts[e]`` of them for expert ``e`` -> ``([A, D]``, and for
        ``dense_x: [T, D]`` through ``dense`` ``[T, D]`` or None)."""
        runs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                runs.append((e, slice(start, start + c)))
                start += c
        linears = (
            self._linears
            if self._linears is not None
            else list(zip(plain_linears(self.w13_weight), plain_linears(self.w2_weight)))
        )
        h = [linears[e][0](xs[rows]) for e, rows in runs]
        if dense is not None:
            h.append(dense[0](dense_x))
        h = self._swiglu(h[0] if len(h) == 1 else torch.cat(h))
        y = [linears[e][1](h[rows]) for e, rows in runs]
        y_dense = dense[1](h[start:]) if dense is not None else None
        return (y[0] if len(y) == 1 else torch.cat(y)) if y else xs[:0], y_dense
