"""MXFP4 weight-only (W4A16) experts through vLLM's engine equal HF on the exactly dequantized weights.

One ``LLM`` per module, float32. Same tiny MXFP4 checkpoint as ``test_model_engine_mxfp4`` but its Quark config
declares no activation quantization (``global_quant_config.input_tensors: null``), so the plugin decodes the
packed E2M1 / E8M0 weights exactly and runs the GEMMs unrounded: the result must equal HF float32 on the
dequantized BF16 copy up to summation order. Enforced: max |dlogprob| <= 1e-4, 100 % top-1, and greedy decode
over the paged cache equal to HF's full-sequence argmax.
"""

from __future__ import annotations

import json
import operator

import pytest
from checkpoints import random_prompts, sharpened_tiny
from engines import PARITY_ENGINE

pytestmark = pytest.mark.engine

MAX_ABS_LOGPROB = 1e-4
PROMPT_LENS = (5, 130, 300, 520)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = sharpened_tiny(tmp_path_factory, "w4a16", seed=0, experts="mxfp4", index_n_heads=64)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["global_quant_config"]["input_tensors"] = None  # weight-only
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


@pytest.fixture(scope="module")
def llm(ckpt, start_engine):
    return start_engine(ckpt, apply_model=True, **PARITY_ENGINE)


@pytest.fixture(scope="module")
def hf(ckpt, tmp_path_factory):
    from vllm_dsv4_mtp.testing.hf_oracle import dequantized_copy, load_hf_model

    return load_hf_model(dequantized_copy(ckpt, tmp_path_factory.mktemp("deq") / "bf16"))


def test_weight_only_mxfp4_equals_hf_on_dequantized_weights(llm, hf):
    from vllm_dsv4_mtp.testing.hf_oracle import engine_prompt_logprobs_vs_hf

    info = llm.apply_model(operator.methodcaller("describe"))[0]
    assert info["expert_activation_quant"] == [False] * 4
    prompts = random_prompts(PROMPT_LENS, seed=0)
    r = engine_prompt_logprobs_vs_hf(llm, prompts, hf)
    assert r["max_abs"] <= MAX_ABS_LOGPROB, r
    assert r["top1"] == 1.0, r


def test_weight_only_mxfp4_decode_equals_recompute(llm, hf):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.testing.hf_oracle import greedy_agreement

    prompts = random_prompts((9, 140, 260), seed=3)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=20, temperature=0.0, detokenize=False)
    )
    r = greedy_agreement(outs, prompts, hf)
    assert r["steps"] == 60 and r["mismatches"] == 0 and r["ties"] <= 1, r
