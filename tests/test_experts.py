"""The portable routed experts: implementation choice, how MXFP4 bytes are loaded, TP split, and the
portable quantization config that claims DeepSeek-V4 checkpoints off gfx950."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dsv4_mtp.formats import mxfp4
from vllm_dsv4_mtp.kernels import experts, portable_quant


def test_this_cpu_gets_the_portable_implementations():
    assert experts.select_experts_impl("mxfp4") == experts.PORTABLE_MXFP4
    assert experts.select_experts_impl("bf16") == experts.PORTABLE_BF16
    with pytest.raises(ValueError, match="unknown routed-expert format 'fp8'"):
        experts.select_experts_impl("fp8")


def test_portable_quant_config_claims_dsv4_only_off_gfx950():
    quark = {"quant_method": "quark"}
    dsv4 = SimpleNamespace(model_type="deepseek_v4", compress_ratios=[0, 4], hc_mult=4)
    draft = SimpleNamespace(model_type="deepseek_mtp", compress_ratios=[0, 4], hc_mult=4)
    v3 = SimpleNamespace(model_type="deepseek_v3")
    assert portable_quant.claims(quark, dsv4, gfx950=False)
    assert portable_quant.claims({"quant_method": "fp8"}, dsv4, gfx950=False)
    assert portable_quant.claims(quark, draft, gfx950=False)
    assert not portable_quant.claims(quark, dsv4, gfx950=True)  # gfx950: vLLM's QuarkConfig (AITER)
    assert not portable_quant.claims(quark, v3, gfx950=False)
    assert not portable_quant.claims({"quant_method": "awq"}, dsv4, gfx950=False)
    assert not portable_quant.claims(None, dsv4, gfx950=False)


def test_mxfp4_bytes_are_loaded_verbatim():
    """Packed codes (Quark uint8 or official int8) and E8M0 scales (uint8 or float8_e8m0fnu) are moved as raw
    bytes; a numeric cast of an E8M0 tensor would turn 2**0 (byte 127) into 1."""
    ex = experts.Mxfp4Experts(num_experts=2, hidden_size=64, intermediate_size=32, swiglu_limit=10.0)
    w = torch.randn(32, 64)
    packed, scales = mxfp4.quantize(w)
    ex.load("e.1.w1.weight", 1, "w1", "weight", packed.view(torch.int8))
    ex.load("e.1.w1.scale", 1, "w1", "scale", scales.view(torch.float8_e8m0fnu))
    assert torch.equal(ex.w13_weight[1, :32], packed)
    assert torch.equal(ex.w13_weight_scale[1, :32], scales)
    assert int(scales.max()) > 100  # real E8M0 bytes, which a numeric cast would have destroyed
    with pytest.raises(ValueError, match=r"e\.1\.w1\.weight_scale: MXFP4 scale must be uint8 or float8_e8m0fnu"):
        ex.load("e.1.w1.weight_scale", 1, "w1", "weight_scale", scales.float())
    with pytest.raises(ValueError, match=r"e\.0\.w2\.weight: expected shape \(64, 16\), got \(64, 32\)"):
        ex.load("e.0.w2.weight", 0, "w2", "weight", torch.zeros(64, 32, dtype=torch.uint8))


def test_tensor_parallel_split_of_the_intermediate_dim():
    """Rank r of 2 holds rows [16r, 16r+16) of w1/w3 and the matching columns (bytes) of w2."""
    full = experts.Mxfp4Experts(num_experts=1, hidden_size=64, intermediate_size=64, swiglu_limit=10.0)
    parts = [experts.Mxfp4Experts(num_experts=1, hidden_size=64, intermediate_size=64, swiglu_limit=10.0,
                                  tp_rank=r, tp_size=2) for r in range(2)]
    for shard, shape in (("w1", (64, 64)), ("w3", (64, 64)), ("w2", (64, 64))):
        packed, scales = mxfp4.quantize(torch.randn(shape))
        for m in [full, *parts]:
            m.load(f"x.{shard}", 0, shard, "weight", packed)
            m.load(f"x.{shard}", 0, shard, "weight_scale", scales)
    x = torch.randn(5, 64)
    w, ids = torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.long)
    torch.testing.assert_close(parts[0](x, w, ids) + parts[1](x, w, ids), full(x, w, ids), atol=1e-4, rtol=1e-5)
