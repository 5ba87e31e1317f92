"""Tiny checkpoints in the layouts DeepSeek-V4 is published in start with MTP and pass ``inspect``.

Layouts (``vllm_dsv4_mtp.testing.published_layouts``, built from the published facts, not the tiny builder's
defaults): the official release (FP8 ``.scale`` linears, I8 FP4 experts, config without ``expert_dtype``), AMD's
Quark MXFP4 export (its MTP layer MXFP4 experts + FP8 shared expert), and the same export with its MTP layer
excluded and kept in the original format. Each is served by vLLM's engine on CPU with the plugin's draft
(``{"method": "mtp", "num_speculative_tokens": 1}``, float32): the draft must really draft, and greedy
decoding must stay lossless, i.e. every generated token is the target's own argmax at its position (read
back from the same engine's prompt log-probabilities of the generated sequence).
"""

from __future__ import annotations

import pytest
import torch
from engines import vllm_engine

from vllm_dsv4_mtp.testing.published_layouts import build_published, config_of, stored_dtypes

LAYOUTS = ["official", "amd", "amd-mtp-original"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {layout: build_published(root / layout, layout, seed=0) for layout in LAYOUTS}


def test_layouts_are_the_published_ones(ckpts):
    official, amd, original = (stored_dtypes(ckpts[k]) for k in LAYOUTS)
    assert "expert_dtype" not in config_of(ckpts["official"])
    assert config_of(ckpts["official"])["quantization_config"]["quant_method"] == "fp8"
    assert official["mtp.0.ffn.experts.3.w1.weight"] == "I8" and official["mtp.0.ffn.experts.3.w1.scale"] == "F8_E8M0"
    assert official["mtp.0.e_proj.weight"] == "F8_E4M3" and official["mtp.0.e_proj.scale"] == "F8_E8M0"
    assert config_of(ckpts["amd"])["quantization_config"]["quant_method"] == "quark"
    assert amd["layers.1.ffn.shared_experts.w2.weight"] == "U8"  # FSE: main-layer shared experts MXFP4
    assert amd["layers.1.attn.wq_b.weight_scale"] == "F8_E8M0"  # Quark names the FP8 scales .weight_scale
    assert amd["mtp.0.ffn.experts.3.w1.weight"] == "U8" and amd["mtp.0.ffn.shared_experts.w1.weight"] == "F8_E4M3"
    assert original["mtp.0.ffn.experts.3.w1.weight"] == "I8" and "mtp.0.e_proj.scale" in original


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_accepts_the_published_layout(ckpts, layout, capsys):
    from vllm_dsv4_mtp.cli import main

    rc = main(["inspect", str(ckpts[layout])])
    out = capsys.readouterr().out
    assert rc == 0, out


def _argmax_of_target(llm, prompt, generated):
    """The target's greedy token at each generated position, from its prompt log-probabilities."""
    from vllm import SamplingParams

    seq = prompt + generated[:-1]
    out = llm.generate(
        [{"prompt_token_ids": seq}],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
        use_tqdm=False,
    )[0]
    picks = []
    for pos in range(len(prompt), len(seq)):
        lp = out.prompt_logprobs[pos]
        picks.append(max(lp.items(), key=lambda kv: kv[1].logprob)[0])
    return picks + [out.outputs[0].token_ids[0]]


@pytest.mark.engine
@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layout_serves_with_the_mtp_draft(ckpts, layout):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    with vllm_engine(
        ckpts[layout],
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ) as llm:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 40)]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        m = spec_decode_from_llm(llm.get_metrics())
        assert m is not None and m.num_drafts > 0, "the MTP draft never drafted"
        for p, o in zip(prompts, outs):
            gen = list(o.outputs[0].token_ids)
            assert len(gen) == 12
            assert gen == _argmax_of_target(llm, p, gen), layout
