"""KV cache bytes per token of one DeepSeek-V4 sequence, as vLLM allocates them.

DeepSeek-V4 keeps one compressed row per ``compress_ratio`` tokens on compressed layers (584 B in vLLM's fp8
layout: 448 B NoPE + 128 B RoPE + 8 B scales; 2 x head_dim in bf16) plus one 132-B indexer row per 4 tokens on
C4 layers; sliding-window rings are bounded and not counted. vLLM's paged allocator needs more than the rows:
the one measurement (InferenceX#2540: 14.88 GiB for a 1,048,576-token sequence of DeepSeek-V4-Pro with fp8 KV
and MTP) is used as the scale, and other configs, lengths and KV dtypes are scaled by their row bytes per token
relative to it. The KV of one sequence is the same on every GPU of a TP group (one latent KV head).
"""

from __future__ import annotations

from vllm_dsv4_mtp.serve.profiles import PRO_CONFIG

GIB = 2**30

#: InferenceX#2540: vLLM needed 14.88 GiB of KV for one 1,048,576-token DeepSeek-V4-Pro sequence (fp8, MTP).
KV_MEASURED_BYTES = 14.88 * GIB
KV_MEASURED_TOKENS = 1_048_576
KV_MEASURED_SOURCE = "InferenceX#2540: 14.88 GiB for one 1,048,576-token DeepSeek-V4-Pro sequence, fp8 KV"


def kv_row_bytes_per_token(spec, kv_cache_dtype: str) -> float:
    """Compressed-row bytes per token summed over the main layers (see the module docstring)."""
    fp8 = kv_cache_dtype.startswith("fp8")
    row = (spec.head_dim - spec.qk_rope_head_dim) + 2 * spec.qk_rope_head_dim + 8 if fp8 else 2 * spec.head_dim
    index_row = spec.index_head_dim + 4  # fp8 keys + one fp32 scale; vLLM keeps the indexer cache in fp8
    total = 0.0
    for lid in range(spec.num_hidden_layers):
        r = spec.compress_ratio(lid)
        if r > 1:
            total += row / r + (index_row / r if spec.has_indexer(lid) else 0.0)
    return total


def kv_bytes_per_token(spec, kv_cache_dtype: str) -> float:
    """KV bytes per token of one sequence, scaled from the measured DeepSeek-V4-Pro figure."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    pro = DeepseekV4Spec.from_dict(PRO_CONFIG, source="DeepSeek-V4-Pro")
    scale = KV_MEASURED_BYTES / KV_MEASURED_TOKENS / kv_row_bytes_per_token(pro, "fp8")
    return kv_row_bytes_per_token(spec, kv_cache_dtype) * scale
