"""The shipped embedded model's recipe: its config.json and how its target and MTP layer are initialised.

Kept apart from the training loop so that the exporter can rebuild a model from a saved state without
importing the trainer (and the trainer can export without the exporter importing it back).
"""

from __future__ import annotations

import torch

# HF-style config.json of the embedded model (the fields of https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json, legacy names as
# in the real releases). head_dim / index dims are smaller than the real model's: the plugin's portable
# kernels take any dims, and a 2-core CPU can train this in well under an hour.
MODEL_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 640,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 16,
    "num_hash_layers": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
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
    "pad_token_id": 2,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}


def hf_config(cfg: dict):
    from transformers import DeepseekV4Config

    return DeepseekV4Config.from_dict(cfg)


def build_models(cfg: dict, seed: int):
    """Target (HF) and MTP (reference), seeded. ``tid2eid`` of the hash layers gets ``k`` distinct random
    experts per token (HF initialises it to zeros, i.e. every token on expert 0 twice)."""
    from transformers import DeepseekV4ForCausalLM

    from ...reference.mtp import ReferenceMTP

    torch.manual_seed(seed)
    config = hf_config(cfg)
    config._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                e, k = config.n_routed_experts, config.num_experts_per_tok
                layer.mlp.gate.tid2eid.copy_(torch.rand(config.vocab_size, e, generator=g).argsort(-1)[:, :k])
    mtp = ReferenceMTP(config, model.model.embed_tokens, model.lm_head)
    for module in mtp.modules():  # the target was initialised by HF's post_init; the MTP the same way
        model._init_weights(module)
    return model, mtp
