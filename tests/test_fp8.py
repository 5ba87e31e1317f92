"""FP8 e4m3 128x128 block-scaled weights: decode (official F8_E8M0 / Quark / float32 scales) and the encoder."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dsv4_mtp.formats import fp8

torch.set_num_threads(1)


def test_partial_edge_blocks_get_their_own_scale():
    # [200, 300]: blocks of rows [0,128) [128,200) x cols [0,128) [128,256) [256,300)
    w = torch.ones(200, 300).to(torch.float8_e4m3fn)
    scale = torch.tensor([[120, 121, 122], [123, 124, 125]], dtype=torch.uint8)  # 2**-7 .. 2**-2
    out = fp8.dequantize_block_fp8(w, scale, dtype=torch.float32)
    assert out.shape == (200, 300)
    for bi, rows in enumerate((slice(0, 128), slice(128, 200))):
        for bj, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
            want = 2.0 ** (scale[bi, bj].item() - 127)
            assert torch.all(out[rows, cols] == want), (bi, bj)


def test_values_are_weight_times_scale_exactly():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(130, 257, generator=g) * 50).to(torch.float8_e4m3fn)
    scale_bytes = torch.randint(100, 140, fp8.block_scale_shape(w.shape), generator=g, dtype=torch.int64).to(
        torch.uint8
    )
    ref = torch.empty(130, 257, dtype=torch.float64)
    wf = w.to(torch.float64)
    for bi in range(scale_bytes.shape[0]):
        for bj in range(scale_bytes.shape[1]):
            r, c = slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128)
            ref[r, c] = wf[r, c] * math.ldexp(1.0, scale_bytes[bi, bj].item() - 127)
    got32 = fp8.dequantize_block_fp8(w, scale_bytes, dtype=torch.float32)
    assert torch.equal(got32.double(), ref)  # exact
    got = fp8.dequantize_block_fp8(w, scale_bytes)  # default bfloat16, also exact (e4m3 has 3 mantissa bits)
    assert got.dtype == torch.bfloat16 and torch.equal(got.double(), ref)


def test_e8m0_raw_bytes_and_float_scales_agree():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(256, 384, generator=g)).to(torch.float8_e4m3fn)
    b = torch.randint(110, 130, (2, 3), generator=g, dtype=torch.int64).to(torch.uint8)
    as_u8 = fp8.dequantize_block_fp8(w, b)
    as_e8m0 = fp8.dequantize_block_fp8(w, b.view(torch.float8_e8m0fnu))
    as_f32 = fp8.dequantize_block_fp8(w, torch.exp2(b.float() - 127))  # e.g. float32 weight_scale_inv
    assert torch.equal(as_u8, as_e8m0) and torch.equal(as_u8, as_f32)
    # 255 is NaN in E8M0: that block decodes to NaN, never to a huge finite number
    b[1, 2] = 255
    out = fp8.dequantize_block_fp8(w, b, dtype=torch.float32)
    assert out[128:, 256:].isnan().all() and not out[:128].isnan().any()


def test_official_layout_through_safetensors(tmp_path):
    """F8_E4M3 weight + F8_E8M0 ``.scale`` as the DeepSeek release stores them, read back from a file."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g) * 0.05
    q, s = fp8.quantize_block_fp8(w)
    path = tmp_path / "shard.safetensors"
    save_file({"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": s.view(torch.float8_e8m0fnu)}, path)
    loaded = load_file(path)
    assert loaded["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    out = fp8.dequantize_block_fp8(loaded["layers.0.attn.wq_a.weight"], loaded["layers.0.attn.wq_a.scale"])
    assert torch.equal(out, fp8.dequantize_block_fp8(q, s))
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of the value, plus the block's subnormal floor
    err = (out.float() - w).abs()
    assert torch.all(err <= w.abs() * 2**-4 + 2**-9 * fp8.scale_to_float(s).max())


def test_encoder_round_trip_and_scale_rule():
    # values already on the e4m3 grid of a power-of-two scale come back exactly
    g = torch.Generator().manual_seed(3)
    grid = (torch.randn(256, 256, generator=g) * 100).to(torch.float8_e4m3fn).float()
    grid[0, 0] = 448.0  # amax 448 -> scale exactly 1 in every block that holds it
    w = grid * 2.0**-10
    q, s = fp8.quantize_block_fp8(w)
    assert s.dtype == torch.uint8 and s.shape == (2, 2)
    assert s[0, 0].item() == 127 - 10
    assert torch.equal(fp8.dequantize_block_fp8(q, s, dtype=torch.float32)[:128, :128], w[:128, :128])
    # ue8m0 rule: smallest power of two >= amax / 448
    # (amax is clamped at 1e-4 first, as the reference quantizer does: 1e-4 / 448 -> 2**-22)
    for amax, byte in ((448.0, 127), (449.0, 128), (224.0, 126), (300.0, 127), (1e-30, 127 - 22)):
        x = torch.zeros(128, 128)
        x[5, 7] = amax
        assert fp8.quantize_block_fp8(x)[1].item() == byte, amax
    # float32 scales: amax / 448 exactly
    q32, s32 = fp8.quantize_block_fp8(w, scale_format="float32")
    assert s32.dtype == torch.float32
    assert torch.allclose(s32, w.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3)) / 448)
    # all-zero blocks decode to zeros
    z, zs = fp8.quantize_block_fp8(torch.zeros(130, 10))
    assert zs.shape == (2, 1) and fp8.dequantize_block_fp8(z, zs).eq(0).all()


def test_errors_name_the_tensor():
    w = torch.zeros(256, 300).to(torch.float8_e4m3fn)
    with pytest.raises(
        ValueError,
        match=r"layers\.3\.attn\.wo_a\.weight: FP8 block scale shape \(2, 2\) does not "
        r"match weight shape \(256, 300\): expected \(2, 3\)",
    ):
        fp8.dequantize_block_fp8(w, torch.zeros(2, 2, dtype=torch.uint8), name="layers.3.attn.wo_a.weight")
    with pytest.raises(TypeError, match=r"mtp\.0\.e_proj\.weight: FP8 block weight must be float8_e4m3fn"):
        fp8.dequantize_block_fp8(torch.zeros(256, 300), torch.zeros(2, 3), name="mtp.0.e_proj.weight")
    with pytest.raises(TypeError, match=r"x\.weight: FP8 block scale dtype torch\.int32"):
        fp8.dequantize_block_fp8(w, torch.zeros(2, 3, dtype=torch.int32), name="x.weight")
    with pytest.raises(ValueError, match="2-D"):
        fp8.dequantize_block_fp8(torch.zeros(2, 3, 4).to(torch.float8_e4m3fn), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="scale_format"):
        fp8.quantize_block_fp8(torch.zeros(4, 4), scale_format="e4m3")


def test_non_contiguous_inputs():
    """Transposed views and column slices (e.g. a tensor-parallel shard) decode and encode like their copies,
    with and without partial edge blocks."""
    g = torch.Generator().manual_seed(4)
    for rows, cols in ((256, 384), (300, 260)):
        wt = torch.randn(cols, rows, generator=g).t()  # [rows, cols], column-major
        assert not wt.is_contiguous()
        qt, st = fp8.quantize_block_fp8(wt)
        qc, sc = fp8.quantize_block_fp8(wt.contiguous())
        assert torch.equal(qt.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(st, sc)
        q_view = qc.t().contiguous().t()  # the same FP8 values, column-major
        assert not q_view.is_contiguous()
        assert torch.equal(fp8.dequantize_block_fp8(q_view, sc), fp8.dequantize_block_fp8(qc, sc))
        shard = qc[:, :128]
        assert torch.equal(
            fp8.dequantize_block_fp8(shard, sc[:, :1]), fp8.dequantize_block_fp8(shard.contiguous(), sc[:, :1])
        )
