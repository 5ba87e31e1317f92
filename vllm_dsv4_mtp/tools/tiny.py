"""A tiny DeepSeek-V4 checkpoint for tests: every architectural feature, a couple of million parameters.

:func:`tiny_config` gives the ``config.json`` dict (native HF-style field names, the same keys as the released
configs); :func:`build_tiny_checkpoint` writes random weights in the native DeepSeek release naming
(``embed.weight``, ``layers.N.attn.*``, ``mtp.0.*``, ...) plus a tokenizer that vLLM and transformers load
from the directory.
"""

from __future__ import annotations

import copy
from typing import Any

# The default tiny model. Widths are small for CPU speed; the STRUCTURE is the real one: 4 residual streams
# (hc_mult 4), a 64-dim interleaved rope part at the end of each head, grouped low-rank output projection
# with 2 groups, one SWA / C4 / C128 / C4 main layer each, one hash-routed layer, one SWA MTP layer, and an
# index_topk small enough that the lightning indexer really selects once a sequence passes 4*8 = 32 tokens.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "num_hash_layers": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The tiny config.json dict with ``overrides`` applied (validated).

    ``num_hidden_layers`` may be overridden together with ``compress_ratios`` (length num_hidden_layers +
    num_nextn_predict_layers). If only ``compress_ratios`` is given, ``num_hidden_layers`` follows from it.
    """
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    cfg = copy.deepcopy(TINY_CONFIG)
    cfg.update(copy.deepcopy(overrides))
    if "compress_ratios" in overrides and "num_hidden_layers" not in overrides:
        cfg["num_hidden_layers"] = len(cfg["compress_ratios"]) - cfg["num_nextn_predict_layers"]
    elif "num_nextn_predict_layers" in overrides and "compress_ratios" not in overrides:
        n = cfg["num_hidden_layers"]
        cfg["compress_ratios"] = list(cfg["compress_ratios"][:n]) + [0] * cfg["num_nextn_predict_layers"]
    DeepseekV4Spec.from_dict(cfg, source="tiny_config()")
    return cfg


def hf_config(path):
    """HF transformers' ``DeepseekV4Config`` for a checkpoint directory, for any compression ratios.

    transformers 5.19 maps the native ``compress_ratios`` through a fixed {0: SWA, 4: CSA, 128: HCA} table and
    raises ``KeyError`` on other ratios; this passes the equivalent ``layer_types`` + ``compress_rates``
    instead (:meth:`DeepseekV4Spec.hf_layer_schedule`), so test configs such as ``[0, 4, 8, 0]`` load in the
    oracle too.
    """
    import json
    from pathlib import Path

    from transformers import DeepseekV4Config

    from vllm_dsv4_mtp.config import DeepseekV4Spec

    f = Path(path) / "config.json"
    raw = json.loads(f.read_text())
    spec = DeepseekV4Spec.from_dict(raw, source=str(f))
    d = {k: v for k, v in raw.items() if k not in ("compress_ratios", "quantization_config")}
    d.update(spec.hf_layer_schedule())
    return DeepseekV4Config(**d)
