"""What the plugin registers with vLLM, per platform (called by the entry point in every vLLM process).

* gfx950 (``platform.IN_TREE``): only the draft, ``DeepSeekV4MTPModel`` -> vLLM's in-tree AMD MTP layers in
  BF16 (``vllm_dsv4_mtp.gfx950.draft``); vLLM's own ``DeepseekV4ForCausalLM`` stays the target.
* elsewhere (``platform.PORTABLE``): the portable target and draft (``vllm_dsv4_mtp.model``) and the
  ``dsv4_mtp_portable`` quantization config that lets them read Quark / FP8 checkpoints.
* a vLLM outside :data:`vllm_dsv4_mtp.versions.SUPPORTED_VLLM`: what the plugin would have supplied maps to a
  class whose constructor raises the version error (vLLM's plugin loader would swallow an exception raised
  here). On gfx950 that is only the draft: vLLM's own target keeps serving DeepSeek-V4 without MTP, and a
  speculative config stops at start-up with that one message. Elsewhere the target is the plugin's too, so
  serving DeepSeek-V4 stops with the message; any other model is unaffected.

Classes are registered as lazy ``"module:Class"`` strings: nothing of the model (or torch) is imported until
vLLM resolves the architecture. ``VLLM_DSV4_MTP_DISABLE=1`` turns the plugin off.
"""

from __future__ import annotations

import os

from vllm_dsv4_mtp import platform

TARGET_ARCH = "DeepseekV4ForCausalLM"
DRAFT_ARCH = "DeepSeekV4MTPModel"
PLANS: dict[str, dict[str, str]] = {
    platform.IN_TREE: {DRAFT_ARCH: "vllm_dsv4_mtp.gfx950.draft:DeepSeekV4MTPModel"},
    platform.PORTABLE: {
        TARGET_ARCH: "vllm_dsv4_mtp.model.deepseek_v4:DeepseekV4ForCausalLM",
        DRAFT_ARCH: "vllm_dsv4_mtp.model.mtp:DeepSeekV4MTPModel",
    },
}
UNSUPPORTED = "vllm_dsv4_mtp.unsupported:UnsupportedVllm"
DISABLE_ENV = "VLLM_DSV4_MTP_DISABLE"

_registered = False


def plugin_disabled() -> bool:
    """True when ``VLLM_DSV4_MTP_DISABLE`` is set to a true value (1/true/yes)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def models_for(implementation: str) -> dict[str, str]:
    """Architecture name -> the plugin's lazy class reference, for ``platform.IN_TREE`` / ``PORTABLE``."""
    return dict(PLANS[implementation])


def register_models() -> bool:
    """Register the plugin's model classes (idempotent; logs one line per process).

    Returns True when the plugin's classes are (now or already) registered, False when disabled.
    """
    global _registered
    if plugin_disabled():
        return False
    if _registered:
        return True
    from vllm import ModelRegistry
    from vllm.logger import init_logger

    from vllm_dsv4_mtp.versions import UnsupportedVllmError, check_vllm_version

    log = init_logger("vllm.dsv4_mtp")  # a "vllm." name so the line goes through vLLM's log handler
    try:
        check_vllm_version()
    except UnsupportedVllmError as e:
        try:
            impl = platform.implementation()
        except (ImportError, AttributeError):  # a future vLLM without the platform query: refuse both, as on CPU
            impl = platform.PORTABLE
        refused = models_for(impl)
        for arch in refused:
            ModelRegistry.register_model(arch, UNSUPPORTED)
        if impl == platform.IN_TREE:
            what = "the MTP draft will not start; vLLM's own DeepSeek-V4 target serves without a speculative config"
        else:
            what = "DeepSeek-V4 will not start"
        log.error(
            "vllm-dsv4-mtp plugin: %s; %s (refused: %s; set %s=1 to use vLLM's own classes)",
            e,
            what,
            ", ".join(refused),
            DISABLE_ENV,
        )
        _registered = True
        return True
    impl = platform.implementation()
    models = models_for(impl)
    for arch, ref in models.items():
        ModelRegistry.register_model(arch, ref)
    if impl == platform.PORTABLE:
        import vllm_dsv4_mtp.portable_quant_config  # noqa: F401  (registers "dsv4_mtp_portable")

        what = "portable DeepSeek-V4 target and BF16 MTP draft"
    else:
        what = "vLLM's in-tree DeepSeek-V4 target (AITER) + the plugin's BF16 MTP draft"
    from vllm_dsv4_mtp.startup_checks import register_config_format

    register_config_format()  # --config-format dsv4_mtp: config.json checked before vLLM's SpeculativeConfig
    from vllm_dsv4_mtp.serve.metrics import export_draft_precision

    export_draft_precision()  # /metrics says which draft precision this server runs (eval --ab reads it)
    _registered = True
    log.info(
        "vllm-dsv4-mtp plugin (%s): %s; %s (set %s=1 to use vLLM's own classes only)",
        impl,
        what,
        ", ".join(f"{a} -> {r}" for a, r in models.items()),
        DISABLE_ENV,
    )
    return True
