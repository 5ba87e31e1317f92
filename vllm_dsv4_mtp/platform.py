"""Which DeepSeek-V4 implementation this process serves: the one platform choice of the plugin.

* ``IN_TREE`` on AMD MI350/MI355 (gfx950, ROCm vLLM): vLLM's own ``DeepseekV4ForCausalLM`` stays the
  target (fused mHC, AITER MoE with Quark OCP-MX, its sparse attention and caches); the plugin supplies
  only the MTP draft, built from vLLM's in-tree AMD MTP layers in BF16 (``vllm_dsv4_mtp.gfx950``).
* ``PORTABLE`` everywhere else (CPU, other GPUs): the plugin's own target and draft in plain PyTorch over
  vLLM's paged KV cache (``vllm_dsv4_mtp.model``).

No torch or vllm import at module level: the plugin loader imports this in every vLLM process.
"""

from __future__ import annotations

IN_TREE = "in_tree"
PORTABLE = "portable"


def is_gfx950() -> bool:
    """True on an AMD MI350/MI355 (gfx950) GPU with a ROCm build of vLLM."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return False
    from vllm.platforms.rocm import on_gfx950

    return bool(on_gfx950())


def implementation(gfx950: bool | None = None) -> str:
    """``IN_TREE`` on gfx950, ``PORTABLE`` elsewhere; ``gfx950=None`` asks the running platform."""
    if gfx950 is None:
        gfx950 = is_gfx950()
    return IN_TREE if gfx950 else PORTABLE
