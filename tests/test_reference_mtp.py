"""The float32 reference MTP layer (vllm_dsv4_mtp/reference/mtp.py): spec formula, vLLM conventions, loading."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from vllm_dsv4_mtp.reference.mtp import MTP_PREFIX, ReferenceMTP

WINDOW = 8  # small, so sequences of 20+ tokens wrap the sliding window


def small_config():
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        compress_ratios=[0, 4, 0],
        num_hash_layers=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        sliding_window=WINDOW,
    )
    cfg._experts_implementation = "eager"
    return cfg


def make_mtp(seed: int = 0) -> ReferenceMTP:
    torch.manual_seed(seed)
    cfg = small_config()
    mtp = ReferenceMTP(cfg, nn.Embedding(64, 32), nn.Linear(32, 64, bias=False))
    with torch.no_grad():
        for p in mtp.parameters():
            nn.init.normal_(p, std=0.3)
        mtp.block.mlp.gate.e_score_correction_bias.normal_()
        mtp.embed.weight.normal_()
        mtp.head.weight.normal_(std=0.3)
    return mtp.eval()


def inputs(L: int = 20, B: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, 4, 32, generator=g), torch.randint(0, 64, (B, L + 3), generator=g)


def test_block_is_swa_and_bias_routed():
    mtp = make_mtp()
    assert mtp.block.self_attn.compressor is None  # SWA only: compress_ratio forced to 0/1 for MTP
    assert mtp.block.self_attn.sliding_window == WINDOW
    assert not mtp.block.mlp.is_hash and hasattr(mtp.block.mlp.gate, "e_score_correction_bias")
    # embed / head are the target's, not owned (not in the MTP's weights)
    assert not any(k.startswith(("embed", "head")) for k in mtp.state_dict())


def test_shapes_batched_and_unbatched():
    mtp = make_mtp()
    H, ids = inputs(L=12, B=2)
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        out = mtp(H, ids[:, 1:13], pos)
        assert out.shape == (2, 12, 4, 32)
        assert mtp.logits(out).shape == (2, 12, 64)
        single = mtp(H[1], ids[1, 1:13], pos[1])
    assert single.shape == (12, 4, 32)
    torch.testing.assert_close(single, out[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"hc=4"):
        mtp(H[:, :, :3], ids[:, 1:13], pos)


def test_input_stage_follows_spec():
    """Block input == h_proj(hnorm(H)) + e_proj(enorm(embed[ids])) broadcast over the hc streams."""
    mtp = make_mtp()
    H, ids = inputs(L=10)
    pos = torch.arange(3, 13)[None]  # no position 0 here
    seen = []
    handle = mtp.block.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        mtp(H, ids[:, 1:11], pos)
    handle.remove()

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    e = mtp.embed.weight[ids[:, 1:11]]
    want = rms(H, mtp.hnorm.weight) @ mtp.h_proj.weight.T + (rms(e, mtp.enorm.weight) @ mtp.e_proj.weight.T)[:, :, None]
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)


def test_position_zero_embedding_is_masked():
    mtp = make_mtp()
    H, ids = inputs(L=6)
    other = ids.clone()
    other[0, 1] = (ids[0, 1] + 7) % 64  # the MTP input token of position 0
    with torch.no_grad():
        a = mtp(H, ids[:, 1:7], torch.arange(6)[None])
        b = mtp(H, other[:, 1:7], torch.arange(6)[None])
        # the same rows at positions 5..10: no mask, so the token matters
        c = mtp(H, ids[:, 1:7], torch.arange(5, 11)[None])
        d = mtp(H, other[:, 1:7], torch.arange(5, 11)[None])
    torch.testing.assert_close(a[0, 0], b[0, 0], rtol=0, atol=0)
    assert (c[0, 0] - d[0, 0]).abs().max() > 1e-3


@pytest.mark.parametrize("L", [6, 20])
def test_recursion_over_all_rows_equals_step_by_step_drafting(L):
    """forward_steps (all rows at once, the training path) == vLLM-style incremental drafting with a KV
    cache: step 1 over the prefix (catch-up), then one token per step on the MTP's own state."""
    from transformers.cache_utils import DynamicCache

    mtp = make_mtp()
    H, ids = inputs(L=L)
    with torch.no_grad():
        steps = mtp.forward_steps(H, ids[:, :L], 3)
        assert [s.shape[1] for s in steps] == [L - 1, L - 2, L - 3]
        for t in range(0, L - 3):
            cache = DynamicCache(config=mtp.config)
            state = mtp(H[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None], past_key_values=cache)[:, -1:]
            for k in range(3):
                torch.testing.assert_close(mtp.logits(state)[0, -1], steps[k][0, t], rtol=1e-5, atol=1e-5)
                if k < 2:
                    state = mtp(
                        state, ids[:, t + k + 2 : t + k + 3], torch.tensor([[t + k + 1]]), past_key_values=cache
                    )


def test_recursion_uses_step1_context_not_its_own():
    """Step 2 must attend to step-1 entries of earlier positions (what vLLM's cache holds), so it differs
    from naively running the layer over its own outputs as a fresh sequence."""
    mtp = make_mtp()
    H, ids = inputs(L=10)
    with torch.no_grad():
        _, step2 = mtp.forward_steps(H, ids[:, :10], 2)
        s1 = mtp(H[:, :9], ids[:, 1:10], torch.arange(9)[None])
        naive = mtp.logits(mtp(s1[:, :8], ids[:, 2:10], torch.arange(1, 9)[None]))
    assert ((step2[0] - naive[0]).abs().amax(-1) > 1e-3).all()


def test_draft_is_greedy_recursion():
    mtp = make_mtp()
    H, ids = inputs(L=12)
    n = 9
    with torch.no_grad():
        drafts = mtp.draft(H[0, :n], ids[0, : n + 1], 3)
        seq = torch.cat([ids[:, : n + 1], drafts[None, :2]], dim=1)
        Hx = torch.cat([H[:, :n], torch.zeros(1, 2, 4, 32)], dim=1)  # rows after n-1 do not affect row n-1
        steps = mtp.forward_steps(Hx, seq, 3)
    assert [int(s[0, n - 1].argmax()) for s in steps] == drafts.tolist()


def test_native_roundtrip_and_clear_errors():
    src, dst = make_mtp(0), make_mtp(1)
    tensors = src.native_state_dict()
    assert MTP_PREFIX + "e_proj.weight" in tensors and MTP_PREFIX + "ffn.experts.3.w2.weight" in tensors
    assert MTP_PREFIX + "attn.attn_sink" in tensors and MTP_PREFIX + "ffn.gate.bias" in tensors
    bf16 = {k: (v.bfloat16() if v.dim() >= 2 else v) for k, v in tensors.items()}
    dst.load_native(bf16, source="x.safetensors")
    dst.embed.weight.data.copy_(src.embed.weight)
    dst.head.weight.data.copy_(src.head.weight)
    H, ids = inputs(L=10)
    with torch.no_grad():
        a = src.forward_steps(H, ids[:, :10], 2)
        src.load_native(bf16)  # same bf16-rounded weights on both sides
        b = src.forward_steps(H, ids[:, :10], 2)
        c = dst.forward_steps(H, ids[:, :10], 2)
    torch.testing.assert_close(b[1], c[1], rtol=0, atol=0)
    assert (a[0] - b[0]).abs().max() < 0.5  # bf16 rounding only

    missing = dict(tensors)
    del missing[MTP_PREFIX + "ffn.experts.2.w3.weight"]
    with pytest.raises(ValueError, match=r"x\.safetensors: missing MTP tensor 'mtp\.0\.ffn\.experts\.2\.w3\.weight'"):
        dst.load_native(missing, source="x.safetensors")
    bad = dict(tensors)
    bad[MTP_PREFIX + "h_proj.weight"] = torch.zeros(32, 31)
    with pytest.raises(ValueError, match=r"'mtp\.0\.h_proj\.weight' has shape \[32, 31\], expected \[32, 32\]"):
        dst.load_native(bad)
    quant = dict(tensors)
    quant[MTP_PREFIX + "ffn.experts.0.w1.weight"] = torch.zeros(16, 32, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"'mtp\.0\.ffn\.experts\.0\.w1\.weight' is torch\.uint8; the MTP layer must be BF16/F32"
    ):
        dst.load_native(quant)
    extra = dict(tensors)
    extra[MTP_PREFIX + "attn.compressor.ape"] = torch.zeros(4, 128)
    with pytest.raises(ValueError, match=r"unexpected MTP tensor 'mtp\.0\.attn\.compressor\.ape'"):
        dst.load_native(extra)
    with pytest.raises(ValueError, match=r"no MTP weights \(mtp\.0\.\*\) found"):
        dst.load_native({"embed.weight": torch.zeros(64, 32)}, source="ckpt")


def test_from_checkpoint_reads_native_files(tmp_path):
    from safetensors.torch import save_file

    src = make_mtp(0)
    tensors = {k: v.contiguous() for k, v in src.native_state_dict().items()}
    tensors["embed.weight"] = src.embed.weight.detach().clone()
    tensors["head.weight"] = src.head.weight.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(src.config.to_dict()))
    loaded = ReferenceMTP.from_checkpoint(tmp_path)
    H, ids = inputs(L=10)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_steps(H, ids[:, :10], 2)[1], src.forward_steps(H, ids[:, :10], 2)[1])
    del tensors["head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'head\.weight' \(the MTP layer shares it with the target\)"):
        ReferenceMTP.from_checkpoint(tmp_path)
