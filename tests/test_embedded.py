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


COLUMNS = re.compile(r"(\d+) ([-+]) (\d+): (.+)\.")
COLUMN = re.compile(r"(1?\d) ([-+]) (\d)(?: [-+] ([01]))? = (\d+)")


def read_back(a: int, op: str, b: int, cols: str) -> int:
    """Check each written column of ``a op b`` (ones first) against the digits of ``a`` and ``b`` and the carry
    or borrow of the column before; return the number the columns spell."""
    parts = cols.split(", ")
    assert len(parts) == max(len(str(a)), len(str(b))), cols
    carry, digits = 0, []
    for i, part in enumerate(parts):
        m = COLUMN.fullmatch(part)
        assert m and m.group(2) == op, part
        top, y, c, r = int(m.group(1)), int(m.group(3)), m.group(4), int(m.group(5))
        assert (c is None) == (i == 0) and int(c or 0) == carry, part
        x = top % 10 if op == "-" else top
        assert x == (a // 10**i) % 10 and y == (b // 10**i) % 10, (part, a, b)
        if op == "+":
            assert r == x + y + carry, part
            digits.append(r if i == len(parts) - 1 else r % 10)
            carry = r // 10
        else:
            borrowed = top >= 10
            assert r == top - y - carry and 0 <= r <= 9 and borrowed == (x - y - carry < 0), part
            digits.append(r)
            carry = int(borrowed)
    return int("".join(str(d) for d in reversed(digits)))


def test_answers_are_gsm8k_format_and_arithmetically_right():
    """Every written step is right: the one-line ``a op b = c`` steps, and the columns of each sum or difference
    with a multi-digit operand, which spell the result of the step that follows them."""
    train, test = gsm.make_splits(seed=0, n_train=500, n_test=100)
    kinds, worked = set(), 0
    for p in train + test:
        lines = p["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", lines[-1]), p
        steps = []
        for i, line in enumerate(lines[:-1]):
            if m := COLUMNS.fullmatch(line):
                a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
                assert max(a, b) >= 10, line  # single-digit sums are table facts, not worked
                spelled = read_back(a, op, b, m.group(4))
                assert spelled == (a + b if op == "+" else a - b), (line, spelled)
                assert re.search(rf"{a} \{op} {b} = \$?{spelled}\b", lines[i + 1]), (line, lines[i + 1])
                worked += 1
                continue
            steps += ARITH.findall(line)
        assert steps, p
        for a, op, b, c in steps:
            a, b, c = int(a), int(b), int(c)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b if a % b == 0 else None}[op] == c, p
            assert op in "*/" or max(a, b) < 10 or any(COLUMNS.fullmatch(x) for x in lines), p
        assert int(steps[-1][3]) == int(gsm.answer_number(p["answer"])), p  # the last step is the answer
        kinds.add(len(steps))
    assert kinds == {1, 2} and worked > 300  # one- and two-step problems, most with worked columns


def test_shipped_data_is_the_generators_output():
    train, test = gsm.make_splits(seed=0, n_train=20000, n_test=1000)
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
    # an exact numeric answer is right by chance ~never; the whole held-out set is assets/measured.json's business
    assert acc["correct"] >= 14, acc
    agree = mtp_agreement(model, mtp, tok, test, [], limit=3)
    assert agree["pos0"] >= 0.9 and agree["expected_acceptance_length_k2"] >= 2.6, agree


def test_record_takes_a_whole_set_eval_and_refuses_a_limited_one():
    """``training.record`` turns an ``eval --ab`` report into what the demo prints; a ``--limit`` run would be
    printed as the held-out accuracy, so it is refused."""
    import pytest

    from vllm_dsv4_mtp.embedded.training.record import measured
    from vllm_dsv4_mtp.evaluate.common import wilson_interval

    row = {
        "label": "MXFP4 MTP K=2",
        "score": {"n": 1000, "strict": 0.912},
        "strict_correct": 912,
        "strict_ci95": list(wilson_interval(912, 1000)),
        "spec_decode": {"mean_acceptance_length": 2.8},
    }
    rec = measured({"task": "local", "num_fewshot": 0, "limit": None, "rows": [row]}, "dsv4-mtp eval --ab")
    (run,) = rec["runs"]
    assert (run["n"], run["correct"], run["accuracy"], run["mean_acceptance_length"]) == (1000, 912, 0.912, 2.8)
    assert run["ci95"][0] < 0.912 < run["ci95"][1]
    with pytest.raises(ValueError, match="--limit 40"):
        measured({"task": "local", "num_fewshot": 0, "limit": 40, "rows": [row]}, "x")


def test_the_recorded_held_out_accuracy_is_of_the_shipped_weights():
    """What ``dsv4-mtp demo`` prints as the held-out accuracy was measured on the checkpoints that ship, over the
    whole held-out set: a retrain without a new record fails here."""
    from vllm_dsv4_mtp.embedded import MEASURED_JSON
    from vllm_dsv4_mtp.embedded.training.record import weights_digest

    rec = json.loads(MEASURED_JSON.read_text())
    runs = {r["label"]: r for r in rec["runs"]}
    digests = {"BF16": weights_digest(BF16_CHECKPOINT_DIR), "MXFP4": weights_digest(MXFP4_CHECKPOINT_DIR)}
    assert {label.split()[0] for label in runs} == set(digests)
    for label, r in runs.items():
        assert r["weights"] == digests[label.split()[0]], label
        assert r["n"] == len(gsm.read_jsonl(TEST_JSONL)) and 0 <= r["correct"] <= r["n"]


def test_retrain_runs_its_whole_recipe_into_a_folder_of_its_own(tmp_path):
    """``training.retrain``, the one command behind the shipped assets, for 2 steps: data and tokenizer byte for
    byte the shipped ones, a BF16 checkpoint in the shipped layout, its MXFP4 twin; the shipped assets untouched."""
    import subprocess
    import sys

    shipped = {f: f.read_bytes() for f in BF16_CHECKPOINT_DIR.iterdir()}
    out = tmp_path / "assets"
    r = subprocess.run(
        [sys.executable, "-m", "vllm_dsv4_mtp.embedded.training.retrain", "--steps", "2", "--work", str(tmp_path / "w")]
        + ["--assets", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rel in ("gsm_tiny_test.jsonl", "gsm_tiny_fewshot.jsonl", "tokenizer/tokenizer.json"):
        assert (out / rel).read_bytes() == (ASSETS_DIR / rel).read_bytes(), rel
    assert set(_header(out / "tiny-dsv4-bf16")) == set(_header(BF16_CHECKPOINT_DIR))
    assert set(_header(out / "tiny-dsv4-mxfp4")) == set(_header(MXFP4_CHECKPOINT_DIR))
    first = json.loads(next(x for x in (tmp_path / "w" / "train.log").read_text().splitlines() if x.startswith("{")))
    # the shipped run's first logged step (embedded/README.md): same seed, data order and thread count
    assert first["step"] == 1 and abs(first["loss"] - 6.4813) < 1e-3, first
    assert torch.load(tmp_path / "w" / "state.pt", weights_only=False)["step"] == 2
    assert {f: f.read_bytes() for f in BF16_CHECKPOINT_DIR.iterdir()} == shipped
