"""vLLM's in-tree AMD DeepSeek-V4 MTP layer's parameters, rebuilt on CPU from vLLM's own layer classes.

``vllm.models.deepseek_v4.amd.mtp`` imports ROCm-only modules, and its attention base class allocates CUDA
events, so the class itself cannot be built here. Its parameters come from vLLM layer classes that can:
this module builds them with the constructor arguments the in-tree source passes (vLLM 0.32
``models/deepseek_v4/amd/mtp.py`` ``DeepSeekV4MultiTokenPredictorLayer.__init__``, ``amd/model.py``
``DeepseekV4DecoderLayer.__init__``, ``attention.py`` ``DeepseekV4Attention.__init__`` for the projections,
``amd/rocm.py`` ``get_padded_num_q_heads`` = local heads), under the same module names, and takes the MoE
from vLLM's CPU ``DeepseekV4MoE``, which is the AMD one without its ROCm-only fusion paths.

Parameter shapes then come from vLLM's classes at whatever tensor-parallel size the caller initialised;
``quant_config`` comes from the ``vllm_config`` passed in, exactly as the in-tree classes read it, and each
layer gets the prefix the in-tree code gives it (:data:`QUANT_PREFIXES`).
"""

from __future__ import annotations

import torch
from torch import nn


#: (layer prefix relative to ``model.layers.{L}``, vLLM layer type) of every module of the in-tree MTP layer that
#: asks the quantization config for a method: the prefixes QuarkConfig sees (the block's are NOT under mtp_block)
QUANT_PREFIXES = (
    ("e_proj", "linear"), ("h_proj", "linear"),
    ("attn.fused_wqa_wkv", "linear"), ("attn.wq_b", "linear"), ("attn.wo_a", "linear"), ("attn.wo_b", "linear"),
    ("ffn.shared_experts.gate_up_proj", "linear"), ("ffn.shared_experts.down_proj", "linear"),
    ("ffn.experts", "moe"),
)


class _Attention(nn.Module):
    """``DeepseekV4Attention``'s parameters for a sliding-window (MTP) layer: no compressor, no indexer."""

    def __init__(self, vllm_config, prefix: str):
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            MergedColumnParallelLinear,
            RowParallelLinear,
        )

        super().__init__()
        c, qc = vllm_config.model_config.hf_config, vllm_config.quant_config
        heads, hd, groups = c.num_attention_heads, c.head_dim, c.o_groups
        local_heads = heads // get_tensor_model_parallel_world_size()
        self.attn_sink = nn.Parameter(torch.full((local_heads,), -float("inf"), dtype=torch.float32),
                                      requires_grad=False)
        self.fused_wqa_wkv = MergedColumnParallelLinear(c.hidden_size, [c.q_lora_rank, hd], bias=False,
                                                        quant_config=qc, prefix=f"{prefix}.fused_wqa_wkv",
                                                        disable_tp=True)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(c.q_lora_rank, heads * hd, bias=False, quant_config=qc, return_bias=False,
                                         prefix=f"{prefix}.wq_b")
        self.kv_norm = RMSNorm(hd, c.rms_norm_eps)
        self.wo_a = ColumnParallelLinear(heads * hd // groups, groups * c.o_lora_rank, bias=False, quant_config=qc,
                                         return_bias=False, prefix=f"{prefix}.wo_a")
        self.wo_b = RowParallelLinear(groups * c.o_lora_rank, c.hidden_size, bias=False, quant_config=qc,
                                      return_bias=False, prefix=f"{prefix}.wo_b")


def _f32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class _Block(nn.Module):
    """``amd/model.py`` ``DeepseekV4DecoderLayer``: attention, MoE, two norms, two mHC sites."""

    def __init__(self, vllm_config, prefix: str):
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.models.deepseek_v4.cpu.model import DeepseekV4MoE

        super().__init__()
        c = vllm_config.model_config.hf_config
        self.attn = _Attention(vllm_config, f"{prefix}.attn")
        self.ffn = DeepseekV4MoE(vllm_config, prefix=f"{prefix}.ffn")
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", _f32(mix, width))
            setattr(self, f"hc_{site}_base", _f32(mix))
            setattr(self, f"hc_{site}_scale", _f32(3))


class _MtpLayer(nn.Module):
    """``DeepSeekV4MultiTokenPredictorLayer`` (its ``shared_head.head`` is the target's, shared by vLLM)."""

    def __init__(self, vllm_config, prefix: str):
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import ReplicatedLinear

        super().__init__()
        c, qc = vllm_config.model_config.hf_config, vllm_config.quant_config
        d = c.hidden_size
        self.enorm = RMSNorm(d, eps=c.rms_norm_eps)
        self.hnorm = RMSNorm(d, eps=c.rms_norm_eps)
        self.e_proj = ReplicatedLinear(d, d, bias=False, return_bias=False, quant_config=qc, prefix=f"{prefix}.e_proj")
        self.h_proj = ReplicatedLinear(d, d, bias=False, return_bias=False, quant_config=qc, prefix=f"{prefix}.h_proj")
        self.hc_head_fn = _f32(c.hc_mult, c.hc_mult * d)
        self.hc_head_base = _f32(c.hc_mult)
        self.hc_head_scale = _f32(1)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps=c.rms_norm_eps)
        # the in-tree layer hands the block its own prefix (``model.layers.61``, not ``...mtp_block``): the
        # quantization lookups and the attention's KV-cache name use it
        self.mtp_block = _Block(vllm_config, prefix)


class InTreeMtpParameters(nn.Module):
    """``model.layers.{num_hidden_layers + i}.*`` of vLLM's in-tree draft, for every MTP layer of the config."""

    def __init__(self, vllm_config):
        super().__init__()
        c = vllm_config.model_config.hf_config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({
            str(n): _MtpLayer(vllm_config, f"model.layers.{n}")
            for n in range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers)})
