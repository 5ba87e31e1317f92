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


def _vllm_linears(w, quant_config, process=True):
    """One of each vLLM linear class the portable model builds, each with the weight ``w: [160, 96]``."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    torch.set_default_dtype(w.dtype)
    try:
        layers = {
            "replicated": ReplicatedLinear(96, 160, bias=False, quant_config=quant_config, return_bias=False),
            "merged": MergedColumnParallelLinear(
                96, [64, 96], bias=False, quant_config=quant_config, return_bias=False
            ),
            "column": ColumnParallelLinear(96, 160, bias=False, quant_config=quant_config, return_bias=False),
            "row": RowParallelLinear(96, 160, bias=False, quant_config=quant_config, return_bias=False),
        }
    finally:
        torch.set_default_dtype(torch.float32)
    for layer in layers.values():
        layer.weight.data.copy_(w)
        if process:
            layer.quant_method.process_weights_after_loading(layer)
    return layers


@pytest.mark.usefixtures("vllm_dist")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_models_vllm_linears_take_the_float32_route_where_the_cpu_has_no_16bit_gemm(dtype, monkeypatch):
    """``LINEARS`` gives vLLM's linear classes the float32 route: without a 16-bit GEMM each is the float32
    product rounded once, bit for bit (64 rows: where torch's 16-bit fallback is 10-15x slower on an AVX2 CPU);
    with one, exactly what vLLM's own unquantized method computes for the same weights (the same dispatch)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    x, w = _operands(dtype, 64)
    once = F.linear(x.float(), w.float()).to(dtype)

    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)
    for name, layer in _vllm_linears(w, cl.LINEARS).items():
        assert isinstance(layer.quant_method, UnquantizedLinearMethod), name  # what vLLM's own code tests for
        assert torch.equal(layer.float32_weight, w.float()), name
        # emptied as vLLM's dispatch empties a packed weight; processing twice keeps the copy
        assert layer.weight.numel() == 0 and layer.weight.dtype == dtype, name
        layer.quant_method.process_weights_after_loading(layer)
        got = layer(x)
        assert got.dtype == dtype and torch.equal(got, once), name

    monkeypatch.setattr(KIT, "native_gemm", lambda d: True)
    plain = _vllm_linears(w, None)
    for name, layer in _vllm_linears(w, cl.LINEARS).items():
        assert not hasattr(layer, "float32_weight"), name
        assert torch.equal(layer(x), plain[name](x)), name


@pytest.mark.usefixtures("vllm_dist")
def test_float32_linears_keep_vllms_unquantized_method(monkeypatch):
    """The float32 parity engines: ``LINEARS`` changes nothing for float32 weights, whatever the CPU."""
    x, w = _operands(torch.float32, 7)
    monkeypatch.setattr(KIT, "native_gemm", lambda d: pytest.fail("asked for a float32 weight"))
    plain = _vllm_linears(w, None)
    for name, layer in _vllm_linears(w, cl.LINEARS).items():
        assert not hasattr(layer, "float32_weight"), name
        assert torch.equal(layer(x), plain[name](x)), name


@pytest.mark.usefixtures("vllm_dist")
def test_the_linears_load_through_the_same_vllm_loaders_as_unquantized_ones():
    """vLLM picks a linear's weight loader by its method's class name: with ``LINEARS`` each class gets the loader
    it gets without a quant_config (the v2 loaders for the parallel ones), and shards land in the same rows."""
    _, w = _operands(torch.bfloat16, 1)
    plain, routed = _vllm_linears(w, None, process=False), _vllm_linears(w, cl.LINEARS, process=False)
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
@pytest.mark.parametrize("dtype, route", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_a_kept_layer_keeps_its_loaded_weight_through_processing_and_computes_the_same(dtype, route, monkeypatch):
    """What a pack of the model reads after vLLM has processed a layer (its in-place reload processes each layer
    before the model's ``load_weights`` packs): a layer marked by ``keep_loaded_weight`` still holds its loaded
    weight, where an unmarked one has it emptied (the float32 route's copy; vLLM's float32 dispatch, which packs
    on x86), and computes exactly what the unmarked one computes, also processed twice; bf16 off the route is the
    branch AVX512-BF16 / AMX CPUs take. ``loaded_weight`` of an unmarked layer is an error naming it, whatever
    state its weight is in."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    x, w = _operands(dtype, 5)
    monkeypatch.setattr(KIT, "native_gemm", lambda d: not route)
    plain = _vllm_linears(w, cl.LINEARS)
    kept = _vllm_linears(w, cl.LINEARS, process=False)
    for name, layer in kept.items():
        if route or dtype == torch.float32:  # (vLLM's bf16 dispatch keeps the weight where it falls back to torch)
            assert plain[name].weight.numel() == 0, name  # the hazard: processing empties an unmarked weight
        for _ in range(2):  # vLLM may process a layer more than once (its reload does, after the first load)
            cl.keep_loaded_weight(layer).quant_method.process_weights_after_loading(layer)
            got = cl.loaded_weight(layer)
            assert got.dtype == dtype and torch.equal(got, w), name
            assert torch.equal(layer(x), plain[name](x)), name
            assert (getattr(layer, "float32_weight", None) is not None) == route, name
    torch.set_default_dtype(dtype)
    try:
        unmarked = RowParallelLinear(
            96,
            160,
            bias=False,
            quant_config=cl.LINEARS,
            return_bias=False,
            prefix="model.layers.1.ffn.shared_experts.down_proj",
        )
    finally:
        torch.set_default_dtype(torch.float32)
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.ffn\.shared_experts\.down_proj: .*keep_loaded_weight"):
        cl.loaded_weight(unmarked)  # before processing too: the pack would fail on a reload only
