"""Rows of rejected MTP drafts never change a later step's output, through vLLM's engine (float32).

The portable attention stores each compressed entry (and the C4 indexer's key) in the cache row of the token
that completes its block, computed in the step that writes that token (``attention/backend.py``). In a
verify window the drafts' rows are written, and a draft at position ``4 j + 3`` / ``128 j + 127`` completes a
C4 / C128 block with an entry made from the draft's row. With a random MTP layer nearly every draft is
rejected; prompts of 126 and 254 tokens put the first verify window's drafts at positions 127 / 128 and 255 /
256 (completing C128 blocks 0 and 1 and C4 blocks 31 and 63), and every later window puts drafts on C4
boundaries. Enforced: the greedy tokens with MTP K=2 equal MTP off and HF float32's argmax over the whole
sequence at every step, and vLLM's counters show the drafts were (nearly all) rejected.
"""

from __future__ import annotations

import pytest
from checkpoints import random_prompts, sharpened_tiny
from engines import vllm_engine

pytestmark = pytest.mark.engine

PROMPT_LENS = (126, 254, 125, 31)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sharpened_tiny(tmp_path_factory, "mtp-rejected", seed=4, head_scale=8.0)


def _run(ckpt, k: int):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    prompts = random_prompts(PROMPT_LENS, seed=31)
    sc = {"method": "mtp", "num_speculative_tokens": k} if k else None
    with vllm_engine(
        ckpt,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=sc,
        disable_log_stats=False,
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        spec = spec_decode_from_llm(llm.get_metrics())
    return prompts, outs, spec


def test_rejected_drafts_leave_later_steps_unchanged(ckpt):
    from vllm_dsv4_mtp.testing.hf_oracle import greedy_agreement, load_hf_model

    prompts, outs_on, spec = _run(ckpt, 2)
    _, outs_off, _ = _run(ckpt, 0)
    on = [list(o.outputs[0].token_ids) for o in outs_on]
    off = [list(o.outputs[0].token_ids) for o in outs_off]
    assert on == off
    # drafts ran at every step and were (nearly all) rejected, so their rows were written and then overwritten
    assert spec is not None and spec.num_drafts >= len(PROMPT_LENS) * (MAX_TOKENS - 1) / 3
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert rejected >= 0.8 * spec.num_draft_tokens, spec.to_dict()
    r = greedy_agreement(outs_on, prompts, load_hf_model(ckpt))
    assert r["steps"] == len(PROMPT_LENS) * MAX_TOKENS and r["mismatches"] == 0, r
