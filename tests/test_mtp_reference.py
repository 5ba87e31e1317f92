"""The plugin's MTP draft inside vLLM's engine against the float32 reference MTP written from the spec.

One in-process engine (float32, K = 3): the test records every call vLLM's EAGLE/MTP proposer makes to the
draft (input ids, positions, the hidden states fed in, the state returned) during the first drafting round
of a batch of prompts, then checks, against oracles this draft does not share code with:

* the hidden states vLLM feeds the draft at step 1 are HF transformers' pre-``hc_head`` streams of the
  target (``reference.mtp.target_forward``), and the ids are the prompt shifted by one plus the sampled token;
* the draft's logits (step 1 over every prompt position: the catch-up that fills its SWA cache, the 160-token
  prompt passes the 128-token window; steps 2 and 3 with query length 1 on the draft's own state) equal
  ``vllm_dsv4_mtp.reference.mtp.ReferenceMTP`` (transformers' decoder block, float32) on the same weights.

``gate.bias`` is scaled (``sharpen_routing``) so expert selection cannot flip on float32 near-ties, and the
indexer has 64 heads so its top-k has no exact ties.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import random_prompts, sharpened_tiny
from engines import drafter, record_draft_calls, replay_first_round

pytestmark = pytest.mark.engine

K = 3
PROMPT_LENS = (160, 9, 37)
# float32 on both sides, different summation orders through 5 layers of mHC: measured 4e-6 on logits of
# std ~2; a wrong mask, rope, norm, position-0 mask or stream mix moves them by > 1e-2
LOGIT_ATOL = 1e-4
HIDDEN_ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 64 indexer heads: no exact ties of the C4 indexer's scores (as in test_model_engine)
    return sharpened_tiny(tmp_path_factory, "mtp-ref", seed=3, index_n_heads=64)


@pytest.fixture(scope="module")
def run(ckpt, start_engine):
    """Generate 2 tokens per prompt with K = 3 and record the draft's first round."""
    # in-process: the test reads the drafter's inputs
    llm = start_engine(
        ckpt,
        in_process=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )
    prompts = random_prompts(PROMPT_LENS, seed=7)
    calls, outs = record_draft_calls(llm, prompts)
    return {"draft": drafter(llm), "calls": calls, "prompts": prompts, "outs": outs}


@pytest.fixture(scope="module")
def oracles(ckpt):
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP
    from vllm_dsv4_mtp.testing.hf_oracle import load_hf_model

    return load_hf_model(ckpt), ReferenceMTP.from_checkpoint(ckpt)


def test_plugin_draft_serves_the_mtp_architecture(run):
    info = run["draft"].describe()
    assert info["class"] == "vllm_dsv4_mtp.model.mtp.DeepSeekV4MTPModel"
    assert info["dtype"] == "torch.float32"
    assert info["layers"] == [4]  # num_hidden_layers + 0
    assert info["compress_ratio"] == 0 and info["hash_routed"] is False  # SWA, bias-routed
    assert info["expert_activation_quant"] is False
    assert info["attention_layer"] == "model.layers.4.mtp_block.attn"
    assert info["shared_head_is_set"]  # vLLM attached the target's LM head


def _first_round(run):
    """Split the recorded calls of the first drafting round per request: step 1 rows and steps 2..K rows."""
    calls, prompts = run["calls"], run["prompts"]
    step1 = calls[0]
    n_tokens = sum(len(p) for p in prompts)
    assert step1["positions"].shape[0] == n_tokens, "the whole batch is prefilled in one step"
    later = calls[1:K]
    assert [c["positions"].shape[0] for c in later] == [len(prompts)] * (K - 1)  # query length 1 per request
    return step1, later


def test_step1_inputs_are_the_targets_streams_and_shifted_ids(run, oracles):
    from vllm_dsv4_mtp.reference.mtp import target_forward

    hf, _ = oracles
    step1, _ = _first_round(run)
    start = 0
    for prompt, out in zip(run["prompts"], run["outs"]):
        n = len(prompt)
        rows = slice(start, start + n)
        assert step1["positions"][rows].tolist() == list(range(n))
        assert step1["input_ids"][rows].tolist() == prompt[1:] + [out.outputs[0].token_ids[0]]
        with torch.no_grad():
            _, streams = target_forward(hf, torch.tensor([prompt]))
        fed = step1["hidden_states"][rows].view(n, 4, -1)
        torch.testing.assert_close(fed, streams[0], atol=HIDDEN_ATOL, rtol=0)
        start += n


def test_draft_logits_match_reference_mtp(run, oracles):
    """Step 1 over every prompt position, then steps 2..K at positions n, n+1 on the draft's own state."""
    _, ref = oracles
    step1, later = _first_round(run)
    worst = 0.0
    for row in replay_first_round(run["draft"], step1, later, run["prompts"], ref):
        got, want = row["got"], row["want"]
        worst = max(worst, (got - want).abs().max().item())
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
        if row["k"] == 0:
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            assert row["call"]["positions"][row["r"]].item() == len(run["prompts"][row["r"]]) + row["k"] - 1
            # the token fed at step k+1 is the draft's own argmax of step k
            assert row["token"].item() == row["prev"].argmax().item()
    print(f"max |draft - reference| logit difference: {worst:.2e}")
