"""``model/cpu_linear.py``: the plugin's CPU GEMMs for its own matrices (experts, ``wo_a``), and the float32 route
for 16-bit weights on CPUs without a 16-bit dot-product instruction."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from vllm_dsv4_mtp.model import cpu_linear as cl


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo has no flags line")


def test_native_16bit_gemm_follows_the_cpu_flags():
    """On x86 bfloat16 counts as native exactly where the kernel reports AVX512-BF16 or AMX, float16 where it
    reports AMX-FP16 (torch's feature queries against the flags the kernel lists); elsewhere vLLM's dispatch
    keeps deciding, so both count as native."""
    if platform.machine() != "x86_64":
        assert cl.native_16bit_gemm(torch.bfloat16) and cl.native_16bit_gemm(torch.float16)
        return
    flags = _cpu_flags()
    assert cl.native_16bit_gemm(torch.bfloat16) == bool({"avx512_bf16", "amx_bf16", "amx_tile"} & flags)
    assert cl.native_16bit_gemm(torch.float16) == ("amx_fp16" in flags)
    with pytest.raises(ValueError, match="float32"):
        cl.native_16bit_gemm(torch.float32)


def _operands(dtype, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 96, generator=g).to(dtype), (torch.randn(160, 96, generator=g) * 0.1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_without_native_16bit_gemm_a_16bit_linear_is_the_float32_product_rounded_once(dtype, rows, monkeypatch):
    """Where the CPU has no 16-bit GEMM the linear is the float32 product of the same values rounded once to the
    weight's dtype, bit for bit, and so within one rounding of the exact (float64) product; where it has one,
    vLLM's dispatch, which agrees to the same bound."""
    x, w = _operands(dtype, rows)
    exact = x.double() @ w.double().T
    once = F.linear(x.float(), w.float()).to(dtype)
    # one rounding to dtype (its eps relative; its subnormal spacing near 0), plus float32 accumulation
    fi = torch.finfo(dtype)
    ulp = (fi.eps * exact.abs() + fi.smallest_normal * fi.eps
           + w.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T))

    monkeypatch.setattr(cl, "native_16bit_gemm", lambda d: False)
    got = cl.cpu_linear(w.clone())(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    assert torch.equal(got, once)
    assert ((got.double() - exact).abs() <= ulp).all()

    monkeypatch.setattr(cl, "native_16bit_gemm", lambda d: True)
    vllm_route = cl.cpu_linear(w.clone())(x)
    assert vllm_route.dtype == dtype
    assert ((vllm_route.double() - exact).abs() <= ulp).all()


def test_float32_weights_keep_vllms_dispatch(monkeypatch):
    """The route is for 16-bit weights only: a float32 linear is vLLM's dispatch whatever the CPU."""
    x, w = _operands(torch.float32, 7)
    monkeypatch.setattr(cl, "native_16bit_gemm", lambda d: pytest.fail("asked for a float32 weight"))
    got = cl.cpu_linear(w.clone())(x)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-6, atol=1e-6)
