"""The MTP draft's start-up checks and precision policy, shared by both drafts (portable and gfx950).

The draft is BF16 by design. No published DeepSeek-V4 checkpoint stores its MTP layer in BF16 (the official
release: FP8 128x128 linears and FP4 experts; AMD's Quark MXFP4 export keeps the excluded MTP layer "in its
original format": FP4 routed experts, FP8 shared expert), so quantized MTP tensors are decoded exactly to
BF16 at load by default, with one log line saying how many. ``VLLM_DSV4_MTP_QUANTIZED_MTP=refuse`` refuses
them at start-up instead (an environment variable, read in every vLLM process: vLLM's
``SpeculativeConfig`` rejects unknown keys, and ``hf_overrides`` would also rewrite the target's config).

What the draft computes is a second, separate switch, ``VLLM_DSV4_MTP_DRAFT_PRECISION`` (same reason for an
environment variable): ``bf16`` (default) runs on the exactly decoded weights with unquantized activations;
``stored`` computes the MTP layer as the checkpoint declares it (MXFP4 W4A4 experts round their GEMM inputs
to MXFP4, FP8 block linears their inputs to FP8 per 1x128 group; BF16 modules stay BF16). The weights are the
same exact decode either way. ``refuse`` stays a start-up policy about stored tensors; ``stored`` with
``refuse`` is contradictory and refused. Only a draft that can compute the stored schemes accepts ``stored``
(``check_draft(..., stored_ok=True)``: the portable draft); any other draft refuses it rather than run BF16.

:func:`check_draft` runs the checks in the order that names the real cause first:

1. ``num_nextn_predict_layers`` >= 1 (the checkpoint has an MTP layer at all);
2. the engine dtype is bfloat16 (or float32, for tests against the float32 reference);
3. the checkpoint actually holds ``mtp.*`` tensors (a local directory's index / shard headers): an MXFP4
   export written without its MTP layer is "no MTP weights", not a precision problem;
4. what ``config.json`` declares about the MTP layer's precision, against the policy.

Imported by both draft classes (portable and gfx950): it holds no model code, only these checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec, spec_from_hf_config, weight_slots

QUANTIZED_MTP_ENV = "VLLM_DSV4_MTP_QUANTIZED_MTP"
REFUSE = "refuse"
DEQUANTIZE = "dequantize"
_OPTIONS = (DEQUANTIZE, REFUSE)

DRAFT_PRECISION_ENV = "VLLM_DSV4_MTP_DRAFT_PRECISION"
BF16 = "bf16"
STORED = "stored"
_PRECISIONS = (BF16, STORED)

DRAFT_DTYPES = (torch.bfloat16, torch.float32)


class MtpPrecisionError(ValueError):
    """The MTP layer is stored or declared in a precision the policy does not allow."""


class MtpMissingError(ValueError):
    """An MTP speculative config on a checkpoint without an MTP layer."""


def _env_choice(name: str, choices: tuple[str, ...], environ: Mapping[str, str] | None) -> str:
    """The value of environment variable ``name`` (case and spaces ignored; unset or empty: ``choices[0]``), or a
    :class:`MtpPrecisionError` naming the variable and the values it takes."""
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise MtpPrecisionError(f"{name}={env.get(name)!r} is not valid; expected one of {', '.join(choices)}")
    return value


def quantized_mtp_option(environ: Mapping[str, str] | None = None) -> str:
    """``dequantize`` (default) or ``refuse``, from ``VLLM_DSV4_MTP_QUANTIZED_MTP``."""
    return _env_choice(QUANTIZED_MTP_ENV, _OPTIONS, environ)


def draft_precision(environ: Mapping[str, str] | None = None) -> str:
    """``bf16`` (default) or ``stored``, from ``VLLM_DSV4_MTP_DRAFT_PRECISION``."""
    return _env_choice(DRAFT_PRECISION_ENV, _PRECISIONS, environ)


def check_draft_dtype(dtype: torch.dtype) -> torch.dtype:
    """The draft's activation dtype: the engine's, if it is bfloat16 or float32."""
    if dtype not in DRAFT_DTYPES:
        raise MtpPrecisionError(
            f"the DeepSeek-V4 MTP draft runs in bfloat16 (or float32 for testing), but the engine dtype is "
            f"{dtype}; start vLLM with dtype='bfloat16'"
        )
    return dtype


def refusal(what: str, precision: str, source: str) -> MtpPrecisionError:
    """The error for a quantized MTP tensor (or config declaration) under ``refuse``."""
    return MtpPrecisionError(
        f"{source}: MTP {what} is {precision}, and {QUANTIZED_MTP_ENV}=refuse. Unset it (the default, "
        f"'dequantize', decodes quantized MTP weights exactly to BF16 at load), or use a checkpoint whose MTP "
        "layer is stored BF16."
    )


def mtp_linear_modules(spec: DeepseekV4Spec) -> list[str]:
    """Native module names of the MTP layers' linear weights (those a quantization config may cover)."""
    return [s.module for s in weight_slots(spec, mtp=True).values() if s.is_mtp and s.quantizable]


def declared_mtp_precisions(spec: DeepseekV4Spec) -> dict[str, str]:
    """``{module: precision}`` for the MTP linears ``config.json``'s ``quantization_config`` declares quantized
    ("mxfp4", "fp8-block", "fp4"); empty for a BF16 checkpoint."""
    qc = spec.quantization_config
    if not qc:
        return {}
    method = qc.get("quant_method")
    out: dict[str, str] = {}
    if method == "quark":
        from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

        quark = QuarkQuantConfig.from_dict(dict(qc), source=f"{spec.source}:quantization_config")
        for m in mtp_linear_modules(spec):
            kind = quark.spec_for(m)
            if kind is not None:
                out[m] = kind
    elif method in ("fp8", "deepseek_v4_fp8"):  # vLLM renames the release's "fp8" for DeepSeek-V4
        for m in mtp_linear_modules(spec):  # every MTP linear FP8-block, the routed experts per expert_dtype
            is_routed = ".ffn.experts." in m
            out[m] = ("fp4" if spec.official_expert_dtype == "fp4" else "fp8-block") if is_routed else "fp8-block"
    return out


def mtp_tensor_names(model: str) -> list[str] | None:
    """The ``mtp.*`` tensor names of a local checkpoint directory (from its index or shard headers), or None
    when ``model`` is not a local directory (a hub id: checked again when the weights are read)."""
    if not Path(model).is_dir():
        return None
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    return [n for n in CheckpointReader(model).tensors if n.startswith("mtp.")]


@dataclass(frozen=True)
class DraftPlan:
    """What the draft's constructor established: the spec, the checkpoint, the dtype, what to do with quantized
    MTP tensors (``quantized_mtp``: ``dequantize`` or ``refuse``, from ``VLLM_DSV4_MTP_QUANTIZED_MTP``) and what
    the draft computes (``precision``: ``bf16`` or ``stored``, from ``VLLM_DSV4_MTP_DRAFT_PRECISION``)."""

    spec: DeepseekV4Spec
    source: str
    dtype: torch.dtype
    quantized_mtp: str
    declared: Mapping[str, str]
    precision: str = BF16

    def admit(self, name: str, t: torch.Tensor) -> None:
        """The loader's hook for every quantized MTP weight / scale: refused under ``refuse``."""
        if self.quantized_mtp == REFUSE:
            label = (
                f"quantized (a block scale, {t.dtype})"
                if not name.endswith(".weight")
                else ("FP8 (float8_e4m3fn)" if t.dtype == torch.float8_e4m3fn else f"packed FP4 ({t.dtype})")
            )
            raise refusal(f"tensor {name}", f"stored {label}", self.source)


def check_draft(
    hf_config: Any, model: str, dtype: torch.dtype, environ: Mapping[str, str] | None = None, *, stored_ok: bool = False
) -> DraftPlan:
    """The draft's start-up checks, in order (module docstring); ``model`` is the checkpoint path or id;
    ``stored_ok``: the calling draft can compute ``VLLM_DSV4_MTP_DRAFT_PRECISION=stored``."""
    spec = spec_from_hf_config(hf_config)
    source = str(model)
    if spec.num_nextn_predict_layers < 1:
        raise MtpMissingError(
            f"{source}/config.json: num_nextn_predict_layers={spec.num_nextn_predict_layers}; speculative "
            "decoding with method 'mtp' needs the checkpoint's MTP layer (DeepSeek-V4 ships exactly 1). Serve "
            "this checkpoint without a speculative config."
        )
    dtype = check_draft_dtype(dtype)
    names = mtp_tensor_names(source)
    if names is not None and not names:
        raise MtpMissingError(
            f"{source}: speculative decoding with method 'mtp' needs the checkpoint's MTP layer, but it has no "
            f"MTP weights: no mtp.* tensor in its index or shards (config.json says num_nextn_predict_layers="
            f"{spec.num_nextn_predict_layers}). Serve it without a speculative config, or use a checkpoint that "
            "ships its MTP layer."
        )
    option = quantized_mtp_option(environ)
    precision = draft_precision(environ)
    if precision == STORED and option == REFUSE:
        raise MtpPrecisionError(
            f"{DRAFT_PRECISION_ENV}=stored computes the MTP layer as the checkpoint stores it, but "
            f"{QUANTIZED_MTP_ENV}=refuse refuses a quantized MTP layer; unset one of them"
        )
    if precision == STORED and not stored_ok:
        raise MtpPrecisionError(
            f"{DRAFT_PRECISION_ENV}=stored: this MTP draft computes in BF16 only; unset it (the default, 'bf16', "
            "decodes the stored weights exactly and keeps activations unquantized)"
        )
    declared = declared_mtp_precisions(spec)
    if declared and option == REFUSE:
        first = sorted(declared)[0]
        more = f" (and {len(declared) - 1} more MTP modules)" if len(declared) > 1 else ""
        raise refusal(
            f"module {first}{more}", f"declared {declared[first]} by quantization_config", f"{source}/config.json"
        )
    return DraftPlan(spec, source, dtype, option, declared, precision)
