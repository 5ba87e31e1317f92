"""What a checkpoint's ``quantization_config`` changes in the portable model's arithmetic.

Stored precisions do not change the module tree: quantized weights are decoded exactly at load. What remains
at run time is the activation rounding of a W4A4 scheme: the AMD Quark export declares its MXFP4 experts
(and its main layers' MXFP4 shared experts) with ``input_tensors`` dynamic MXFP4, so the model rounds those
GEMMs' inputs to MXFP4 as the MI355 kernels do. The official release's FP4 experts are weight-only (W4A16)
and its FP8 linears run on decoded weights.

The config is parsed once, here, per model (:func:`layer_rounding`); for the MTP draft computed as stored
(``VLLM_DSV4_MTP_DRAFT_PRECISION=stored``), :func:`draft_rounding`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec

FP8_METHODS = ("fp8", "deepseek_v4_fp8")  # vLLM renames the release's "fp8" for DeepseekV4ForCausalLM


@dataclass(frozen=True)
class LayerRounding:
    """Whether a layer's routed / shared experts round their GEMM inputs to MXFP4; ``shared_fp8``: the FP8
    1x128 input rounding of a shared expert stored as FP8 block linears (the MTP draft computed as stored)."""

    routed: bool = False
    shared: bool = False
    shared_fp8: Callable[[torch.Tensor], torch.Tensor] | None = None


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
        raise ValueError(
            f"{spec.source}: quantization_config.quant_method={method!r} is not supported (expected 'quark' or 'fp8')"
        )
    from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

    quark = QuarkQuantConfig.from_dict(dict(qc), source=f"{spec.source}:quantization_config")
    return [
        LayerRounding(_w4a4(quark, f"layers.{i}.ffn.experts.0.w1"), _w4a4(quark, f"layers.{i}.ffn.shared_experts.w1"))
        for i in range(n)
    ]


def _w4a4(quark, module: str) -> bool:
    """True when ``module`` is MXFP4 with dynamic FP4 inputs; an activation scheme the portable path cannot
    reproduce is an error rather than a silently different model."""
    kind = quark.spec_for(module)
    inputs = (quark.layer_config_for(module) or {}).get("input_tensors") if kind is not None else None
    if not inputs:
        return False
    if kind == "mxfp4" and inputs.get("dtype") == "fp4":
        return True
    raise ValueError(
        f"{quark.source}: {module} is declared {kind} with {inputs.get('dtype')} input activations; "
        "the portable path reproduces MXFP4 activation rounding only (W4A4) or none"
    )


Rounding = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DraftRounding:
    """The activation rounding of the MTP layer computed as stored (``VLLM_DSV4_MTP_DRAFT_PRECISION=stored``):
    ``routed``: the routed experts are MXFP4 W4A4; ``shared`` / ``e_proj`` / ``h_proj``: the input rounding of
    an FP8 block linear (``formats.fp8.fake_quant_act``), None where the module is BF16 or weight-only."""

    routed: bool = False
    shared: Rounding | None = None
    e_proj: Rounding | None = None
    h_proj: Rounding | None = None

    def describe(self) -> str:
        parts = [f"routed experts {'MXFP4 W4A4' if self.routed else 'no activation rounding'}"]
        parts += [
            f"{n} {'FP8 1x128 inputs' if getattr(self, n) else 'unrounded'}" for n in ("shared", "e_proj", "h_proj")
        ]
        return ", ".join(parts)


def draft_rounding(spec: DeepseekV4Spec) -> DraftRounding:
    """What ``config.json``'s ``quantization_config`` makes the MTP layer's activations go through when it is
    computed as stored. Quark: an MXFP4 module with fp4 ``input_tensors`` is W4A4, an FP8 block module with
    dynamic fp8 ``input_tensors`` per group of 128 rounds its input (float32 scales unless ``scale_format``
    says e8m0); the official ``fp8`` release: every FP8 linear with dynamic 1x128 inputs at its ``scale_fmt``
    (ue8m0), its FP4 experts weight-only. A quantized MTP module this draft cannot compute as stored (the
    attention projections, an activation scheme other than these) is an error naming it, rather than a draft
    that silently computes something else."""
    from vllm_dsv4_mtp.draft_policy import declared_mtp_precisions

    declared = declared_mtp_precisions(spec)
    if not declared:
        return DraftRounding()
    method = spec.quantization_config.get("quant_method")
    schemes: dict[str, str | None] = {}  # module -> "w4a4" | "fp8:<scale_format>" | None (weight-only)
    if method == "quark":
        from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

        quark = QuarkQuantConfig.from_dict(dict(spec.quantization_config), source=f"{spec.source}:quantization_config")
        for m, kind in declared.items():
            inputs = (quark.layer_config_for(m) or {}).get("input_tensors")
            schemes[m] = _input_scheme(quark.source, m, kind, inputs)
    else:
        fmt = "e8m0" if spec.quantization_config.get("scale_fmt") == "ue8m0" else "float32"
        dynamic = spec.quantization_config.get("activation_scheme", "dynamic") == "dynamic"
        for m, kind in declared.items():
            schemes[m] = f"fp8:{fmt}" if kind == "fp8-block" and dynamic else None
    return _rounding_of(spec, schemes)


def _input_scheme(source: str, module: str, kind: str, inputs: dict | None) -> str | None:
    if not inputs:
        return None
    if kind == "mxfp4" and inputs.get("dtype") == "fp4":
        return "w4a4"
    if (
        kind == "fp8-block"
        and inputs.get("dtype") == "fp8_e4m3"
        and inputs.get("is_dynamic")
        and inputs.get("qscheme") == "per_group"
        and inputs.get("group_size") == 128
    ):
        return "fp8:" + ("e8m0" if inputs.get("scale_format") == "e8m0" else "float32")
    raise ValueError(
        f"{source}: {module} is declared {kind} with input activations {inputs.get('dtype')} "
        f"{inputs.get('qscheme')}; the portable draft computes MXFP4 W4A4 and FP8 block linears with "
        "dynamic 1x128 FP8 inputs only"
    )


def _rounding_of(spec: DeepseekV4Spec, schemes: dict[str, str | None]) -> DraftRounding:
    """``{module: scheme}`` of the MTP layer -> :class:`DraftRounding`; each part must have one scheme."""
    from functools import partial

    from vllm_dsv4_mtp.formats.fp8 import fake_quant_act

    parts: dict[str, set[str | None]] = {"routed": set(), "shared": set(), "e_proj": set(), "h_proj": set()}
    for m, scheme in schemes.items():
        if ".ffn.experts." in m:
            parts["routed"].add(scheme)
        elif ".ffn.shared_experts." in m:
            parts["shared"].add(scheme)
        elif m.endswith((".e_proj", ".h_proj")):
            parts[m.rsplit(".", 1)[1]].add(scheme)
        elif scheme is not None:
            raise ValueError(
                f"{spec.source}: MTP module {m} is declared quantized with input rounding ({scheme}); "
                f"VLLM_DSV4_MTP_DRAFT_PRECISION=stored cannot compute it as stored on the portable "
                "draft (attention projections are not emulated): unset it to run the draft in bf16"
            )

    def one(part: str) -> str | None:
        found = parts[part] | ({None} if part != "routed" and not parts[part] else set())
        if len(found) > 1:
            raise ValueError(
                f"{spec.source}: the MTP layer's {part} modules are declared with different "
                f"activation schemes {sorted(map(str, found))}"
            )
        return next(iter(found), None)

    def fp8(part: str) -> Rounding | None:
        scheme = one(part)
        if scheme is None:
            return None
        if not scheme.startswith("fp8:"):
            raise ValueError(
                f"{spec.source}: the MTP layer's {part} is declared {scheme}; the portable draft "
                "computes it as stored only as an FP8 block linear"
            )
        return partial(fake_quant_act, scale_format=scheme[4:])

    routed = one("routed")
    if routed not in (None, "w4a4"):
        raise ValueError(
            f"{spec.source}: the MTP layer's routed experts are declared {routed}; the portable draft "
            "computes them as stored only as MXFP4 (W4A4 or weight-only)"
        )
    return DraftRounding(routed=routed == "w4a4", shared=fp8("shared"), e_proj=fp8("e_proj"), h_proj=fp8("h_proj"))
