"""DeepSeek-V4 MoE: router (sqrtsoftplus, bias for selection only, hash layers), routed + shared experts.

Router, per token (float32)::

    s   = sqrt(softplus(x @ gate.weight^T))          # scoring_func "sqrtsoftplus"
    ids = tid2eid[input_id]           (hash layers: the first num_hash_layers; no bias)
        | topk(s + gate.bias, k)      (the bias only SELECTS)
    w   = s[ids] / sum(s[ids]) * routed_scaling_factor

Every expert (routed and shared) is ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with ``L = swiglu_limit``;
the output is ``sum_k w_k expert_k(x) + shared(x)``. The routed-expert GEMMs are in
``vllm_dsv4_mtp.kernels.experts``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

from vllm_dsv4_mtp.kernels.experts import (
    Mxfp4Experts,
    make_routed_experts,
    select_experts_impl,
    swiglu_clamped,
)

_SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


class Router(nn.Module):
    """Native ``ffn.gate.{weight, bias | tid2eid}``. Returns ``(weights [T, k] float32, ids [T, k] int64)``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int, *, is_hash: bool,
                 scoring_func: str, routed_scaling_factor: float, renormalize: bool):
        super().__init__()
        if scoring_func not in _SCORE_FUNCS:
            raise ValueError(f"scoring_func {scoring_func!r} is not supported; expected one of {list(_SCORE_FUNCS)}")
        self.top_k = top_k
        self.is_hash = is_hash
        self.score = _SCORE_FUNCS[scoring_func]
        self.routed_scaling_factor = routed_scaling_factor
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        if is_hash:
            self.tid2eid = nn.Parameter(torch.empty(vocab_size, top_k, dtype=torch.int32), requires_grad=False)
            self.e_score_correction_bias = None
        else:
            self.tid2eid = None
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x.float(), self.weight.float()))  # [T, E]
        if self.is_hash:
            if input_ids is None:
                raise ValueError("hash-routed MoE layers need the input token ids")
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class SharedExpert(nn.Module):
    """Native ``ffn.shared_experts.w{1,2,3}``: ``gate_up_proj`` = [w1; w3] (column-parallel), ``down_proj`` = w2."""

    fmt = "bf16"

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=None, prefix=f"{prefix}.gate_up_proj",
            return_bias=False,
        )
        # reduce_results=False: the MoE all-reduces routed + shared once
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=None, reduce_results=False,
            prefix=f"{prefix}.down_proj", return_bias=False,
        )
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu_clamped(gate, up, self.swiglu_limit))


class Mxfp4SharedExpert(nn.Module):
    """A shared expert stored MXFP4 (the AMD export's main layers: "FSE" layout, so it can join the routed
    grouped GEMM on gfx950). Portable path: the routed experts' MXFP4 emulation with one expert, weight 1."""

    fmt = "mxfp4"

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float, activation_quant: bool,
                 tp_rank: int, tp_size: int):
        super().__init__()
        self.experts = Mxfp4Experts(1, hidden_size, intermediate_size, swiglu_limit, tp_rank=tp_rank,
                                    tp_size=tp_size, activation_quant=activation_quant)

    def load(self, name: str, shard: str, part: str, t: torch.Tensor) -> None:
        self.experts.load(name, 0, shard, part, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.expert(0, x)


class DeepseekV4MoE(nn.Module):
    """One MoE layer (native ``layers.N.ffn.*``): router, routed experts (platform seam), shared expert."""

    def __init__(self, config, *, is_hash: bool, expert_format: str, prefix: str, activation_quant: bool = True,
                 shared_format: str = "bf16"):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.tp_size = tp_size
        self.gate = Router(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, config.vocab_size,
            is_hash=is_hash, scoring_func=getattr(config, "scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=config.routed_scaling_factor,
            renormalize=getattr(config, "norm_topk_prob", True),
        )
        shared_inter = config.moe_intermediate_size * config.n_shared_experts
        if shared_format == "mxfp4":
            self.shared_experts = Mxfp4SharedExpert(
                config.hidden_size, shared_inter, config.swiglu_limit, activation_quant,
                get_tensor_model_parallel_rank(), tp_size,
            )
        elif shared_format == "bf16":
            self.shared_experts = SharedExpert(config.hidden_size, shared_inter, config.swiglu_limit,
                                               prefix=f"{prefix}.shared_experts")
        else:
            raise ValueError(f"{prefix}.shared_experts: unsupported storage {shared_format!r} (bf16 or mxfp4)")
        self.experts_impl = select_experts_impl(expert_format)
        self.expert_format = expert_format
        self.experts = make_routed_experts(
            self.experts_impl, num_experts=config.n_routed_experts, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, swiglu_limit=config.swiglu_limit,
            tp_rank=get_tensor_model_parallel_rank(), tp_size=tp_size, activation_quant=activation_quant,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``x: [T, D]`` (the normed sub-layer input), ``input_ids: [T]`` -> ``[T, D]``."""
        weights, ids = self.gate(x, input_ids)
        out = self.experts(x, weights, ids) + self.shared_experts(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
