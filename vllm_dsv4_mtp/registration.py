"""Model registration with vLLM's ``ModelRegistry`` (called by the plugin entry point in every vLLM process).

Cheap and free of side effects beyond the registry: model classes are registered as lazy ``"module:Class"``
strings, so nothing of the model (or torch) is imported until vLLM resolves the architecture.

``VLLM_DSV4_MTP_DISABLE=1`` turns the plugin off: nothing is registered and vLLM's own classes stay.
"""

from __future__ import annotations

import os

# architecture name -> the plugin's class, as a lazy "module:Class" reference
TARGET_MODELS: dict[str, str] = {
    "DeepseekV4ForCausalLM": "vllm_dsv4_mtp.model.deepseek_v4:DeepseekV4ForCausalLM",
}
# ---- issue 4 (MTP draft) registers here: vLLM's speculative config resolves DeepSeek-V4's draft as
# ---- "DeepSeekV4MTPModel", e.g. DRAFT_MODELS = {"DeepSeekV4MTPModel": "vllm_dsv4_mtp.model.mtp:DeepSeekV4MTPModel"}
DRAFT_MODELS: dict[str, str] = {"DeepSeekV4MTPModel": "vllm_dsv4_mtp.model.mtp:DeepSeekV4MTPModel"}

DISABLE_ENV = "VLLM_DSV4_MTP_DISABLE"

_registered = False


def plugin_disabled() -> bool:
    """True when ``VLLM_DSV4_MTP_DISABLE`` is set to a true value (1/true/yes)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register_models() -> bool:
    """Register the plugin's model classes (idempotent; logs one INFO line per process).

    Returns True when the plugin's classes are (now or already) registered, False when disabled.
    """
    global _registered
    if plugin_disabled():
        return False
    if _registered:
        return True
    from vllm import ModelRegistry
    from vllm.logger import init_logger

    for arch, ref in {**TARGET_MODELS, **DRAFT_MODELS}.items():
        ModelRegistry.register_model(arch, ref)
    # registers the "dsv4_mtp_portable" quantization config (claims DeepSeek-V4 Quark/FP8 checkpoints off gfx950)
    import vllm_dsv4_mtp.kernels.portable_quant  # noqa: F401
    from vllm_dsv4_mtp.startup_checks import register_config_format

    register_config_format()  # --config-format dsv4_mtp: config.json checked before vLLM's SpeculativeConfig
    _registered = True
    # a "vllm." logger name so the line goes through vLLM's log handler
    init_logger("vllm.dsv4_mtp").info(
        "vllm-dsv4-mtp plugin: %s now served by the plugin; DeepSeek-V4 Quark/FP8 checkpoints use its "
        "portable quantization off gfx950 (set %s=1 to use vLLM's own classes)",
        ", ".join(f"{a} -> {r}" for a, r in {**TARGET_MODELS, **DRAFT_MODELS}.items()), DISABLE_ENV,
    )
    return True
