"""The shipped embedded model's recipe: its config.json and how its target and MTP layer are initialised.

Kept apart from the training loop so that the exporter can rebuild a model from a saved state without
importing the trainer (and the trainer can export without the exporter importing it back).
"""

from __future__ import annotations

import torch

from vllm_dsv4_mtp.tools.tiny import tiny_config

# config.json of the embedded model: the tiny checkpoints' layout (``tools.tiny.TINY_CONFIG``: the fields of
# https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json, legacy names as in the real
# releases) with the sizes a 2-core CPU trains in well under an hour; the portable kernels take any dims.
MODEL_CONFIG: dict = tiny_config(
    vocab_size=640,  # the embedded BPE tokenizer's vocabulary
    o_lora_rank=64,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=16,
    moe_intermediate_size=128,
    pad_token_id=2,
    initializer_range=0.02,
)


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
