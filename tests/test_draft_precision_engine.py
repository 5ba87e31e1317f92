"""The draft's precision through vLLM's engine: ``stored`` computes the stored schemes, ``bf16`` the exact upcast.

A tiny checkpoint (routing sharpened, 64 indexer heads) converted by ``dsv4-mtp quantize --mtp amd``: MTP routed
experts MXFP4 W4A4, MTP shared expert FP8 128x128 blocks, the rest of the MTP layer BF16. Two in-process float32
engines with K = 3, one per ``VLLM_DSV4_MTP_DRAFT_PRECISION``, record the draft's first drafting round as
``tests/test_mtp_reference.py`` does; the oracle is ``reference.mtp.ReferenceMTP`` (transformers' decoder block,
float32) on the exact decode of the stored MTP weights:

* ``bf16``: the draft's logits equal the reference's (the upcast changes no value);
* ``stored``: they equal the reference with the same rounding: each routed expert GEMM's input ``fake_quant``-ed
  to MXFP4 (``testing.hf_oracle.W4A4Experts``) and each shared-expert linear's input rounded to FP8 per 1x128 group
  (``formats.fp8.fake_quant_act``, hooked on the reference's ``nn.Linear`` inputs), all but a few rows where an
  input on a rounding boundary went the other way, and they differ from ``bf16``'s on most rows by far more than
  the tolerance (a ``stored`` that silently ran as ``bf16`` fails both).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import random_prompts, sharpened_tiny
from engines import drafter, record_draft_calls, replay_first_round, vllm_engine

pytestmark = pytest.mark.engine

K = 3
PROMPT_LENS = (160, 9, 37)
LOGIT_ATOL = 1e-4  # as tests/test_mtp_reference.py: float32 on both sides, different summation orders
MIN_ROUNDING_EFFECT = 1e-2  # stored vs bf16, per row (median): far above the tolerance
MAX_BOUNDARY_ROWS = 0.02  # rows where a rounding boundary went the other way (see the test)
BOUNDARY_ATOL = 0.1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_dsv4_mtp.quant.quantize import quantize_checkpoint

    src = sharpened_tiny(tmp_path_factory, "prec-src", seed=3, index_n_heads=64)
    out = src.parent / "amd-mtp"
    quantize_checkpoint(src, out, mtp="amd", progress=False)
    return out


def _record(llm):
    prompts = random_prompts(PROMPT_LENS, seed=7)
    calls, _ = record_draft_calls(llm, prompts)
    return {"draft": drafter(llm), "calls": calls, "prompts": prompts}


@pytest.fixture(scope="module")
def runs(ckpt):
    """One engine after the other (two in-process engines cannot share vLLM's distributed groups); the draft
    modules and their recorded calls outlive them."""
    out = {}
    for precision in ("bf16", "stored"):
        with vllm_engine(
            ckpt,
            in_process=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=4,
            skip_tokenizer_init=True,
            seed=0,
            env={"VLLM_DSV4_MTP_DRAFT_PRECISION": precision},
            speculative_config={"method": "mtp", "num_speculative_tokens": K},
        ) as llm:
            out[precision] = _record(llm)
    return out


def _reference(ckpt, rounded: bool):
    """ReferenceMTP on the exact decode of the stored MTP weights; ``rounded``: with the stored activation rounding."""
    import json

    from torch import nn
    from transformers import DeepseekV4Config

    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8, fake_quant_act
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP
    from vllm_dsv4_mtp.testing.hf_oracle import W4A4Experts

    reader = CheckpointReader(ckpt)
    tensors = {}
    for name in reader.names():
        if not (name.startswith("mtp.") or name in ("embed.weight", "head.weight")) or name.endswith(".weight_scale"):
            continue
        t = reader.get(name)
        scale = name[: -len("weight")] + "weight_scale"
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_block_fp8(t, reader.get(scale), torch.float32)
        elif t.dtype == torch.uint8:
            t = mxfp4.dequantize(t, reader.get(scale), torch.float32)
        tensors[name] = t
    config = DeepseekV4Config.from_dict(json.loads((ckpt / "config.json").read_text()))
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.copy_(tensors.pop("embed.weight").float())
        head.weight.copy_(tensors.pop("head.weight").float())
    ref = ReferenceMTP(config, embed, head)
    ref.load_native(tensors, source=str(ckpt))
    if rounded:
        moe = ref.block.mlp
        moe.experts = W4A4Experts(moe.experts)
        for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
            lin.register_forward_pre_hook(lambda m, args: (fake_quant_act(args[0]),))
    return ref.eval()


def _draft_logits_vs_reference(run, ref):
    """Every logit row of the first drafting round (step 1 over the prompts, steps 2..K) against ``ref``; returns
    ``(max |draft - ref| per row, the draft's logits in order)``."""
    calls = run["calls"]
    rows = list(replay_first_round(run["draft"], calls[0], calls[1:K], run["prompts"], ref))
    got = torch.cat([r["got"] if r["k"] == 0 else r["got"][None] for r in rows])
    want = torch.cat([r["want"] if r["k"] == 0 else r["want"][None] for r in rows])
    return (got - want).abs().amax(-1), got


def test_each_engine_runs_its_precision(runs):
    for precision, run in runs.items():
        info = run["draft"].describe()
        assert info["precision"] == precision
        assert info["expert_activation_quant"] is (precision == "stored")
        assert info["shared_fp8_inputs"] is (precision == "stored")


def test_bf16_on_a_quantized_mtp_layer_is_the_exact_upcast(runs, ckpt):
    diffs, _ = _draft_logits_vs_reference(runs["bf16"], _reference(ckpt, rounded=False))
    print(f"bf16 draft vs reference on the decoded weights: max |dlogit| {diffs.max():.2e} over {len(diffs)} rows")
    assert diffs.max() <= LOGIT_ATOL


def test_stored_computes_the_stored_scheme(runs, ckpt):
    diffs, stored = _draft_logits_vs_reference(runs["stored"], _reference(ckpt, rounded=True))
    _, bf16 = _draft_logits_vs_reference(runs["bf16"], _reference(ckpt, rounded=False))
    effect = (stored - bf16).abs().amax(-1)
    off = diffs > LOGIT_ATOL
    print(
        f"stored draft vs rounded reference: {off.sum()} of {len(diffs)} rows over {LOGIT_ATOL} (max "
        f"{diffs.max():.2e}); stored vs bf16 per row: median {effect.median():.2e}, max {effect.max():.2e}"
    )
    # a rounding input that sits on a boundary may go either way under another summation order upstream: such a
    # row moves by one rounding step's effect, far below what the scheme itself does to every row
    assert off.sum() <= MAX_BOUNDARY_ROWS * len(diffs)
    assert diffs.max() <= BOUNDARY_ATOL
    assert effect.median() > MIN_ROUNDING_EFFECT
