"""Where the time of one engine step goes, MTP off against MTP K, at concurrency 1 (what explains the speedup).

    python -m vllm_dsv4_mtp.evaluate.stepcost --model DIR --mtp-k 2 [--num-problems 8] [--json OUT]

Runs vLLM's ``LLM`` (one engine at a time: MTP off, then MTP K) with the cpu-tiny profile's engine settings, its
engine core in its own process as in the server (so vLLM's CPU thread binding applies), and times with PyTorch
forward hooks (:mod:`.forward_hooks`) that this module registers in the worker through vLLM's public
``LLM.collective_rpc`` (functions are sent by reference, hence ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; nothing
of vLLM is replaced):

- the target model's forward (one call per engine step: 1 token without MTP, the K+1-token verify window
  with it) and its logits processor;
- the draft model's forward (K calls per step: the first over the verify window, then one token each) and
  its logits processor.

The time from one target forward's start to the next is the whole engine step (scheduler, input
preparation, sampling / rejection sampling, drafting, output processing); what the hooks do not cover is
reported as "other". Requests are sent one at a time, greedy, ``ignore_eos``, fixed length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from vllm_dsv4_mtp.evaluate.forward_hooks import Record, decoder_blocks, time_forward


def _hook_blocks(model, prefix: str) -> list[str]:
    """Time every decoder block's attention and MoE, summed per step as ``<prefix>_attention`` /
    ``<prefix>_moe``: a breakdown inside the ``<prefix>`` forward, not added to it."""
    found = set()
    for _, kind, mod in decoder_blocks(model):
        time_forward(mod, f"{prefix}_{kind}")
        found.add(f"{prefix}_{kind}")
    return sorted(found)


def install_hooks(worker) -> list[str]:
    """Run in the worker through ``collective_rpc``: time the target and (if any) draft forwards."""
    runner = worker.model_runner
    installed = []
    target = runner.model
    time_forward(target, "target")
    time_forward(target.logits_processor, "target_logits")
    installed += ["target", "target_logits"] + _hook_blocks(target, "target")
    drafter = getattr(runner, "drafter", None)
    draft = getattr(drafter, "model", None)
    if draft is not None:
        time_forward(draft, "draft")
        installed.append("draft")
        if draft.logits_processor is not target.logits_processor:
            time_forward(draft.logits_processor, "draft_logits")
            installed.append("draft_logits")
        installed += _hook_blocks(draft, "draft")
    return installed


PARTS = ("target", "target_logits", "draft", "draft_logits")  # disjoint; the rest of a step is "other"
SUBPARTS = ("target_attention", "target_moe", "draft_attention", "draft_moe")  # inside target / draft


def summarize(per_request: list[list[Record]], output_tokens: list[int], keep_quantile: float = 0.9) -> dict:
    """Per decode step (every target forward after a request's first, the prefill): step time, and the time of
    each part inside it, in ms, averaged over the decode steps no slower than the ``keep_quantile`` quantile
    of step time (on a shared machine the slowest steps are other processes' interference, not the model;
    dropping whole steps keeps parts + other = step exactly). ``tokens_per_step`` counts every decode step."""
    steps: list[dict] = []  # {"step": ms, part: ms, part + "_calls": n}
    tokens: dict[str, list[int]] = defaultdict(list)  # part -> tokens per call (all steps)
    for recs in per_request:
        recs = sorted(recs, key=lambda r: r[2])
        starts = [r[2] for r in recs if r[0] == "target"]
        # decode steps: [start of target forward i, start of target forward i+1), i >= 1 (0 is the prefill);
        # the last step ends with the request, at the last recorded event
        bounds = starts[1:] + [max(r[3] for r in recs)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            st = {"step": (b - a) * 1e3}
            inside = [r for r in recs if a <= r[2] < b]
            for part in PARTS + SUBPARTS:
                mine = [r for r in inside if r[0] == part]
                st[part] = sum(r[3] - r[2] for r in mine) * 1e3
                st[part + "_calls"] = len(mine)
                tokens[part] += [r[1] for r in mine]
            steps.append(st)
    n_steps = len(steps)
    if not n_steps:
        raise ValueError("no decode step recorded (were the hooks installed, and max_tokens > 1?)")
    all_ms = sorted(st["step"] for st in steps)
    cut = all_ms[max(0, math.ceil(keep_quantile * n_steps) - 1)]
    kept = [st for st in steps if st["step"] <= cut]
    step_ms = statistics.fmean(st["step"] for st in kept)
    tokens_per_step = (sum(output_tokens) - len(output_tokens)) / n_steps
    out = {
        "decode_steps": n_steps,
        "steps_kept": len(kept),
        "step_ms": round(step_ms, 3),
        "step_mean_all_ms": round(statistics.fmean(all_ms), 3),
        "step_p50_ms": round(statistics.median(all_ms), 3),
        "tokens_per_step": round(tokens_per_step, 3),
        "parts_ms": {},
        "calls_per_step": {},
        "tokens_per_call": {},
    }
    covered = 0.0
    for part in PARTS:
        if not tokens[part]:
            continue
        mean = statistics.fmean(st[part] for st in kept)
        covered += mean
        out["parts_ms"][part] = round(mean, 3)
        out["calls_per_step"][part] = round(statistics.fmean(st[part + "_calls"] for st in steps), 3)
        out["tokens_per_call"][part] = round(statistics.fmean(tokens[part]), 3)
    out["parts_ms"]["other"] = round(step_ms - covered, 3)
    out["subparts_ms"] = {
        part: round(statistics.fmean(st[part] for st in kept), 3) for part in SUBPARTS if tokens[part]
    }
    out["ms_per_output_token"] = round(step_ms / tokens_per_step, 3)
    return out


def measure(model: str, mtp_k: int | None, prompts: list[str], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_dsv4_mtp.evaluate.common import running

    # the hook functions must travel by reference (module name), not by value as they would from __main__, so
    # that the records they keep and the one that hands them back share the worker's module global
    from vllm_dsv4_mtp.evaluate.forward_hooks import take_records
    from vllm_dsv4_mtp.evaluate.stepcost import install_hooks

    spec = None if mtp_k is None else {"method": "mtp", "num_speculative_tokens": mtp_k}
    with running(
        LLM(
            model=model,
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=8,
            enforce_eager=True,
            speculative_config=spec,
            disable_log_stats=False,
        )
    ) as llm:
        installed = llm.collective_rpc(install_hooks)[0]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompts[0]], sp, use_tqdm=False)  # warm-up
        llm.collective_rpc(take_records)
        per_request, out_tokens, texts = [], [], []
        for p in prompts:
            o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            per_request.append(llm.collective_rpc(take_records)[0])
            out_tokens.append(len(o.token_ids))
            texts.append(o.text)
        res = summarize(per_request, out_tokens)
        res.update(mtp_k=mtp_k, hooks=installed, requests=len(prompts), output_tokens=sum(out_tokens))
        return res, texts


def explain(off: dict, on: dict) -> dict:
    """The concurrency-1 speedup as step costs: tokens per step x (step off / step on)."""
    k = on["mtp_k"]
    t1 = off["parts_ms"].get("target", 0.0)
    tv = on["parts_ms"].get("target", 0.0)
    draft = on["parts_ms"].get("draft", 0.0) + on["parts_ms"].get("draft_logits", 0.0)
    return {
        "mtp_k": k,
        "target_step_off_ms": off["step_ms"],
        "target_forward_1_token_ms": t1,
        f"target_forward_verify_{k + 1}_tokens_ms": tv,
        "draft_ms_per_step": round(draft, 3),
        "draft_forward_ms_per_call": round(
            on["parts_ms"].get("draft", 0.0) / max(on["calls_per_step"].get("draft", 1), 1e-9), 3
        ),
        "other_off_ms": off["parts_ms"]["other"],
        "other_on_ms": on["parts_ms"]["other"],
        "mtp_step_ms": on["step_ms"],
        "step_ratio": round(on["step_ms"] / off["step_ms"], 3),
        "tokens_per_step": on["tokens_per_step"],
        "predicted_speedup": round(on["tokens_per_step"] * off["step_ms"] / on["step_ms"], 3),
        "measured_ms_per_token_off": off["ms_per_output_token"],
        "measured_ms_per_token_on": on["ms_per_output_token"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mtp-k", type=int, default=2)
    ap.add_argument("--num-problems", type=int, default=8)
    ap.add_argument("--num-fewshot", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the result here too")
    args = ap.parse_args(argv)
    # collective_rpc sends this module's hook functions to the engine-core process (by reference)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_dsv4_mtp.evaluate.common import fewshot_examples, load_problems, machine, prompt_for

    shots = fewshot_examples(args.num_fewshot)
    prompts = [prompt_for(p, shots) for p in load_problems(limit=args.num_problems)]
    off, off_texts = measure(args.model, None, prompts, args.max_tokens)
    on, on_texts = measure(args.model, args.mtp_k, prompts, args.max_tokens)
    result = {
        "model": args.model,
        "machine": machine(),
        "num_fewshot": args.num_fewshot,
        "max_tokens": args.max_tokens,
        "off": off,
        "on": on,
        "explain": explain(off, on),
        "identical_outputs": sum(a == b for a, b in zip(off_texts, on_texts)),
        "requests": len(prompts),
    }
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def step_breakdown_markdown(bd: dict) -> str:
    """The table of :mod:`vllm_dsv4_mtp.evaluate.stepcost`'s measurement: one engine step at concurrency 1, MTP off
    against MTP K."""
    off, on = bd["off"], bd["on"]
    k = on["mtp_k"]

    def cell(run, part):
        ms = run["parts_ms"].get(part)
        if ms is None:
            return "–"
        if part == "other":
            return f"{ms:.2f}"
        calls, toks = run["calls_per_step"][part], run["tokens_per_call"][part]
        return f"{ms:.2f} ({calls:g} x {toks:.3g})"

    def sub(run, part):
        ms = run.get("subparts_ms", {}).get(part)
        return "–" if ms is None else f"{ms:.2f}"

    rows = [
        ("target forward", "target"),
        ("target logits", "target_logits"),
        ("draft (MTP) forward", "draft"),
        ("draft logits", "draft_logits"),
        ("other: scheduling, input preparation, sampling / rejection sampling, outputs", "other"),
    ]
    subs = {"target": ("target_attention", "target_moe"), "draft": ("draft_attention", "draft_moe")}
    lines = [
        f"| one engine step at concurrency 1, ms (calls per step x mean tokens per call) | MTP off | MTP K={k} |",
        "|---|---:|---:|",
    ]
    for name, part in rows:
        lines.append(f"| {name} | {cell(off, part)} | {cell(on, part)} |")
        for sp in subs.get(part, ()):
            if sp in off.get("subparts_ms", {}) or sp in on.get("subparts_ms", {}):
                what = (
                    "attention blocks" if sp.endswith("attention") else "MoE blocks (router, routed + shared experts)"
                )
                lines.append(f"| &nbsp;&nbsp;of which {what} | {sub(off, sp)} | {sub(on, sp)} |")
    lines += [
        f"| **whole step** (target forward start to the next) | **{off['step_ms']:.2f}** | **{on['step_ms']:.2f}** |",
        f"| tokens per step | {off['tokens_per_step']:.2f} | {on['tokens_per_step']:.2f} |",
        f"| ms per output token | {off['ms_per_output_token']:.2f} | {on['ms_per_output_token']:.2f} |",
    ]
    ex = bd["explain"]
    lines.append(
        f"\n(mean over decode steps; the slowest 10 % of steps of each run, interference from other processes, "
        f"dropped whole: {off['steps_kept']}/{off['decode_steps']} and {on['steps_kept']}/{on['decode_steps']} kept)"
    )
    lines.append(
        f"\nSpeedup at concurrency 1 = tokens per step x (step off / step on) = {ex['tokens_per_step']:.2f} x "
        f"({ex['target_step_off_ms']:.2f} / {ex['mtp_step_ms']:.2f}) = **{ex['predicted_speedup']:.2f}x** "
        f"({bd['requests']} requests, {bd['identical_outputs']}/{bd['requests']} outputs identical with and "
        "without MTP)."
    )
    return "\n".join(lines)


def run_stepcost(model: str, k: int, max_tokens: int, num_fewshot: int, out: Path) -> dict:
    """:mod:`vllm_dsv4_mtp.evaluate.stepcost` in its own process (it runs vLLM engines, one at a time, after the
    servers are gone)."""
    import shlex
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    path = out / "stepcost.json"
    argv = [
        sys.executable,
        "-m",
        "vllm_dsv4_mtp.evaluate.stepcost",
        "--model",
        model,
        "--mtp-k",
        str(k),
        "--max-tokens",
        str(max_tokens),
        "--num-fewshot",
        str(num_fewshot),
        "--json",
        str(path),
    ]
    print("# " + shlex.join(argv), file=sys.stderr, flush=True)
    with open(out / "stepcost.log", "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"step-cost measurement failed (status {rc}); see {out / 'stepcost.log'}")
    return json.loads(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
