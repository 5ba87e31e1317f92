"""The portable path's vLLM quantization config for DeepSeek-V4 checkpoints (part of the expert seam).

Off gfx950, vLLM's own handlers of DeepSeek-V4 checkpoints do not fit the plugin's portable path: Quark
(``quant_method: quark``, the AMD MXFP4 export) admits only bf16/fp16 activations and would build Quark
kernels, and the official release's ``quant_method: fp8`` goes to in-tree FP8 kernels. The portable model
decodes every quantized weight exactly at load and emulates the W4A4 activation rounding itself
(``model/quantization.py``), reading the checkpoint's own ``quantization_config``, so it needs from vLLM only
a config that claims these checkpoints, asks nothing of any layer (``get_quant_method`` returns None) and
accepts float32 as well (the dtype of the tight parity checks against HF transformers).

:class:`PortableDeepseekV4QuantConfig` is registered as ``dsv4_mtp_portable`` and claims a checkpoint through
``override_quantization_method`` only when it is a DeepSeek-V4 Quark/FP8 checkpoint and the expert seam picks
the portable implementation; on gfx950 it returns None and vLLM's ``QuarkConfig`` (OCP-MX / AITER) applies.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

NAME = "dsv4_mtp_portable"
# "deepseek_v4_fp8": vLLM rewrites an official release's "fp8" to this for the DeepseekV4ForCausalLM architecture
CLAIMED_METHODS = ("quark", "fp8", "deepseek_v4_fp8")


def claims(hf_quant_cfg: dict | None, hf_config: Any, *, gfx950: bool) -> bool:
    """Does the portable path take this checkpoint's quantization over from vLLM's own handler?"""
    if not hf_quant_cfg or hf_quant_cfg.get("quant_method") not in CLAIMED_METHODS:
        return False
    # the target (model_type deepseek_v4) and its MTP draft (vLLM rewrites the draft's copy of the target
    # config to model_type deepseek_mtp, keeping every DeepSeek-V4 field such as compress_ratios)
    if getattr(hf_config, "model_type", None) not in ("deepseek_v4", "deepseek_mtp"):
        return False
    # vLLM 0.32 keeps the native compress_ratios; 0.33's transformers config has layer_types instead
    schedule = getattr(hf_config, "compress_ratios", None) or getattr(hf_config, "layer_types", None)
    if schedule is None or getattr(hf_config, "hc_mult", None) is None:
        return False
    return not gfx950


class PortableConfigBase(QuantizationConfig):
    """What the portable path's configs share: every activation dtype (float32 for the parity checks against HF
    transformers), any device, no files of their own."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []


@register_quantization_config(NAME)
class PortableDeepseekV4QuantConfig(PortableConfigBase):
    """Holds the checkpoint's raw ``quantization_config``; every layer is built unquantized by vLLM."""

    def __init__(self, raw: dict[str, Any]):
        super().__init__()
        self.raw = dict(raw)

    def get_name(self) -> str:
        return NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PortableDeepseekV4QuantConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, NAME):
            return None
        from vllm_dsv4_mtp.platform import is_gfx950

        return NAME if claims(hf_quant_cfg, hf_config, gfx950=is_gfx950()) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None
