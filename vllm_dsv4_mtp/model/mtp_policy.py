"""Precision policy of the MTP draft: it runs in BF16, never in a precision nobody chose.

DeepSeek-V4's MTP layer is the speculative-decoding draft (``model/mtp.py``). Its rules:

* **Activation dtype.** The draft runs in the engine's dtype, which must be ``bfloat16`` (production) or
  ``float32`` (tests: tight comparisons against the float32 reference; vLLM's in-tree CPU path refuses it,
  the plugin's portable path does not). ``float16`` is refused (:func:`check_draft_dtype`): the release
  stores the MTP layer in BF16 and its residual streams are not range-checked for fp16.
* **Never quantized by vLLM's quant config.** The draft builds every layer with ``quant_config=None``
  (linears and the experts' ``FusedMoE``): vLLM's ``QuarkConfig`` matches ``exclude`` entries on module names,
  and the AMD export's native names (``mtp.0.e_proj``) do not match the draft's module names
  (``model.layers.61.e_proj``), so relying on ``exclude`` would silently quantize the draft on gfx950.
* **Quantized MTP weights in the checkpoint** (the official release stores ``e_proj``/``h_proj``, attention and
  the shared expert in FP8 128x128 blocks and the routed experts in FP4; a Quark config whose ``exclude`` does
  not cover ``mtp.*`` declares them MXFP4/FP8) are handled by an explicit option, the environment variable
  ``VLLM_DSV4_MTP_QUANTIZED_MTP`` (read in every vLLM process, which inherit the environment):

  - ``refuse`` (default): start-up error naming the tensor (or the ``config.json`` field that declares it)
    and this option;
  - ``dequantize``: decode FP8 block / MXFP4 / FP4 MTP weights exactly to BF16 at load (both formats are
    exactly representable in BF16) and run the draft in BF16; one INFO line says how many tensors.

  An environment variable rather than a speculative-config key because vLLM's ``SpeculativeConfig``
  rejects unknown keys, and ``hf_overrides`` would also rewrite the target's config.
* **No MTP weights, MTP asked for.** A checkpoint whose ``mtp.*`` tensors are absent (or with
  ``num_nextn_predict_layers: 0``) under ``{"method": "mtp"}`` is a start-up error naming the checkpoint
  and the missing tensors (``model/mtp.py``), never a silent no-op.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

QUANTIZED_MTP_ENV = "VLLM_DSV4_MTP_QUANTIZED_MTP"
REFUSE = "refuse"
DEQUANTIZE = "dequantize"
_OPTIONS = (REFUSE, DEQUANTIZE)

DRAFT_DTYPES = (torch.bfloat16, torch.float32)


class MtpPrecisionError(ValueError):
    """The MTP layer is stored or declared in a precision the policy does not allow."""


def quantized_mtp_option(environ: Mapping[str, str] | None = None) -> str:
    """``refuse`` (default) or ``dequantize``, from ``VLLM_DSV4_MTP_QUANTIZED_MTP``."""
    env = os.environ if environ is None else environ
    value = env.get(QUANTIZED_MTP_ENV, "").strip().lower() or REFUSE
    if value not in _OPTIONS:
        raise MtpPrecisionError(f"{QUANTIZED_MTP_ENV}={env.get(QUANTIZED_MTP_ENV)!r} is not valid; "
                                f"expected one of {', '.join(_OPTIONS)}")
    return value


def check_draft_dtype(dtype: torch.dtype) -> torch.dtype:
    """The draft's activation dtype: the engine's, if it is bfloat16 or float32."""
    if dtype not in DRAFT_DTYPES:
        raise MtpPrecisionError(
            f"the DeepSeek-V4 MTP draft runs in bfloat16 (or float32 for testing), but the engine dtype is "
            f"{dtype}; start vLLM with dtype='bfloat16'")
    return dtype


def refusal(what: str, precision: str, source: str) -> MtpPrecisionError:
    """The error for a quantized MTP tensor (or config declaration) under ``refuse``."""
    return MtpPrecisionError(
        f"{source}: MTP {what} is {precision}; the DeepSeek-V4 MTP draft runs in BF16. "
        f"Set {QUANTIZED_MTP_ENV}=dequantize to decode the quantized MTP weights to BF16 at load, or use a "
        f"checkpoint whose MTP layer is BF16 (a Quark export lists mtp.* in its 'exclude').")


def declared_mtp_precisions(quantization_config: Mapping[str, Any] | None, expert_dtype: str | None,
                            mtp_linears: list[str]) -> dict[str, str]:
    """Which MTP linear modules ``config.json``'s ``quantization_config`` declares quantized.

    Args:
        quantization_config: the raw ``quantization_config`` dict (or None).
        expert_dtype: ``config.json``'s ``expert_dtype`` (official release: ``fp4``).
        mtp_linears: native module names of the MTP layer's linear weights (``mtp.0.e_proj``, ...,
            ``mtp.0.ffn.experts.0.w1``).

    Returns ``{module: precision}`` for the quantized ones ("mxfp4", "fp8-block", "fp4").
    """
    if not quantization_config:
        return {}
    method = quantization_config.get("quant_method")
    out: dict[str, str] = {}
    if method == "quark":
        from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

        quark = QuarkQuantConfig.from_dict(dict(quantization_config), source="config.json:quantization_config")
        for m in mtp_linears:
            kind = quark.spec_for(m)
            if kind is not None:
                out[m] = kind
    elif method in ("fp8", "deepseek_v4_fp8"):  # vLLM renames the release's "fp8" for DeepSeek-V4
        # the official release: every linear of the MTP layer is FP8-block, routed experts FP4 (expert_dtype)
        for m in mtp_linears:
            is_routed = ".ffn.experts." in m
            out[m] = ("fp4" if expert_dtype == "fp4" else "fp8-block") if is_routed else "fp8-block"
    return out


def check_declared(declared: Mapping[str, str], option: str, source: str) -> None:
    """Refuse at start-up when ``config.json`` declares quantized MTP weights and the option is ``refuse``."""
    if declared and option == REFUSE:
        first = sorted(declared)[0]
        more = f" (and {len(declared) - 1} more MTP modules)" if len(declared) > 1 else ""
        raise refusal(f"module {first}{more}", f"declared {declared[first]} by quantization_config", source)
