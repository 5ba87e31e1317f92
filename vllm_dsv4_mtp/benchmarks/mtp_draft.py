"""Measure the MTP draft in vLLM's engine: acceptance from vLLM's own counters and ms per step, MTP on vs off.

``LLM(..., disable_log_stats=False).get_metrics()`` returns vLLM's spec-decode counters
(``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` /
``_num_accepted_tokens_per_pos``, the same ones the OpenAI server exports on ``/metrics``);
``serve.metrics.spec_decode_from_llm`` turns them into ``vllm_dsv4_mtp.serve.metrics.SpecDecodeMetrics``
(acceptance rate,
mean acceptance length, per-position acceptance), so offline runs and servers report the same numbers.

Command line (one run: the same prompts through an engine per setting, one at a time)::

    python -m vllm_dsv4_mtp.benchmarks.mtp_draft [--checkpoint DIR [--questions JSONL] | --model permutation|random] \\
        [--k 0 1 2 3] [--prompts 8] [--max-tokens 32] [--dtype bfloat16]

prints, per setting, engine start time, decode time, ms per engine step, output tokens/s and the acceptance
numbers, and checks that the greedy outputs equal the MTP-off run token for token.
"""

from __future__ import annotations

import argparse
import json
import time

from vllm_dsv4_mtp.serve.metrics import SpecDecodeMetrics, engine_steps, spec_decode_from_llm


def prompts_for(vocab: int, n: int, seed: int = 0, lens=(3, 9, 17, 33, 60, 100, 140, 200)) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def question_prompts(ckpt: str, path: str, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` questions of a JSONL file, in the embedded model's prompt layout."""
    from transformers import AutoTokenizer

    from vllm_dsv4_mtp.embedded.data import format_prompt

    tok = AutoTokenizer.from_pretrained(ckpt)
    with open(path) as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()][:n]
    return [tok(format_prompt(q))["input_ids"] for q in questions]


def run_setting(ckpt: str, k: int, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    """Start an engine (MTP with ``k`` drafts, or off when ``k == 0``), generate greedily, measure."""
    from vllm import LLM, SamplingParams

    from vllm_dsv4_mtp.evaluate.common import running

    sc = {"method": "mtp", "num_speculative_tokens": k} if k else None
    t0 = time.perf_counter()
    with running(
        LLM(
            model=ckpt,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=len(prompts),
            skip_tokenizer_init=True,
            seed=0,
            speculative_config=sc,
            disable_log_stats=False,
        )
    ) as llm:
        start_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        # warm-up request (first-call costs), then the measured batch
        llm.generate(
            [{"prompt_token_ids": prompts[0][:4]}], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False
        )
        before = llm.get_metrics()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        after = llm.get_metrics()
        steps = (engine_steps(after) or 0) - (engine_steps(before) or 0)
        spec = spec_decode_from_llm(after)
        if spec is not None:
            spec = spec.since(spec_decode_from_llm(before) or SpecDecodeMetrics())
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "k": k,
        "engine_start_s": round(start_s, 1),
        "generate_s": round(gen_s, 2),
        "engine_steps": steps,
        "ms_per_step": round(1000 * gen_s / steps, 1) if steps else None,
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / gen_s, 1),
        "acceptance": None if spec is None else spec.to_dict(),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def synthetic_checkpoint(args, p: argparse.ArgumentParser) -> str:
    """``--model permutation|random``: a tiny checkpoint whose MTP layer drafts perfectly / at random."""
    import tempfile

    try:  # the synthetic drafts are test fixtures: in the repository, not in the wheel
        from vllm_dsv4_mtp.testing.mtp_checkpoints import make_permutation_model, scale_head
    except ImportError:
        p.error(
            f"--model {args.model} needs vllm_dsv4_mtp.testing (a repository clone; the wheel leaves it "
            "out): pass --checkpoint DIR"
        )
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tempfile.mkdtemp(prefix="dsv4-mtp-bench-"), seed=0))
    if args.model == "permutation":
        make_permutation_model(ckpt, seed=0)
    else:
        scale_head(ckpt, args.head_scale)
        if args.sharpen_routing:
            from vllm_dsv4_mtp.testing.hf_oracle import sharpen_routing

            sharpen_routing(ckpt)
    return ckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_dsv4_mtp.benchmarks.mtp_draft", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a DeepSeek-V4 checkpoint directory with mtp.* weights")
    p.add_argument(
        "--model",
        choices=["permutation", "random"],
        default="permutation",
        help="without --checkpoint: build a tiny model (permutation: MTP agrees with the target; "
        "random: random weights, head scaled by --head-scale)",
    )
    p.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument(
        "--questions",
        help='a JSONL file of {"question": ...} (e.g. the embedded held-out set): '
        "prompts are its first --prompts questions in the embedded model's layout, tokenized with the "
        "checkpoint's tokenizer, instead of random token ids",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--head-scale", type=float, default=4.0, help="--model random: multiply the head by this")
    p.add_argument(
        "--sharpen-routing",
        action="store_true",
        help="--model random: scale gate.bias so expert choice cannot flip on rounding noise",
    )
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)

    ckpt = args.checkpoint or synthetic_checkpoint(args, p)
    with open(f"{ckpt}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    prompts = (
        prompts_for(vocab, args.prompts) if not args.questions else question_prompts(ckpt, args.questions, args.prompts)
    )
    results = [run_setting(ckpt, k, prompts, args.max_tokens, args.dtype) for k in args.k]
    base = next((r for r in results if r["k"] == 0), None)
    print(
        f"checkpoint {ckpt} ({args.model if args.checkpoint is None else 'given'}), {args.dtype}, "
        f"{'questions from ' + args.questions if args.questions else 'random token prompts'}, "
        f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each"
    )
    print(
        "| MTP K | engine steps | ms/step | output tok/s | acceptance rate | mean acceptance length "
        "| per-position acceptance | outputs == MTP off |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        a = r["acceptance"] or {}
        same = "-" if base is None or r is base else ("yes" if r["tokens"] == base["tokens"] else "NO")
        rate, mal = a.get("acceptance_rate"), a.get("mean_acceptance_length")
        pos = a.get("per_position_acceptance")
        print(
            f"| {r['k'] or 'off'} | {r['engine_steps']} | {r['ms_per_step']} | {r['output_tokens_per_s']} | "
            f"{'-' if rate is None else f'{rate:.3f}'} | {'-' if mal is None else f'{mal:.2f}'} | "
            f"{'-' if not pos else ' / '.join(f'{x:.2f}' for x in pos)} | {same} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if base is None or all(r["tokens"] == base["tokens"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
