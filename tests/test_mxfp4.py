"""OCP MXFP4 codec: round trips and shape rules here; bit-exactness against amd-quark 0.13 (marked ``quark``).

The Quark oracles are Quark's own code paths, not re-implementations:
- quantizer: ``file2file_quantization._single_stage_quantize_weight``, the function that writes every MXFP4
  weight in ``direct_quantize_checkpoint`` (observer -> ``scaled_real_quantize`` -> ``Pack_fp4`` ->
  ``to_e8m0_uint8``), with the ``OCP_MXFP4Spec(is_dynamic=False)`` weight spec of the AMD export;
- dequantizer: ``StaticScaledRealQuantizer`` in real-quantized mode (what Quark uses to load its exports);
- fake-quant: ``fake_quantize_mx(..., scale_calculation_mode="even")`` and the dynamic MXFP4 activation
  quantizer built from ``OCP_MXFP4Spec(is_dynamic=True)`` (the W4A4 input spec), run in float32.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from vllm_dsv4_mtp.formats import mxfp4

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------------------
# codec behaviour (no Quark)
# ----------------------------------------------------------------------------------------------------------


def test_pack_unpack_every_byte():
    every = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    codes = mxfp4.unpack_codes(every)
    assert codes.shape == (2, 256)
    assert torch.equal(codes[:, 0::2], every & 0x0F)  # low nibble = even element
    assert torch.equal(codes[:, 1::2], every >> 4)
    assert torch.equal(mxfp4.pack_codes(codes), every)
    assert torch.equal(mxfp4.unpack_codes(every.view(torch.int8)), codes)


def test_unpack_e2m1_values_and_order():
    packed = torch.tensor([0x21, 0xF7, 0x08], dtype=torch.uint8)
    vals = mxfp4.unpack_e2m1(packed)
    assert vals.tolist() == [0.5, 1.0, 6.0, -6.0, -0.0, 0.0]
    assert math.copysign(1.0, vals[4].item()) == -1.0  # code 8 decodes to -0.0


def test_e8m0_every_byte():
    b = torch.arange(256, dtype=torch.uint8)
    f = mxfp4.e8m0_to_float(b)
    assert f.dtype == torch.float32
    assert math.isnan(f[255].item())
    for byte in range(255):
        assert f[byte].item() == math.ldexp(1.0, byte - 127), byte
    assert f[0].item() == 2.0**-127  # a float32 subnormal, not flushed
    if hasattr(torch, "float8_e8m0fnu"):  # the dtype safetensors' F8_E8M0 loads as
        assert torch.equal(mxfp4.e8m0_to_float(b.view(torch.float8_e8m0fnu))[:255], f[:255])


def test_scale_rule_examples():
    amax = torch.tensor([0.0, 1.0, 1.5, 1.74, 1.75, 6.0, 7.0, 2.0**127, 3.4e38, math.inf, math.nan, 2.0**-125])
    # 1.75 -> exponent -1 (byte 126), not floor(log2) - 2 = -2; 7 -> 1; inf and overflow -> 254; NaN -> 255
    assert mxfp4.e8m0_scale_even(amax).tolist() == [1, 125, 125, 125, 126, 127, 128, 252, 254, 254, 255, 0]


def test_grid_values_are_fixed_points():
    grid = torch.tensor(mxfp4.E2M1_VALUES[:8] + mxfp4.E2M1_VALUES[9:])  # 15 distinct values, amax 6
    for k in (-100, -3, 0, 5, 100):
        x = torch.cat([grid, grid.flip(0), torch.tensor([6.0, 0.0])]).reshape(1, 32) * 2.0**k
        p, s = mxfp4.quantize(x)
        assert s.item() == 127 + k
        assert torch.equal(mxfp4.dequantize(p, s), x)


def test_ties_to_even_and_saturation():
    # amax 6 fixes the scale at 1; ties: .25->0 .75->1 1.25->1 1.75->2 2.5->2 3.5->4 5->4
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
    x = torch.tensor(row + [0.0] * 17).reshape(1, 32)
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert mxfp4.fake_quant(x)[0, :15].tolist() == want
    # amax 7 -> scale 2 (even rule, significand 1.75): 7 -> 3.5 -> 4 -> 8; 6.5 -> 3.25 -> 3 -> 6
    y = torch.tensor([[7.0, 6.5] + [0.0] * 30])
    assert mxfp4.fake_quant(y)[0, :2].tolist() == [8.0, 6.0]
    z = torch.tensor([[1.74, 1.73] + [0.0] * 30])  # scale 0.25: 6.96 and 6.92 saturate to 6 -> 1.5
    assert mxfp4.fake_quant(z)[0, :2].tolist() == [1.5, 1.5]


def test_leading_dims_and_dtypes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 64, generator=g)
    p, s = mxfp4.quantize(x)
    assert p.shape == (3, 4, 5, 32) and s.shape == (3, 4, 5, 2)
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8
    p2, s2 = mxfp4.quantize(x.reshape(-1, 64))
    assert torch.equal(p.reshape(-1, 32), p2) and torch.equal(s.reshape(-1, 2), s2)
    assert torch.equal(mxfp4.dequantize(p, s), mxfp4.fake_quant(x))
    assert mxfp4.dequantize(p, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    xb = x.to(torch.bfloat16)
    fq = mxfp4.fake_quant(xb)
    assert fq.dtype == torch.bfloat16 and fq.shape == x.shape
    assert torch.equal(fq, mxfp4.dequantize(*mxfp4.quantize(xb), dtype=torch.bfloat16))
    # a 1-D vector is one row
    assert torch.equal(mxfp4.quantize(x[0, 0, 0])[0], p[0, 0, 0])


def _round_trip_blocks() -> list[torch.Tensor]:
    """Every E2M1 tie and grid point (and just either side of some), at binades from subnormal scales to the
    top, with both signs; inf / NaN / signed zeros; random data at scales from 1e-30 to 1e30."""
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(64, 256, generator=g) * s for s in (1e-30, 1e-3, 1.0, 7.0, 1e3, 1e30)]
    grid = [
        0.0,
        0.25,
        0.5,
        0.75,
        1.0,
        1.25,
        1.5,
        1.75,
        2.0,
        2.5,
        3.0,
        3.5,
        4.0,
        5.0,
        5.9,
        6.0,
        6.5,
        0.2500001,
        0.2499999,
        2.4999998,
        2.5000002,
        4.9999995,
        5.0000005,
    ]
    row = torch.tensor((grid + [6.0] * 32)[:32])
    for e in (-130, -127, -126, -10, 0, 10, 120, 126):
        out.append(torch.stack([row, -row]) * 2.0**e)
    inf, nan = float("inf"), float("nan")
    out.append(torch.tensor([[inf, 1.0] + [0.5] * 30, [nan] + [1.0] * 31, [-inf] + [-0.0] * 31, [0.0] * 32]))
    out.append(-torch.zeros(2, 32))
    return out


def _assert_fake_quant_is_the_round_trip(x: torch.Tensor) -> None:
    got = mxfp4.fake_quant(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    got = got.float()
    want = mxfp4.dequantize(*mxfp4.quantize(x), dtype=torch.float32).to(x.dtype).float()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), (x[~same][:4], got[~same][:4], want[~same][:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_is_quantize_then_dequantize_bit_for_bit(dtype):
    """fake_quant rounds on the grid without forming codes; it must equal the codec's round trip in every bit
    (the sign of zero included: Quark writes +0.0), NaN where the codec gives NaN: on the corner blocks of both
    sets here and on random float32 bit patterns."""
    raw = (
        torch.randint(-(2**31), 2**31 - 1, (1024, 256), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    for x in [*_round_trip_blocks(), _edge_blocks(), raw]:
        _assert_fake_quant_is_the_round_trip(x.to(dtype))


def test_fake_quant_on_every_bfloat16_pattern():
    """Every bfloat16 bit pattern (the model's activations are bfloat16): in order (blocks of neighbouring
    patterns, NaN and inf among them), alone in a block of zeros (its own scale), and shuffled among the finite
    ones (every kind of neighbour, both signs)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    _assert_fake_quant_is_the_round_trip(every.reshape(-1, 32))
    alone = torch.zeros(every.numel(), 32, dtype=torch.bfloat16)
    alone[:, 7] = every
    _assert_fake_quant_is_the_round_trip(alone)
    finite = every[every.isfinite()]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        _assert_fake_quant_is_the_round_trip(finite[torch.randperm(finite.numel(), generator=g)].reshape(-1, 64))


def test_fake_quant_is_idempotent():
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 3
    once = mxfp4.fake_quant(x)
    assert torch.equal(mxfp4.fake_quant(once), once)


def test_bad_shapes_and_dtypes_are_clear_errors():
    with pytest.raises(ValueError, match=r"last dim.*48.*not a multiple of 32"):
        mxfp4.quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        mxfp4.fake_quant(torch.zeros(31))
    with pytest.raises(TypeError, match="floating-point"):
        mxfp4.quantize(torch.zeros(2, 32, dtype=torch.int32))
    p, s = mxfp4.quantize(torch.ones(2, 64))
    with pytest.raises(ValueError, match=r"scales shape \(2, 3\) does not match packed shape \(2, 32\)"):
        mxfp4.dequantize(p, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not match"):
        mxfp4.dequantize(p, s[:1])
    with pytest.raises(TypeError, match="E8M0 scales must be raw bytes"):
        mxfp4.dequantize(p, s.float())  # a numerically cast scale would be silently wrong
    with pytest.raises(TypeError, match="packed elements must be raw bytes"):
        mxfp4.dequantize(p.float(), s)


def test_special_values_defined_behaviour():
    x = torch.zeros(5, 32)
    x[1, 0], x[1, 1] = -0.0, -0.1  # with 6.0 below: both round to +0
    x[1, 2] = 6.0
    x[2, 0], x[2, 1], x[2, 2] = math.inf, -math.inf, 1e38
    x[3, 0], x[3, 1] = math.nan, 1.0
    x[4, 0] = 2.0**-125  # a tiny block: scale 2**-127 (byte 0), element 4
    p, s = mxfp4.quantize(x)
    codes = mxfp4.unpack_codes(p)
    assert s[:, 0].tolist() == [mxfp4.E8M0_ZERO_BLOCK, 127, 254, mxfp4.E8M0_NAN, 0]
    assert codes[0].eq(0).all() and codes[3].eq(0).all()
    assert codes[1, :3].tolist() == [0, 0, 7]
    assert codes[2, :3].tolist() == [7, 15, 1]  # +-inf saturate to +-6; 1e38 / 2**127 = 0.59 -> 0.5
    assert codes[4, 0].item() == 6
    d = mxfp4.dequantize(p, s)
    assert d[0].eq(0).all() and d[0].signbit().logical_not().all()
    assert d[1, :2].signbit().logical_not().all()
    assert d[2, 0].item() == math.inf and d[2, 1].item() == -math.inf
    assert d[3].isnan().all()
    assert d[4, 0].item() == 2.0**-125
    fq = mxfp4.fake_quant(x)
    assert torch.equal(fq.isnan(), d.isnan())
    assert torch.equal(torch.nan_to_num(fq), torch.nan_to_num(d))


# ----------------------------------------------------------------------------------------------------------
# bit-exact against amd-quark 0.13
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quark():
    """amd-quark's own MXFP4 quantizer, dequantizer and fake-quant (``import quark.torch`` takes ~17 s).
    amd-quark (the `quant` extra, which `make setup` installs) is required: a missing oracle fails, never skips."""
    import quark.torch  # noqa: F401  (registers the torch.ops.quark kernels)
    from quark.torch.export.nn.modules.realquantizer import StaticScaledRealQuantizer
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_mx
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.file2file_quantization import _single_stage_quantize_weight
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

    weight_spec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    input_spec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()

    def export(x):
        """Quark's file-to-file weight writer: (packed uint8 [.., K/2], scale bytes uint8 [.., K/32])."""
        out: dict[str, torch.Tensor] = {}
        _single_stage_quantize_weight(x, "w.weight", "w", weight_spec, out, "model.safetensors")
        return out["w.weight"], out["w.weight_scale"]

    def dequant(packed, scales):
        rq = StaticScaledRealQuantizer(
            weight_spec,
            None,
            reorder=False,
            real_quantized=True,
            float_dtype=torch.float32,
            device=torch.device("cpu"),
            scale_shape=tuple(scales.shape),
        )
        rq.scale = scales.clone()  # Quark loads the exported uint8 scale bytes into this buffer
        return rq(packed)

    def fake_quant(x):
        return fake_quantize_mx(x, -1, 32, "even", mx_element_dtype="fp4")

    def act_fake_quant(x):
        return FakeQuantizeBase.get_fake_quantize(input_spec)(x)

    return types.SimpleNamespace(export=export, dequant=dequant, fake_quant=fake_quant, act_fake_quant=act_fake_quant)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit float32 equality; NaN positions must agree (their payload is not part of the contract)."""
    a, b = a.float(), b.float()
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


def _assert_export_matches(s, p, qs, qp) -> torch.Tensor:
    """Scale and packed bytes equal Quark's export, but for the one documented deviation among finite inputs:
    non-zero blocks whose scale is 2**-127 (our byte 0), where Quark's exporter clamps the byte it writes
    to 1 although it quantized with 2**-127 (its codes still equal ours). Returns that mask of blocks."""
    qs = qs.reshape(s.shape)
    tiny = s == 0
    assert torch.equal(qs[tiny], torch.ones_like(qs[tiny]))
    assert torch.equal(s[~tiny], qs[~tiny])
    assert torch.equal(p, qp.reshape(p.shape))
    return tiny


def _random_sets() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    sets = {
        "weights_normal_0.02": torch.randn(512, 1024, generator=g) * 0.02,
        "unit_normal": torch.randn(128, 1024, generator=g),
        "uniform_pm8": (torch.rand(64, 1024, generator=g) * 16 - 8),
        "student_t_outliers": torch.distributions.StudentT(2.0).sample((64, 1024)),
    }
    # every block at its own magnitude, 2**-140 .. 2**120 (subnormals to huge)
    mag = torch.exp2(torch.randint(-140, 121, (128, 32, 1), generator=g).float())
    sets["per_block_magnitudes"] = (torch.randn(128, 32, 32, generator=g) * mag).reshape(128, 1024)
    # raw float32 bit patterns: every finite value is equally likely per exponent, subnormals included
    bits = torch.randint(-(2**31), 2**31 - 1, (128, 1024), generator=g, dtype=torch.int64).to(torch.int32)
    raw = bits.view(torch.float32)
    sets["raw_float32_bits"] = torch.where(raw.isfinite(), raw, torch.zeros_like(raw))
    sets["bfloat16"] = (torch.randn(64, 1024, generator=g) * 0.05).to(torch.bfloat16)
    return sets


@pytest.mark.quark
def test_random_values_bit_exact_against_quark(quark):
    total = 0
    for name, x in _random_sets().items():
        total += x.numel()
        p, s = mxfp4.quantize(x)
        qp, qs = quark.export(x)
        assert qp.dtype == torch.uint8 and qs.dtype == torch.uint8
        tiny = _assert_export_matches(s, p, qs, qp)
        ours = mxfp4.dequantize(p, s)
        rows = ~tiny.any(dim=-1)  # Quark's loader decodes Quark's bytes; on tiny blocks they are off by 2x
        assert _same_bits(ours[rows], quark.dequant(qp[rows], qs[rows])), name
        assert _same_bits(ours, quark.dequant(p, s)), name  # Quark's loader on our bytes
        fq = quark.fake_quant(x)
        assert fq.dtype == x.dtype
        assert _same_bits(mxfp4.fake_quant(x), fq), name
        assert _same_bits(ours.to(x.dtype), fq), name
        if x.dtype == torch.float32:
            assert _same_bits(mxfp4.fake_quant(x), quark.act_fake_quant(x)), name
    assert total >= 1_000_000


def _edge_blocks() -> torch.Tensor:
    """Blocks [n, 32] at the format's corners (all finite): zeros, ties, exponent boundaries, saturation."""
    g = torch.Generator().manual_seed(7)
    blocks = [torch.zeros(32), -torch.zeros(32)]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    for k in (-130, -126, -20, -1, 0, 1, 20, 100):
        # amax 6 * 2**k fixes the scale at 2**k; every midpoint, just above and below, both signs
        row = torch.cat([torch.tensor([6.0]), mids, up, down, -mids, -up[:3]]) * 2.0**k
        blocks.append(row)
    for k in list(range(-135, -118)) + list(range(-8, 9)) + list(range(118, 128)):
        for a in (1.0, 1.5, 1.75, 1.9999):
            amax = torch.tensor(a * 2.0**k)
            for v in (amax, torch.nextafter(amax, amax * 2), torch.nextafter(amax, amax * 0)):
                if not v.isfinite() or v == 0:
                    continue
                frac = torch.rand(31, generator=g) * 2 - 1
                blocks.append(torch.cat([v.reshape(1), frac * v]))
    # saturation: amax significand just under 1.75 -> amax / scale up to 6.99 -> 6
    for a in (1.74, 1.7499, 1.6, 1.55):
        row = torch.linspace(-a, a, 32) * 2.0**3
        blocks.append(row)
    # negative zero and negatives rounding to +0 next to a large value
    blocks.append(torch.tensor([-0.0, -0.01, 0.01, -0.2, 6.0] + [-0.0] * 27))
    # the largest finite magnitudes (rounding the amax up overflows to inf -> scale 2**127)
    fmax = torch.finfo(torch.float32).max
    blocks.append(torch.tensor([fmax, -fmax, fmax / 2, 1e38, 1.0] + [0.0] * 27))
    return torch.stack(blocks)


@pytest.mark.quark
def test_edge_cases_bit_exact_against_quark(quark):
    x = _edge_blocks()
    p, s = mxfp4.quantize(x)
    qp, qs = quark.export(x)
    tiny = _assert_export_matches(s, p, qs, qp)[:, 0]
    assert tiny.any(), "the edge set must reach the 2**-127 scale"
    assert s[0, 0].item() == s[1, 0].item() == 1  # all-zero blocks: Quark's byte
    ours = mxfp4.dequantize(p, s)
    assert _same_bits(ours[~tiny], quark.dequant(qp[~tiny], qs[~tiny]))
    fq = quark.fake_quant(x)
    assert _same_bits(mxfp4.fake_quant(x), fq)
    assert _same_bits(ours, fq)  # including the tiny blocks: our byte decodes to Quark's own values
    assert _same_bits(mxfp4.fake_quant(x), quark.act_fake_quant(x))
    # the corners really are exercised: tiny, zero-block, largest finite and overflow-to-inf scale bytes
    assert {0, 1, 252, 254} <= set(s[:, 0].tolist())
    # and both sides of the exponent boundary: amax 1.75 * 2**k is one binade above its float predecessor
    for k in (-124, -3, 0, 7, 126):
        at = torch.tensor(1.75 * 2.0**k)
        pair = torch.stack([at, torch.nextafter(at, torch.tensor(0.0))])
        assert mxfp4.e8m0_scale_even(pair).tolist() == [127 + k - 1, 127 + k - 2]


@pytest.mark.quark
def test_inf_and_nan_against_quark(quark):
    rows = torch.zeros(6, 32)
    rows[0, 0] = math.inf
    rows[1, 3] = -math.inf
    rows[2, 0], rows[2, 1], rows[2, 2], rows[2, 3] = math.inf, -math.inf, 3e38, -1.0
    rows[3, 5] = math.nan
    rows[4, 0], rows[4, 1] = math.nan, math.inf
    rows[5, :] = torch.linspace(-3, 3, 32)  # an ordinary block next to them stays exact
    p, s = mxfp4.quantize(rows)
    qp, qs = quark.export(rows)
    qs = qs.reshape(s.shape)
    codes, qcodes = mxfp4.unpack_codes(p), mxfp4.unpack_codes(qp)
    # inf: Quark's scale byte (2**127) and every finite element's code match; the inf element itself is
    # saturated to +-6 here, where Quark's packer bit-extracts code 6/14 (4.0); both decode to +-inf.
    assert torch.equal(s[:3], qs[:3])
    assert s[:3, 0].tolist() == [254, 254, 254]
    is_inf = rows[:3].isinf()
    signs = rows[:3][is_inf] > 0
    assert torch.equal(codes[:3][is_inf], torch.where(signs, 7, 15).to(torch.uint8))
    assert torch.equal(qcodes[:3][is_inf], torch.where(signs, 6, 14).to(torch.uint8))
    assert torch.equal(codes[:3][~is_inf], qcodes[:3][~is_inf])
    # NaN: OCP NaN scale, zero codes (Quark writes an undefined byte: a NaN cast to int)
    assert s[3:5, 0].tolist() == [255, 255] and codes[3:5].eq(0).all()
    assert torch.equal(s[5], qs[5]) and torch.equal(p[5], qp[5])
    ours = mxfp4.dequantize(p, s)
    fq = quark.fake_quant(rows)
    assert _same_bits(ours, fq)
    assert _same_bits(mxfp4.fake_quant(rows), fq)
    assert ours[3:5].isnan().all() and fq[3:5].isnan().all()
    assert ours[0, 0].item() == math.inf and ours[1, 3].item() == -math.inf
    # Quark's own dequantizer agrees on Quark's inf bytes and ours
    assert _same_bits(quark.dequant(qp[:3], qs[:3]), ours[:3])
    assert _same_bits(quark.dequant(p[:3], s[:3]), ours[:3])


@pytest.mark.quark
def test_decoder_bit_exact_on_arbitrary_bytes(quark):
    """Every packed byte and every finite scale byte decode as Quark's loader decodes them."""
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4096, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    packed[:16] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scales = torch.randint(0, 255, (4096, 1), generator=g, dtype=torch.int64).to(torch.uint8)
    scales[:255, 0] = torch.arange(255, dtype=torch.uint8)
    assert _same_bits(mxfp4.dequantize(packed, scales), quark.dequant(packed, scales))
