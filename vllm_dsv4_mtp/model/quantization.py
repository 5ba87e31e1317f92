"""What a checkpoint's ``quantization_config`` changes in the portable model's arithmetic.

Stored precisions do not change the module tree: quantized weights are decoded exactly at load. What remains
at run time is the activation rounding of a W4A4 scheme: the AMD Quark export declares its MXFP4 experts
(and its main layers' MXFP4 shared experts) with ``input_tensors`` dynamic MXFP4, so the model rounds those
GEMMs' inputs to MXFP4 as the MI355 kernels do. The official release's FP4 experts are weight-only (W4A16)
and its FP8 linears run on decoded weights.

The config is parsed once, here, per model (:func:`layer_rounding`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsv4_mtp.config import DeepseekV4Spec

FP8_METHODS = ("fp8", "deepseek_v4_fp8")  # vLLM renames the release's "fp8" for DeepseekV4ForCausalLM


@dataclass(frozen=True)
class LayerRounding:
    """Whether a layer's routed / shared experts round their GEMM inputs to MXFP4."""

    routed: bool = False
    shared: bool = False


def layer_rounding(spec: DeepseekV4Spec) -> list[LayerRounding]:
    """One :class:`LayerRounding` per main layer; errors name ``config.json:quantization_config``."""
    qc = spec.quantization_config
    n = spec.num_hidden_layers
    if not qc:
        return [LayerRounding()] * n
    method = qc.get("quant_method")
    if method in FP8_METHODS:
        return [LayerRounding()] * n
    if method != "quark":
        raise ValueError(f"{spec.source}: quantization_config.quant_method={method!r} is not supported "
                         "(expected 'quark' or 'fp8')")
    from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

    quark = QuarkQuantConfig.from_dict(dict(qc), source=f"{spec.source}:quantization_config")
    return [LayerRounding(_w4a4(quark, f"layers.{i}.ffn.experts.0.w1"),
                          _w4a4(quark, f"layers.{i}.ffn.shared_experts.w1")) for i in range(n)]


def _w4a4(quark, module: str) -> bool:
    """True when ``module`` is MXFP4 with dynamic FP4 inputs; an activation scheme the portable path cannot
    reproduce is an error rather than a silently different model."""
    kind = quark.spec_for(module)
    inputs = (quark.layer_config_for(module) or {}).get("input_tensors") if kind is not None else None
    if not inputs:
        return False
    if kind == "mxfp4" and inputs.get("dtype") == "fp4":
        return True
    raise ValueError(f"{quark.source}: {module} is declared {kind} with {inputs.get('dtype')} input activations; "
                     "the portable path reproduces MXFP4 activation rounding only (W4A4) or none")
