"""Lossless: greedy outputs with the MTP draft (K = 1, 2, 3) equal the outputs without it, token for token.

A random tiny checkpoint (every architectural feature; head scaled x8 and ``gate.bias`` scaled so expert
selection cannot flip on rounding noise: ``sharpen_routing``), 8 concurrent prompts of 3 to 260 tokens (beyond
the 128-token window of the target's SWA layer and of the draft's), one engine per setting, started one at a
time. The random MTP layer almost never agrees with the random target, so nearly every draft is rejected: the
verify / reject / re-draft path runs at every step, and vLLM's counters show acceptance near zero (the agreeing
counterpart is ``test_mtp_acceptance.py``).

float32: speculation changes the batch shapes the target computes (a verify of K + 1 tokens per request instead
of one; with chunked prefill, different chunk splits, since decode tokens share the budget), and in bfloat16
those shapes move log-probabilities by ~1e-2..1e-1, enough to flip HF near-ties (seen: a top-2 gap of 0.074 on
the first token of a 200-token prompt flipped between MTP off and K = 3 under a 64-token chunk budget, the MTP
run agreeing with HF float32). In float32 the same noise is ~1e-6, so equality token for token tests the
speculation, not rounding. bfloat16 is covered by ``test_mtp_acceptance.py`` (outputs equal the permutation
chain) and by the benchmark in ``docs/benchmarks.md`` (8 x 32 greedy tokens identical for K = 1, 2, 3).
Chunked prefill (prompts prefilled, and drafted over, in pieces) is checked against HF float32 separately.
"""

from __future__ import annotations

import pytest
from checkpoints import random_prompts, sharpened_tiny
from engines import vllm_engine

pytestmark = pytest.mark.engine

PROMPT_LENS = (3, 7, 20, 45, 90, 130, 200, 260)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sharpened_tiny(tmp_path_factory, "mtp-lossless", seed=2, head_scale=8.0)


def _prompts(seed=21):
    return random_prompts(PROMPT_LENS, seed)


@pytest.fixture(scope="module")
def generate(ckpt):
    """``generate(k)``: greedy outputs and spec-decode counters of an engine with K = k drafts (0 = MTP off)."""
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    cache = {}

    def run(k: int):
        if k not in cache:
            sc = {"method": "mtp", "num_speculative_tokens": k} if k else None
            with vllm_engine(
                ckpt,
                dtype="float32",
                enforce_eager=True,
                max_model_len=512,
                max_num_seqs=8,
                skip_tokenizer_init=True,
                seed=0,
                speculative_config=sc,
                disable_log_stats=False,
            ) as llm:
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in _prompts()],
                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False),
                    use_tqdm=False,
                )
                cache[k] = ([list(o.outputs[0].token_ids) for o in outs], spec_decode_from_llm(llm.get_metrics()))
        return cache[k]

    return run


def test_mtp_off_baseline(generate):
    gens, spec = generate(0)
    assert [len(g) for g in gens] == [MAX_TOKENS] * len(PROMPT_LENS)
    assert len({tuple(g) for g in gens}) == len(gens)
    assert spec is None  # no speculative config: vLLM exports no spec-decode counters


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_outputs_equal_mtp_off(generate, k):
    base, _ = generate(0)
    gens, spec = generate(k)
    for i, (a, b) in enumerate(zip(gens, base)):
        assert a == b, (
            f"prompt {i} ({PROMPT_LENS[i]} tokens), K={k}: first difference at step "
            f"{next(j for j in range(len(a)) if a[j] != b[j])}"
        )
    # the draft really ran at every step, and a random MTP layer is (nearly) never accepted
    assert spec is not None and spec.num_drafts >= len(PROMPT_LENS) * (MAX_TOKENS - 1) / 2
    assert spec.num_draft_tokens == k * spec.num_drafts
    assert len(spec.per_position) == k
    print(f"K={k}:", spec.summary())
    assert spec.acceptance_rate <= 0.1, spec.to_dict()


def test_chunked_prefill_with_mtp_follows_the_target(ckpt):
    """K = 2 with chunked prefill (64-token budget) and prompts of 20 / 130 / 200 tokens: every greedy token is
    HF's float32 argmax over the whole sequence (the target's function, teacher-forced)."""
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm
    from vllm_dsv4_mtp.testing.hf_oracle import greedy_agreement, load_hf_model

    # VLLM_MLA_DISABLE: vLLM otherwise forces chunked prefill off for model_type deepseek_v4
    with vllm_engine(
        ckpt,
        env={"VLLM_MLA_DISABLE": "1"},
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        seed=0,
        disable_log_stats=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    ) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
        prompts = random_prompts((20, 130, 200), seed=22)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        spec = spec_decode_from_llm(llm.get_metrics())
    assert spec is not None and spec.num_drafts > 0
    r = greedy_agreement(outs, prompts, load_hf_model(ckpt))
    assert r["steps"] == 3 * 8 and r["mismatches"] == 0, r
