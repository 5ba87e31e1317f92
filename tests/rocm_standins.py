"""Test-only stand-ins for what only an MI355 with ROCm and AITER has, so vLLM's real in-tree AMD MTP class builds
and runs on CPU. Nothing here is product code; every stand-in says why it is needed.

Each stand-in replaces a ROCm-only query or kernel with the plainest thing that answers the same question or
computes the same function from the same parameters (the project's own reference maths, never vLLM's GPU code).
:func:`install` installs the import-time ones; it must run before anything imports ``vllm.models.deepseek_v4.amd``.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import torch


def _gfx950_device_properties(*args, **kwargs):
    """``vllm.platforms.rocm`` reads ``torch.cuda.get_device_properties("cuda").gcnArchName`` at import time (the
    in-tree AMD model imports it for ``on_gfx950``); CPU torch has no CUDA and raises. Answers as an MI355 does."""
    return SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", name="AMD Instinct MI355X (stand-in)",
                           multi_processor_count=256, total_memory=288 << 30, major=9, minor=5)


class _NoOpCudaEvent:
    """The in-tree attention and MoE allocate CUDA events/streams for their overlap of streams; on CPU everything
    runs in order on one stream, so recording and waiting are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _switch(name: str, default: str = "False") -> bool:
    return os.environ.get(name, default).lower() in ("1", "true")


def _aiter_fused_moe_enabled() -> bool:
    """``rocm_aiter_ops.is_fused_moe_enabled``: on CPU vLLM's answer is False (no AITER), which makes the unquantized
    MoE refuse ``--moe-backend aiter`` ("kernel does not support current device cpu"). On an MI355 with AITER
    it is ``VLLM_ROCM_USE_AITER`` and ``VLLM_ROCM_USE_AITER_MOE`` (default on), which this reads. Construction
    only: AITER's MoE kernel itself is not run here."""
    return _switch("VLLM_ROCM_USE_AITER") and _switch("VLLM_ROCM_USE_AITER_MOE", "True")


def _aiter_fse_requested() -> bool:
    """``rocm_aiter_ops.is_fusion_moe_shared_experts_enabled``: on CPU vLLM's ``if_aiter_supported`` answers None
    (no ROCm platform, no AITER), so the flag the MI355 profiles set never reaches vLLM's fused-shared-expert
    resolution. On an MI355 with AITER it is the two environment switches, which this reads (live, so one process
    can run cases with the flag on and off)."""
    return _aiter_fused_moe_enabled() and _switch("VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS")


def _aiter_shared_expert_routing_table(*args, **kwargs) -> None:
    """``init_aiter_topK_meta_data``: a fused shared expert makes vLLM allocate AITER's routing table (the shared
    expert's slot appended to every token's top-k) with ``device="cuda"``, which CPU torch refuses. The harness
    builds fused MoEs only to show what vLLM does with them (the plugin's draft never fuses) and never runs AITER's
    fused kernel that reads the table, so nothing is allocated."""
    return None


def install() -> None:
    """The import-time stand-ins: ROCm arch detection, CUDA events and streams, AITER's MoE switches."""
    torch.cuda.get_device_properties = _gfx950_device_properties
    torch.cuda.Event = _NoOpCudaEvent
    torch.cuda.Stream = _NoOpCudaEvent
    from vllm._aiter_ops import rocm_aiter_ops

    rocm_aiter_ops.is_fusion_moe_shared_experts_enabled = staticmethod(_aiter_fse_requested)
    rocm_aiter_ops.is_fused_moe_enabled = staticmethod(_aiter_fused_moe_enabled)
    import vllm.model_executor.layers.fused_moe.expert_map_manager as expert_map_manager

    expert_map_manager.init_aiter_topK_meta_data = _aiter_shared_expert_routing_table


@contextlib.contextmanager
def x86_config_check_without_triton_cpu():
    """vLLM 0.34's CPU platform refuses to build an engine config on x86 without triton-cpu (its CPU model runner
    needs it; the harness builds configs and model classes, never that runner). While the config is built the
    check is told Triton is there; restored afterwards. On 0.32 / 0.33 there is no such check and this changes
    nothing."""
    import vllm.triton_utils as tu

    had = tu.HAS_TRITON
    tu.HAS_TRITON = True
    try:
        yield
    finally:
        tu.HAS_TRITON = had
