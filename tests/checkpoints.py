"""Tiny checkpoints and prompts for the engine tests, made the one way every parity test needs them."""

from __future__ import annotations

from pathlib import Path

import torch


def sharpened_tiny(
    tmp_path_factory, name: str, *, seed: int, experts: str = "bf16", head_scale: float | None = None, **config
) -> Path:
    """A random tiny checkpoint (``tiny_config(**config)``) whose expert choice no longer flips on near-ties.

    ``sharpen_routing`` lets the gate bias alone pick the experts (the routing weights are unchanged), so two
    implementations with different summation orders route alike and a parity test sees the precision floor of
    everything else; ``head_scale`` multiplies ``head.weight`` (``scale_head``: peaked logits, same argmax).
    """
    from vllm_dsv4_mtp.testing.hf_oracle import sharpen_routing
    from vllm_dsv4_mtp.testing.mtp_checkpoints import scale_head
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    d = build_tiny_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", tiny_config(**config), seed=seed, experts=experts)
    if head_scale is not None:
        scale_head(d, head_scale)
    sharpen_routing(d)
    return d


def random_prompts(lens, seed: int, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids in ``[2, vocab)`` (0 and 1 are BOS / EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]
