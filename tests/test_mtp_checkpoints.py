"""The MTP test checkpoints the real-class harness and the gfx950 tests rely on do what they claim.

``engage_mtp`` must make the SwiGLU clamp engage in the MTP experts and keep every part of the layer moving the
result; ``mtp_activity`` must see it (and must see a part that contributes nothing, or a clamp that never
engages, as such): a checkpoint that silently stopped engaging the clamp would let a kernel without it pass.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.testing.mtp_checkpoints import engage_mtp, mtp_activity, rewrite_tensors


@pytest.fixture
def tiny(tmp_path):
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    cfg = tiny_config()
    return build_tiny_checkpoint(tmp_path / "ckpt", cfg, seed=0), cfg


def _inputs(cfg, t: int = 40):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, cfg["hc_mult"], cfg["hidden_size"], generator=g)
    return hidden, torch.randint(3, 200, (t,), generator=g), torch.arange(t)


def test_engage_mtp_makes_the_clamp_engage_and_keeps_every_part(tiny):
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP

    ckpt, cfg = tiny
    before = mtp_activity(ReferenceMTP.from_checkpoint(ckpt), *_inputs(cfg))
    assert before["routed_clamped"] == before["shared_clamped"] == 0.0, before  # why the builder exists
    engage_mtp(ckpt)
    after = mtp_activity(ReferenceMTP.from_checkpoint(ckpt), *_inputs(cfg))
    assert 0.1 < after["routed_clamped"] < 0.6 and 0.1 < after["shared_clamped"] < 0.6, after
    assert min(after["attention"], after["routed"], after["shared"]) > 0.1, after
    assert after["attention"] == pytest.approx(before["attention"])  # attention untouched


def test_mtp_activity_sees_a_part_that_contributes_nothing(tiny):
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP

    ckpt, cfg = tiny
    rewrite_tensors(
        ckpt,
        lambda n, t: (
            torch.zeros_like(t)
            if n.startswith("mtp.") and n.endswith(("attn.wo_b.weight", "shared_experts.w2.weight"))
            else None
        ),
    )
    got = mtp_activity(ReferenceMTP.from_checkpoint(ckpt), *_inputs(cfg))
    assert got["attention"] == 0.0 and got["shared"] == 0.0 and got["routed"] > 0.1, got


def test_engage_mtp_refuses_a_quantized_checkpoint(tmp_path):
    from vllm_dsv4_mtp.testing.published_layouts import build_published

    ckpt = build_published(tmp_path / "official", "official", seed=1)
    with pytest.raises(ValueError, match="needs a BF16 checkpoint"):
        engage_mtp(ckpt)
