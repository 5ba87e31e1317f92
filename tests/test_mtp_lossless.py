"""Lossless: greedy outputs with the MTP draft (K = 1, 2, 3) equal the outputs without it, token for token.

A random tiny checkpoint (every architectural feature), bfloat16, made stable for greedy decoding under bf16
rounding and the verify step's different batch shapes: head scaled x8 (peaked logits) and ``gate.bias`` scaled
so expert selection cannot flip on rounding noise (``sharpen_routing``; without it, bf16 near-ties of HF's
top-2 log-probabilities within ~0.1 were seen to flip at a few of 256 steps, with or without MTP).
8 concurrent prompts of 3 to 260
tokens (beyond the 128-token window of the target's SWA layer and of the draft's). One engine per setting,
started one at a time. The random MTP layer almost never agrees with the random target, so nearly every draft
is rejected: the verify / reject / re-draft path runs at every step, and vLLM's counters show acceptance near
zero (the agreeing counterpart is ``test_mtp_acceptance.py``).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.engine

PROMPT_LENS = (3, 7, 20, 45, 90, 130, 200, 260)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_dsv4_mtp.model.hf_oracle import sharpen_routing
    from vllm_dsv4_mtp.model.mtp_checkpoints import scale_head
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint(tmp_path_factory.mktemp("mtp-lossless") / "bf16", seed=2)
    scale_head(d, 8.0)
    sharpen_routing(d)
    return d


def _prompts(vocab=512, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def generate(ckpt):
    """``generate(k)``: greedy outputs and spec-decode counters of an engine with K = k drafts (0 = MTP off)."""
    from vllm import LLM, SamplingParams

    from vllm_dsv4_mtp.model.mtp_bench import spec_decode_from_llm

    cache = {}

    def run(k: int):
        if k not in cache:
            sc = {"method": "mtp", "num_speculative_tokens": k} if k else None
            llm = LLM(model=str(ckpt), dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                      skip_tokenizer_init=True, seed=0, speculative_config=sc, disable_log_stats=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                               detokenize=False), use_tqdm=False)
            cache[k] = ([list(o.outputs[0].token_ids) for o in outs], spec_decode_from_llm(llm.get_metrics()))
            del llm
            gc.collect()
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
        assert a == b, f"prompt {i} ({PROMPT_LENS[i]} tokens), K={k}: first difference at step " \
                       f"{next(j for j in range(len(a)) if a[j] != b[j])}"
    # the draft really ran at every step, and a random MTP layer is (nearly) never accepted
    assert spec is not None and spec.num_drafts >= len(PROMPT_LENS) * (MAX_TOKENS - 1) / 2
    assert spec.num_draft_tokens == k * spec.num_drafts
    assert len(spec.per_position) == k
    print(f"K={k}:", spec.summary())
    assert spec.acceptance_rate <= 0.1, spec.to_dict()
