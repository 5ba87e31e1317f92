"""``cpu/linear.py``: the plugin's CPU GEMMs for its own matrices (experts, ``wo_a``), and the float32 route
for 16-bit weights on CPUs without a 16-bit dot-product instruction."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from vllm_dsv4_mtp.cpu import linear as cl
from vllm_dsv4_mtp.cpu.kit import KIT


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo has no flags line")


def test_native_gemm_follows_the_cpu_flags():
    """On x86 bfloat16 counts as native exactly where the kernel reports AVX512-BF16 or AMX, float16 where it
    reports AMX-FP16 (torch's feature queries against the flags the kernel lists); elsewhere vLLM's dispatch
    keeps deciding, so both count as native."""
    if platform.machine() != "x86_64":
        assert KIT.native_gemm(torch.bfloat16) and KIT.native_gemm(torch.float16)
        return
    flags = _cpu_flags()
    assert KIT.native_gemm(torch.bfloat16) == bool({"avx512_bf16", "amx_bf16", "amx_tile"} & flags)
    assert KIT.native_gemm(torch.float16) == ("amx_fp16" in flags)
    with pytest.raises(ValueError, match="float32"):
        KIT.native_gemm(torch.float32)


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
    ulp = (
        fi.eps * exact.abs()
        + fi.smallest_normal * fi.eps
        + w.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T)
    )

    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)
    got = cl.cpu_linear(w.clone())(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    assert torch.equal(got, once)
    assert ((got.double() - exact).abs() <= ulp).all()

    monkeypatch.setattr(KIT, "native_gemm", lambda d: True)
    vllm_route = cl.cpu_linear(w.clone())(x)
    assert vllm_route.dtype == dtype
    assert ((vllm_route.double() - exact).abs() <= ulp).all()


def test_float32_weights_keep_vllms_dispatch(monkeypatch):
    """The route is for 16-bit weights only: a float32 linear is vLLM's dispatch whatever the CPU."""
    x, w = _operands(torch.float32, 7)
    monkeypatch.setattr(KIT, "native_gemm", lambda d: pytest.fail("asked for a float32 weight"))
    got = cl.cpu_linear(w.clone())(x)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-6, atol=1e-6)


def _vllm_linears(w, prepared, process=True, prefix=""):
    """One of each vLLM linear class the portable model builds, each with the weight ``w: [160, 96]``; with
    ``prepared``, through ``prepared_linear``. ``process``: what vLLM does after loading, its per-layer
    processing, then (``prepared``) the model's ``prepare_weights``."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    wrap = cl.prepared_linear if prepared else (lambda layer: layer)
    torch.set_default_dtype(w.dtype)
    try:
        layers = {
            "replicated": ReplicatedLinear(96, 160, bias=False, return_bias=False, prefix=f"{prefix}replicated"),
            "merged": MergedColumnParallelLinear(96, [64, 96], bias=False, return_bias=False, prefix=f"{prefix}merged"),
            "column": ColumnParallelLinear(96, 160, bias=False, return_bias=False, prefix=f"{prefix}column"),
            "row": RowParallelLinear(96, 160, bias=False, return_bias=False, prefix=f"{prefix}row"),
        }
        layers = {name: wrap(layer) for name, layer in layers.items()}
    finally:
        torch.set_default_dtype(torch.float32)
    for layer in layers.values():
        layer.weight.data.copy_(w)
        if process:
            layer.quant_method.process_weights_after_loading(layer)
    if process and prepared:
        cl.prepare_weights(torch.nn.ModuleList(layers.values()))
    return layers


@pytest.mark.usefixtures("vllm_dist")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_models_vllm_linears_take_the_float32_route_where_the_cpu_has_no_16bit_gemm(dtype, monkeypatch):
    """``prepare_weights`` gives vLLM's linear classes the float32 route: without a 16-bit GEMM each is the float32
    product rounded once, bit for bit (64 rows: where torch's 16-bit fallback is 10-15x slower on an AVX2 CPU);
    with one, exactly what vLLM's own unquantized method computes for the same weights (the same dispatch). The
    loaded weight stays as loaded either way, and preparing again changes nothing."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    x, w = _operands(dtype, 64)
    once = F.linear(x.float(), w.float()).to(dtype)

    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)
    layers = _vllm_linears(w, prepared=True)
    for _ in range(2):
        for name, layer in layers.items():
            assert isinstance(layer.quant_method, UnquantizedLinearMethod), name  # what vLLM's own code tests for
            assert torch.equal(layer.float32_weight, w.float()), name
            assert torch.equal(layer.weight, w), name
            got = layer(x)
            assert got.dtype == dtype and torch.equal(got, once), name
        cl.prepare_weights(torch.nn.ModuleList(layers.values()))

    monkeypatch.setattr(KIT, "native_gemm", lambda d: True)
    plain = _vllm_linears(w, prepared=False)
    for name, layer in _vllm_linears(w, prepared=True).items():
        assert layer.float32_weight is None and torch.equal(layer.weight, w), name
        assert torch.equal(layer(x), plain[name](x)), name


@pytest.mark.usefixtures("vllm_dist")
def test_float32_linears_compute_what_vllms_unquantized_method_computes(monkeypatch):
    """The float32 parity engines: a prepared float32 linear is vLLM's own dispatch, whatever the CPU."""
    x, w = _operands(torch.float32, 7)
    monkeypatch.setattr(KIT, "native_gemm", lambda d: pytest.fail("asked for a float32 weight"))
    plain = _vllm_linears(w, prepared=False)
    for name, layer in _vllm_linears(w, prepared=True).items():
        assert layer.float32_weight is None and torch.equal(layer.weight, w), name
        assert torch.equal(layer(x), plain[name](x)), name


@pytest.mark.usefixtures("vllm_dist")
def test_the_linears_load_through_the_same_vllm_loaders_as_unquantized_ones():
    """vLLM picks a linear's weight loader by its method's class name when it builds the layer: a prepared one gets
    the loader it gets unprepared (the v2 loaders for the parallel ones), and shards land in the same rows."""
    _, w = _operands(torch.bfloat16, 1)
    plain, routed = _vllm_linears(w, False, process=False), _vllm_linears(w, True, process=False)
    for name in plain:
        assert routed[name].weight.weight_loader.__name__ == plain[name].weight.weight_loader.__name__, name
    assert {n: routed[n].weight.weight_loader.__name__ for n in ("merged", "column", "row")} == dict.fromkeys(
        ("merged", "column", "row"), "weight_loader_v2"
    )
    # the merged layer's two shards (64 and 96 rows) through each loader: the same rows either way
    shards = (w[:64] * 2, w[64:] * 3)
    for layers in (plain, routed):
        m = layers["merged"]
        for shard_id, shard in enumerate(shards):
            m.weight.weight_loader(m.weight, shard, shard_id)
    assert torch.equal(routed["merged"].weight, plain["merged"].weight)
    assert torch.equal(routed["merged"].weight, torch.cat(shards))


@pytest.mark.usefixtures("vllm_dist")
def test_a_linear_used_before_prepare_weights_is_an_error_naming_it(monkeypatch):
    """vLLM's own processing leaves a prepared linear's weight as loaded (its CPU method would pack it away); a
    forward before ``prepare_weights`` names the layer instead of computing with something unprepared. A layer
    vLLM built with another method (a quant config's) is refused by ``prepared_linear``."""
    x, w = _operands(torch.bfloat16, 3)
    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)
    layers = _vllm_linears(w, prepared=True, process=False, prefix="model.layers.1.attn.")
    for name, layer in layers.items():
        layer.quant_method.process_weights_after_loading(layer)
        assert torch.equal(layer.weight, w), name
        with pytest.raises(RuntimeError, match=rf"model\.layers\.1\.attn\.{name}: no GEMM prepared; prepare_weights"):
            layer(x)
    odd = layers["row"]
    odd.quant_method = object()
    with pytest.raises(TypeError, match=r"model\.layers\.1\.attn\.row: object, expected vLLM's unquantized"):
        cl.prepared_linear(odd)
