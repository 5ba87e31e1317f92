"""The plugin's DeepSeek-V4 inside vLLM's real engine (float32, the real 4/128 compress ratios) against HF.

One ``LLM`` per module. The tiny BF16 checkpoint (``build_tiny_checkpoint``) uses layers SWA / C4 / C128 / C4,
a hash-routed first layer, 64 indexer heads (no exact ties of the indexer score) with ``index_topk = 8`` (so the
indexer selects once a sequence passes 32 tokens), and ``gate.bias`` scaled up so it alone selects experts
(``sharpen_routing``). Prompts of 5 / 130 / 300 / 520 tokens: beyond the 128-token window, 4 C128 entries and
130 C4 entries for the longest.

Enforced: the plugin class serves the architecture; prompt log-probabilities match HF float32 within
``MAX_ABS_LOGPROB`` with 100 % top-1 agreement; a greedy continuation decoded step by step through the paged
KV cache equals HF's argmax over the full sequence at every step.
"""

from __future__ import annotations

import operator

import pytest
from checkpoints import random_prompts, sharpened_tiny
from engines import PARITY_ENGINE

pytestmark = pytest.mark.engine

# float32 everywhere; measured max |dlogprob| ~3e-6 (summation order); 1e-4 leaves margin, far below any
# semantic error (a wrong window / entry / routing rule moves log-probs by > 1e-2)
MAX_ABS_LOGPROB = 1e-4
PROMPT_LENS = (5, 130, 300, 520)
RATIOS = [0, 4, 128, 4, 0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sharpened_tiny(tmp_path_factory, "dsv4", seed=0, compress_ratios=RATIOS, index_n_heads=64, index_topk=8)


@pytest.fixture(scope="module")
def llm(ckpt, start_engine):
    return start_engine(ckpt, apply_model=True, **PARITY_ENGINE)


@pytest.fixture(scope="module")
def hf(ckpt):
    from vllm_dsv4_mtp.testing.hf_oracle import load_hf_model

    return load_hf_model(ckpt)


def test_plugin_model_serves_the_architecture(llm):
    info = llm.apply_model(operator.methodcaller("describe"))[0]
    assert info["class"] == "vllm_dsv4_mtp.model.deepseek_v4.DeepseekV4ForCausalLM"
    assert info["compress_ratios"] == RATIOS[:4] and info["hash_layers"] == [0]
    assert info["expert_activation_quant"] == [False] * 4
    assert info["dtype"] == "torch.float32"
    # kv + C4 compressor [c|z] (2 x 2 x 128) + indexer [c|z] (2 x 2 x 128): one row width for all layers
    assert info["row_widths"] == [128, 128 + 512 + 512, 128 + 256, 128 + 512 + 512]
    assert info["cache_row_width"] == 1152
    assert info["mtp_hidden_buffer"] is None  # no speculative config: no pre-hc_head buffer


def test_generate_mixed_length_batch(llm):
    from vllm import SamplingParams

    prompts = random_prompts(PROMPT_LENS, seed=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    )
    gens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(g) for g in gens] == [16] * 4
    assert all(0 <= t < 512 for g in gens for t in g)
    assert len({tuple(g) for g in gens}) == 4  # different prompts, different continuations


def test_prompt_logprobs_match_hf(llm, hf):
    from vllm_dsv4_mtp.testing.hf_oracle import engine_prompt_logprobs_vs_hf

    prompts = random_prompts(PROMPT_LENS, seed=1)
    r = engine_prompt_logprobs_vs_hf(llm, prompts, hf)
    assert r["positions"] == sum(PROMPT_LENS) - 4
    assert r["max_abs"] <= MAX_ABS_LOGPROB, r
    assert r["top1"] == 1.0, r


def test_decode_equals_full_recompute(llm, hf):
    """Greedy tokens decoded one at a time over the paged cache == HF argmax over the whole sequence."""
    from vllm import SamplingParams

    from vllm_dsv4_mtp.testing.hf_oracle import greedy_agreement

    prompts = random_prompts((7, 126, 250, 381), seed=2)  # decode crosses t = 127 / 255 / 383 boundaries
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, detokenize=False)
    )
    r = greedy_agreement(outs, prompts, hf)
    assert r["steps"] == 4 * 24
    assert r["mismatches"] == 0, r
    assert r["ties"] <= 1, r
