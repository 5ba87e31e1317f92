"""Measure the exported tiny model with HF transformers only (float32): held-out accuracy and MTP agreement.

    python -m vllm_dsv4_mtp.embedded.training.accuracy --ckpt vllm_dsv4_mtp/embedded/assets/tiny-dsv4-bf16 --shots 0 8

- **accuracy**: greedy decoding (HF's KV cache) of ``Question: ...\\nAnswer:`` prompts in lm-eval's gsm8k
  layout, zero-shot or k-shot with the shipped few-shot examples; exact match of the ``#### N`` value.
- **MTP agreement** (a proxy for vLLM's acceptance): over the greedy answers, teacher-forced on the
  target's own greedy tokens, how often the MTP draft equals the target's token: step 1 (``pos0``: the
  draft of token t+2) and step 2 given step 1 was right (``pos1``, drafted as vLLM does: recursion on the
  MTP's own state with step-1 cache entries as context). ``expected_acceptance_length_k2`` is
  ``1 + P(pos0) + P(pos0 and pos1)`` averaged over every position of the answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .. import BF16_CHECKPOINT_DIR, FEWSHOT_JSONL, TEST_JSONL
from .. import data as gsm

STOP = "\n\n"


def load(ckpt_dir: Path):
    """(target, mtp, tokenizer) from a native-name checkpoint directory, float32, eval mode."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    from ...reference.mtp import ReferenceMTP

    model = DeepseekV4ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    mtp = ReferenceMTP.from_checkpoint(ckpt_dir)
    tok = Tokenizer.from_file(str(Path(ckpt_dir) / "tokenizer.json"))
    return model, mtp, tok


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int = 128) -> tuple[list[int], list[int], str]:
    """Greedy continuation until a blank line (lm-eval's few-shot delimiter) or EOS.
    Returns (prompt ids, generated ids, generated text up to the stop)."""
    from transformers.cache_utils import DynamicCache

    ids = tok.encode(prompt).ids  # BOS added by the tokenizer's post-processor
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == model.config.eos_token_id:
            break
        out.append(nxt)
        text = tok.decode(out)
        if STOP in text:
            return ids, out, text.split(STOP)[0]
        x = torch.tensor([[nxt]])
    return ids, out, tok.decode(out)


@torch.no_grad()
def use_mxfp4_experts_(model, mxfp4_dir: Path) -> int:
    """Replace the target's routed experts by the MXFP4 decode of ``mxfp4_dir`` (a ``dsv4-mtp quantize``
    output): the weight-only effect of MXFP4 (no W4A4 activation rounding). Returns tensors replaced."""
    from ...formats.checkpoint import CheckpointReader
    from ...formats.mxfp4 import dequantize

    reader, n = CheckpointReader(mxfp4_dir), 0
    for i, layer in enumerate(model.model.layers):
        experts, inter = layer.mlp.experts, layer.mlp.experts.down_proj.shape[2]
        for e in range(experts.gate_up_proj.shape[0]):
            w = {}
            for k in ("w1", "w2", "w3"):
                name = f"layers.{i}.ffn.experts.{e}.{k}"
                w[k] = dequantize(reader.get(name + ".weight"), reader.get(name + ".weight_scale"))
            experts.gate_up_proj[e, :inter] = w["w1"]
            experts.gate_up_proj[e, inter:] = w["w3"]
            experts.down_proj[e] = w["w2"]
            n += 3
    return n


def accuracy(model, tok, problems: list[dict], fewshot: list[dict], limit: int | None = None) -> dict:
    rows = problems[:limit] if limit else problems
    correct, t0 = 0, time.time()
    for p in rows:
        _, _, text = greedy(model, tok, gsm.format_prompt(p["question"], fewshot))
        correct += gsm.answer_number(text) == gsm.answer_number(p["answer"])
    return {"n": len(rows), "correct": correct, "accuracy": correct / len(rows), "seconds": round(time.time() - t0, 1)}


@torch.no_grad()
def mtp_agreement(model, mtp, tok, problems: list[dict], fewshot: list[dict], limit: int | None = None) -> dict:
    """Draft/target agreement on the target's own greedy answers (see module doc)."""
    from ...reference.mtp import target_forward

    rows = problems[:limit] if limit else problems
    n = a1 = a12 = 0
    for p in rows:
        prompt_ids, gen, _ = greedy(model, tok, gsm.format_prompt(p["question"], fewshot))
        seq = torch.tensor([prompt_ids + gen])
        _, hidden = target_forward(model, seq)
        step1, step2 = mtp.forward_steps(hidden, seq, 2)
        d1, d2 = step1[0].argmax(-1), step2[0].argmax(-1)
        L = seq.shape[1]
        # drafting points: the target has produced token t+1 (a generated token), drafts t+2 and t+3
        for t in range(len(prompt_ids) - 1, L - 3):
            n += 1
            ok1 = bool(d1[t] == seq[0, t + 2])
            a1 += ok1
            a12 += ok1 and bool(d2[t] == seq[0, t + 3])
    return {
        "positions": n,
        "pos0": a1 / n,
        "pos1_given_pos0": a12 / max(a1, 1),
        "expected_acceptance_length_k2": 1 + (a1 + a12) / n,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=BF16_CHECKPOINT_DIR)
    ap.add_argument("--shots", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--limit", type=int, default=None, help="first N held-out problems only")
    ap.add_argument("--mtp-limit", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--mxfp4-experts",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the target with the routed experts decoded from this MXFP4 checkpoint",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, mtp, tok = load(args.ckpt)
    if args.mxfp4_experts:
        print(f"routed experts from {args.mxfp4_experts}: {use_mxfp4_experts_(model, args.mxfp4_experts)} tensors")
    test, fewshot_pool = gsm.read_jsonl(TEST_JSONL), gsm.read_jsonl(FEWSHOT_JSONL)
    results: dict = {"ckpt": str(args.ckpt)}
    for k in args.shots:
        results[f"accuracy_{k}shot"] = accuracy(model, tok, test, fewshot_pool[:k], args.limit)
        print(json.dumps({f"accuracy_{k}shot": results[f"accuracy_{k}shot"]}), flush=True)
    if args.mtp_limit:
        results["mtp_agreement_0shot"] = mtp_agreement(model, mtp, tok, test, [], args.mtp_limit)
        print(json.dumps({"mtp_agreement_0shot": results["mtp_agreement_0shot"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
