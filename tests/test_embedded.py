"""The embedded default: data generator, tokenizer, native export round trip, and the shipped checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from vllm_dsv4_mtp.embedded import ASSETS_DIR, BF16_CHECKPOINT_DIR, FEWSHOT_JSONL, MXFP4_CHECKPOINT_DIR, TEST_JSONL
from vllm_dsv4_mtp.embedded import data as gsm

ARITH = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")


# ------------------------------------------------------------------------------------------------ data


def test_generator_is_deterministic_and_splits_are_disjoint():
    train_a, test_a = gsm.make_splits(seed=3, n_train=400, n_test=100)
    train_b, test_b = gsm.make_splits(seed=3, n_train=400, n_test=100)
    assert train_a == train_b and test_a == test_b
    assert gsm.make_splits(seed=4, n_train=400, n_test=100)[1] != test_a
    q_train, q_test = {p["question"] for p in train_a}, {p["question"] for p in test_a}
    assert len(q_test) == 100 and len(q_train) == 400 and not (q_train & q_test)


def test_answers_are_gsm8k_format_and_arithmetically_right():
    train, test = gsm.make_splits(seed=0, n_train=500, n_test=100)
    kinds = set()
    for p in train + test:
        lines = p["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", lines[-1]), p
        steps = [m for line in lines[:-1] for m in ARITH.findall(line)]
        assert steps, p
        for a, op, b, c in steps:
            a, b, c = int(a), int(b), int(c)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b if a % b == 0 else None}[op] == c, p
        assert int(steps[-1][3]) == int(gsm.answer_number(p["answer"])), p  # the last step is the answer
        kinds.add(len(steps))
    assert kinds == {1, 2}  # one- and two-step problems


def test_shipped_data_is_the_generators_output():
    train, test = gsm.make_splits(seed=0, n_train=20000, n_test=300)
    assert gsm.read_jsonl(TEST_JSONL) == test
    fewshot = gsm.read_jsonl(FEWSHOT_JSONL)
    assert fewshot == train[: len(fewshot)] and len(fewshot) >= 8
    assert not {p["question"] for p in fewshot} & {p["question"] for p in test}


def test_build_assets_regenerates_the_shipped_files_byte_for_byte(tmp_path):
    """``python -m vllm_dsv4_mtp.embedded.data --seed 0`` (what the embedded README says made them): the held-out
    set, the few-shot examples and the tokenizer, trained with the tiny checkpoints' one BPE trainer."""
    gsm.build_assets(tmp_path, seed=0)
    for rel in (
        "gsm_tiny_test.jsonl",
        "gsm_tiny_fewshot.jsonl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ):
        assert (tmp_path / rel).read_bytes() == (ASSETS_DIR / rel).read_bytes(), rel


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_loads_for_transformers_and_vllm_deepseek_v4_mode():
    """vLLM 0.32 forces tokenizer_mode=deepseek_v4 for DeepseekV4ForCausalLM: TokenizersBackend on the
    model directory, DeepSeek's chat encoder on top. Both must load the shipped files."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.deepseek_v4 import DeepseekV4Tokenizer

    text = gsm.format_prompt(gsm.read_jsonl(TEST_JSONL)[0]["question"])
    hf = AutoTokenizer.from_pretrained(BF16_CHECKPOINT_DIR)
    vl = DeepseekV4Tokenizer.from_pretrained(str(BF16_CHECKPOINT_DIR))
    ids = hf(text)["input_ids"]
    assert ids[0] == 0 and vl.encode(text) == ids  # BOS (id 0) prepended, same ids
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    digits = hf.convert_ids_to_tokens(hf("It travels 48 miles")["input_ids"])
    assert digits[-3:-1] == ["Ġ4", "8"]  # numbers are spelled digit by digit
    chat = vl.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True)
    assert chat[0] == 0 and hf.convert_tokens_to_ids("<｜User｜>") in chat  # DeepSeek's chat tokens are single ids
    assert len(hf) <= json.loads((BF16_CHECKPOINT_DIR / "config.json").read_text())["vocab_size"]


# ------------------------------------------------------------------------------------------------ export


def test_export_roundtrip_through_hf_from_pretrained(tmp_path):
    """export -> DeepseekV4ForCausalLM.from_pretrained (transformers' own native-name conversion) gives
    identical logits; the MTP layer comes back identical through the reference loader."""
    from transformers import DeepseekV4ForCausalLM

    from vllm_dsv4_mtp.embedded.training.export import export_checkpoint
    from vllm_dsv4_mtp.embedded.training.recipe import MODEL_CONFIG, build_models
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP, target_forward

    torch.set_num_threads(1)
    model, mtp = build_models(MODEL_CONFIG, seed=5)
    with torch.no_grad():  # perturb the zero/one-initialised tensors so every name matters
        for p in list(model.parameters()) + list(mtp.parameters()):
            p.add_(torch.randn_like(p) * 0.05)
        for gate in [l.mlp.gate for l in model.model.layers if not l.mlp.is_hash] + [mtp.block.mlp.gate]:
            gate.e_score_correction_bias.normal_()
    out = export_checkpoint(model, mtp, MODEL_CONFIG, ASSETS_DIR / "tokenizer", tmp_path / "ckpt")
    ids = torch.randint(3, 600, (1, 300), generator=torch.Generator().manual_seed(0))  # > window, C128 emits
    model.eval()
    mtp.eval()
    loaded = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mtp2 = ReferenceMTP.from_checkpoint(out)
    with torch.no_grad():
        logits, hidden = target_forward(model, ids)
        logits2, hidden2 = target_forward(loaded, ids)
        torch.testing.assert_close(logits2, logits, rtol=0, atol=0)
        torch.testing.assert_close(hidden2, hidden, rtol=0, atol=0)
        for a, b in zip(mtp2.forward_steps(hidden, ids, 2), mtp.forward_steps(hidden, ids, 2)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ shipped


def _header(ckpt: Path) -> dict:
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    r = CheckpointReader(ckpt)
    return {n: r.info(n) for n in r.names()}


def test_shipped_bf16_checkpoint_layout():
    cfg = json.loads((BF16_CHECKPOINT_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    assert cfg["num_nextn_predict_layers"] == 1
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 1 and cfg["compress_ratios"][-1] == 0
    assert {0, 4, 128} <= set(cfg["compress_ratios"]) and cfg["num_hash_layers"] >= 1
    info = _header(BF16_CHECKPOINT_DIR)
    for name, ti in info.items():
        if name.endswith("tid2eid"):
            want = "I64"
        elif name.endswith(("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")):
            want = "F32"
        else:
            want = "BF16"
        assert ti.dtype == want, (name, ti.dtype)
    n = cfg["num_hidden_layers"]
    assert "layers.0.ffn.gate.tid2eid" in info and f"layers.{n - 1}.ffn.gate.bias" in info
    assert "mtp.0.e_proj.weight" in info and "mtp.0.hc_head_fn" in info and "mtp.0.ffn.gate.bias" in info
    assert not any(k.startswith("mtp.0.") and ("compressor" in k or "indexer" in k) for k in info)


def test_shipped_checkpoints_fit_the_size_budget():
    from vllm_dsv4_mtp.evaluate.common import has_checkpoint

    dirs = (BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR)
    assert all(has_checkpoint(d) for d in dirs), dirs  # both ship: neither may drop out of the budget
    total = sum(f.stat().st_size for d in dirs for f in d.iterdir())
    assert total <= 25 * 2**20, total


def test_shipped_checkpoint_answers_held_out_problems_through_hf():
    """The trained model, loaded by HF transformers from the native files, solves held-out problems
    zero-shot (greedy), and its MTP drafts mostly agree with the target (README has the full numbers)."""
    from vllm_dsv4_mtp.embedded.training.accuracy import accuracy, load, mtp_agreement

    torch.set_num_threads(1)
    model, mtp, tok = load(BF16_CHECKPOINT_DIR)
    test = gsm.read_jsonl(TEST_JSONL)
    acc = accuracy(model, tok, test, [], limit=16)
    # an exact numeric answer is right by chance ~never; measured 134/300 zero-shot (embedded/README.md)
    assert acc["correct"] >= 3, acc
    agree = mtp_agreement(model, mtp, tok, test, [], limit=3)
    assert agree["pos0"] >= 0.8 and agree["expected_acceptance_length_k2"] >= 2.0, agree  # measured 0.97 / 2.90
