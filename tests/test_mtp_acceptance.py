"""Acceptance is real: an MTP layer built to agree with the target is accepted (nearly) always, in vLLM's engine.

The permutation model (``vllm_dsv4_mtp.testing.mtp_checkpoints.make_permutation_model``): the target's next
token is ``perm[current]`` and the MTP layer, fed the token after the current one, predicts ``perm`` of it,
which is the target's token after that. One engine (bfloat16, K = 3), 8 concurrent prompts of mixed
lengths; greedy requests, then sampled ones (temperature 1, rejection sampling; the model is so peaked that
sampling picks the chain too). vLLM's own spec-decode counters (``LLM.get_metrics()``) must show acceptance
near 100 % at every draft position. The random-MTP counterpart (acceptance near zero) is measured in
``test_mtp_lossless.py`` on its random checkpoint.
"""

from __future__ import annotations

import pytest
from checkpoints import random_prompts

pytestmark = pytest.mark.engine

K = 3
PROMPT_LENS = (2, 5, 9, 17, 33, 64, 130, 190)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from vllm_dsv4_mtp.testing.mtp_checkpoints import make_permutation_model
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint(tmp_path_factory.mktemp("mtp-perm") / "bf16", seed=5)
    perm = make_permutation_model(d, seed=5)
    return d, perm


@pytest.fixture(scope="module")
def llm(model, start_engine):
    return start_engine(
        model[0],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )


def _prompts(seed=11):
    return random_prompts(PROMPT_LENS, seed)


def _run(llm, prompts, params):
    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    before = spec_decode_from_llm(llm.get_metrics())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = spec_decode_from_llm(llm.get_metrics())
    assert after is not None, "no vllm:spec_decode_* counters: speculative decoding is not running"
    return [list(o.outputs[0].token_ids) for o in outs], after.since(before) if before else after


def test_greedy_agreeing_mtp_is_accepted(llm, model):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.testing.mtp_checkpoints import permutation_chain

    _, perm = model
    prompts = _prompts()
    gens, m = _run(
        llm, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    )
    # the target really is the permutation model, and speculation changed nothing
    assert gens == [permutation_chain(perm, p[-1], MAX_TOKENS) for p in prompts]
    print("greedy:", m.summary())
    assert m.num_drafts > 0 and m.num_draft_tokens == K * m.num_drafts
    assert m.acceptance_rate >= 0.95, m.to_dict()
    assert m.mean_acceptance_length >= 1 + 0.95 * K, m.to_dict()
    assert len(m.per_position) == K and min(m.per_position) >= 0.95, m.to_dict()
    # each verify step emits up to K + 1 tokens: far fewer drafts than tokens
    assert m.num_drafts <= len(prompts) * MAX_TOKENS / 3


def test_sampled_agreeing_mtp_is_accepted(llm, model):
    """Temperature-1 requests go through vLLM's rejection sampler; acceptance stays near 100 %."""
    from vllm import SamplingParams

    from vllm_dsv4_mtp.testing.mtp_checkpoints import permutation_chain

    _, perm = model
    prompts = _prompts(seed=12)
    gens, m = _run(
        llm, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True, detokenize=False)
    )
    # the target's top-1 has probability ~1 - 1e-8: sampling follows the chain
    assert gens == [permutation_chain(perm, p[-1], MAX_TOKENS) for p in prompts]
    print("sampled:", m.summary())
    assert m.acceptance_rate >= 0.95, m.to_dict()
    assert min(m.per_position) >= 0.95, m.to_dict()
