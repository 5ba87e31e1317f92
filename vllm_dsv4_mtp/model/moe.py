"""DeepSeek-V4 MoE: router (sqrtsoftplus, bias for selection only, hash layers), routed + shared experts.

Router, per token (float32)::

    s   = sqrt(softplus(x @ gate.weight^T))          # scoring_func "sqrtsoftplus"
    ids = tid2eid[input_id]           (hash layers: the first num_hash_layers; no bias)
        | topk(s + gate.bias, k)      (the bias only SELECTS)
    w   = s[ids] / sum(s[ids]) * routed_scaling_factor

MoE, per token::

    y = sum_k w_k expert_{ids_k}(x)                  # the routed experts: model/experts.py
      + shared(x)                                    # no routing weight
    y = all_reduce(y)                                # the ranks' parts (TP: widths, EP: experts)

Every expert (routed and shared) is ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with ``L = swiglu_limit``.
Every layer reads its sizes and routing rule from the validated spec.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.cpu.kit import round_to_mxfp4
from vllm_dsv4_mtp.cpu.linear import Linear, prepared_linear
from vllm_dsv4_mtp.model.experts import PortableExperts, swiglu_clamped
from vllm_dsv4_mtp.model.split_sums import all_reduce, partial_dtype, wide_layer

_SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


class Router(nn.Module):
    """Native ``ffn.gate.{weight, bias | tid2eid}``. Returns ``(weights [T, k] float32, ids [T, k] int64)``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        vocab_size: int,
        *,
        is_hash: bool,
        scoring_func: str,
        routed_scaling_factor: float,
        renormalize: bool,
    ):
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
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )

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
    """Native ``ffn.shared_experts.w{1,2,3}``: ``gate_up_proj`` = [w1; w3] (column-parallel), ``down_proj`` = w2.

    ``activation_quant``: the AMD export stores the main layers' shared experts MXFP4 under the W4A4 scheme;
    their weights are decoded at load and each GEMM's input is rounded to MXFP4, as for the routed experts.
    ``fp8_round``: instead, each GEMM's input rounded as an FP8 block linear's (dynamic 1x128 e4m3,
    ``formats.fp8.fake_quant_act``): the MTP layer's FP8 shared expert computed as stored.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        prefix: str,
        activation_quant: bool = False,
        fp8_round: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.gate_up_proj = prepared_linear(
            MergedColumnParallelLinear(
                hidden_size,
                [intermediate_size] * 2,
                bias=False,
                prefix=f"{prefix}.gate_up_proj",
                return_bias=False,
            )
        )
        # reduce_results=False: the MoE all-reduces routed + shared once
        self.down_proj = prepared_linear(
            RowParallelLinear(
                intermediate_size,
                hidden_size,
                bias=False,
                reduce_results=False,
                prefix=f"{prefix}.down_proj",
                return_bias=False,
            )
        )
        self.swiglu_limit = swiglu_limit
        if activation_quant and fp8_round is not None:
            raise ValueError("a shared expert is MXFP4 W4A4 or FP8 block, not both")
        self.activation_quant = activation_quant
        self.fp8_round = fp8_round
        self._down_wide: Linear | None = None  # float32 models: down_proj in float64, set by pack()

    def pack(self) -> None:
        """After loading: a float32 model's ``down_proj`` (a sum TP splits) in float64 (``model/split_sums.py``)."""
        self._down_wide = wide_layer(self.down_proj)

    @property
    def down(self) -> Linear:
        """``down_proj`` as this rank computes its part: ``[T, I_local]`` -> ``[T, D]`` (float32 models: float64)."""
        return self.down_proj if self._down_wide is None else self._down_wide

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_round is not None:
            return self.fp8_round(x)
        return round_to_mxfp4(x) if self.activation_quant else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, D]`` -> this rank's part ``[T, D]`` in ``partial_dtype(x.dtype)`` (not yet all-reduced)."""
        gate, up = self.gate_up_proj(self._act(x)).chunk(2, dim=-1)
        return self.down(self._act(swiglu_clamped(gate, up, self.swiglu_limit))).to(partial_dtype(x.dtype))


class DeepseekV4MoE(nn.Module):
    """One MoE layer (native ``layers.N.ffn.*`` / ``mtp.i.ffn.*``): router, routed experts, shared expert.

    Args:
        layer_id: the layer in the config's numbering (MTP layers: ``num_hidden_layers + i``).
        routed_w4a4, shared_w4a4: round the experts' GEMM inputs to MXFP4 (a Quark W4A4 checkpoint).
        shared_fp8: round the shared expert's GEMM inputs as an FP8 block linear's (:class:`SharedExpert`).
        expert_parallel: whole experts per rank instead of a slice of every expert.
    """

    def __init__(
        self,
        spec: DeepseekV4Spec,
        layer_id: int,
        *,
        prefix: str,
        routed_w4a4: bool = False,
        shared_w4a4: bool = False,
        shared_fp8: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expert_parallel: bool = False,
    ):
        super().__init__()
        self.gate = Router(
            spec.hidden_size,
            spec.n_routed_experts,
            spec.num_experts_per_tok,
            spec.vocab_size,
            is_hash=spec.is_hash_layer(layer_id),
            scoring_func=spec.scoring_func,
            routed_scaling_factor=spec.routed_scaling_factor,
            renormalize=spec.norm_topk_prob,
        )
        self.shared_experts = SharedExpert(
            spec.hidden_size,
            spec.shared_intermediate_size,
            spec.swiglu_limit,
            prefix=f"{prefix}.shared_experts",
            activation_quant=shared_w4a4,
            fp8_round=shared_fp8,
        )
        self.experts = PortableExperts(
            spec.n_routed_experts,
            spec.hidden_size,
            spec.moe_intermediate_size,
            spec.swiglu_limit,
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            expert_parallel=expert_parallel,
            activation_quant=routed_w4a4,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``x: [T, D]`` (the normed sub-layer input), ``input_ids: [T]`` -> ``[T, D]``."""
        weights, ids = self.gate(x, input_ids)
        y = self.experts(x, weights, ids) + self.shared_experts(x)
        # the ranks' parts, summed in partial_dtype (float32 models: float64) and rounded once
        return all_reduce(y).to(x.dtype)
