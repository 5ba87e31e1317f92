"""Chunked prefill and prefix caching through vLLM's engine, with small compress ratios (C4 + C8).

vLLM's CPU platform treats ``model_type: deepseek_v4`` as MLA and, on CPUs without AMX (this one), forces
chunked prefill and prefix caching OFF whatever the model's own attention supports. The plugin's portable
attention supports both, so this module sets vLLM's documented ``VLLM_MLA_DISABLE=1`` (the model does not use
vLLM's MLA machinery at all), keeps both features on, and checks the engine really used them.

One ``LLM`` per module: float32, ``compress_ratios = [0, 4, 8, 4, 0]`` (SWA, C4 + indexer, C8, C4), block size
256 (forced by vLLM's CPU platform for this model type), ``max_num_batched_tokens = 64`` so a 450-token prompt
is prefilled in 8 chunks mixed with other requests' decodes, and prefix caching on.
Enforced against HF float32 (full-sequence forward, no cache): prompt log-probabilities within 1e-4 with 100 %
top-1; greedy continuations equal to HF's argmax at every step, on the first (cold) and the second (prefix-cache
hit) round, which must also produce the same tokens.
"""

from __future__ import annotations

import pytest
from checkpoints import random_prompts, sharpened_tiny
from engines import PARITY_ENGINE

pytestmark = pytest.mark.engine

MAX_ABS_LOGPROB = 1e-4
RATIOS = [0, 4, 8, 4, 0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sharpened_tiny(tmp_path_factory, "c8", seed=1, compress_ratios=RATIOS, index_n_heads=64, index_topk=8)


@pytest.fixture(scope="module")
def llm(ckpt, start_engine):
    return start_engine(
        ckpt,
        env={"VLLM_MLA_DISABLE": "1"},
        **PARITY_ENGINE,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )


@pytest.fixture(scope="module")
def hf(ckpt):
    from vllm_dsv4_mtp.testing.hf_oracle import load_hf_model

    return load_hf_model(ckpt)


def test_engine_keeps_chunked_prefill_and_prefix_caching(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.scheduler_config.enable_chunked_prefill
    assert cfg.scheduler_config.max_num_batched_tokens == 64
    assert cfg.cache_config.enable_prefix_caching


def test_chunked_prompt_logprobs_match_hf(llm, hf):
    from vllm_dsv4_mtp.testing.hf_oracle import engine_prompt_logprobs_vs_hf

    prompts = random_prompts((450, 9, 200, 61), seed=0)  # 450 = 8 chunks of <= 64 tokens
    r = engine_prompt_logprobs_vs_hf(llm, prompts, hf)
    assert r["max_abs"] <= MAX_ABS_LOGPROB, r
    assert r["top1"] == 1.0, r


def test_chunked_decode_and_prefix_cache_hits_equal_recompute(llm, hf):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.testing.hf_oracle import greedy_agreement

    # 300 tokens shared (> one 256-token block): the second round reuses them from the prefix cache
    shared, *tails, alone = random_prompts((300, 5, 40, 150, 70), seed=1)
    prompts = [shared + t for t in tails] + [alone]
    sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for out in (first, second):
        r = greedy_agreement(out, prompts, hf)
        assert r["steps"] == 64 and r["mismatches"] == 0 and r["ties"] <= 1, r
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.num_cached_tokens >= 256 for o in second[:3])  # the shared block came from the cache
    assert second[3].num_cached_tokens == 0
