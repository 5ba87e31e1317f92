"""``dsv4-mtp demo`` (what ``make demo`` runs): the embedded MXFP4 tiny DeepSeek-V4 served on CPU by vLLM with the
plugin and its BF16 MTP draft (K = 2), answering held-out problems.

It serves the model through ``dsv4-mtp serve --profile cpu-tiny`` (MTP K=2), asks a handful of held-out
problems (drawn at random from the held-out set with a printed seed; ``--seed`` repeats a draw) one at a time
(greedy, stop at the blank line that ends an answer), and prints each answer, whether its ``#### N`` is right,
the acceptance length of that request (from the server's ``/metrics``) and its speed; then serves the same model
with MTP off, asks the same problems, and prints tokens/s with and without MTP and whether the answers are
identical (greedy speculative decoding must not change them), beside the held-out accuracy the model was measured
at over the whole set (``embedded/assets/measured.json``).

Both runs are measured the same way: decode tokens/s = answer tokens after the first / the engine's
first-to-last-token time (:mod:`.engine_clock`), end-to-end tokens/s = answer tokens / the client's
request-to-last-chunk time, each a ratio of sums over the run.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STOP = ["\n\n"]  # lm-eval's few-shot delimiter: the embedded model ends every answer with a blank line


@dataclass
class Answer:
    """One answer, timed on two clocks: ``e2e_s`` on the client's (request sent -> last chunk read) and
    ``decode_s`` on the engine's (first -> last generated token, :mod:`.engine_clock`)."""

    text: str
    correct: bool
    output_tokens: int  # tokens in the answer the client got (usage.completion_tokens)
    e2e_s: float
    decode_s: float
    acceptance_length: float | None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first per second of engine decode time (None for a one-token answer)."""
        return (self.output_tokens - 1) / self.decode_s if self.output_tokens > 1 and self.decode_s > 0 else None


@dataclass
class RunSummary:
    """One server's answers, each rate a ratio of sums (one slow or one bursty answer cannot dominate)."""

    right: int
    n: int
    output_tokens: int
    decode_tok_s: float | None  # sum(tokens - 1) / sum(engine decode time)
    e2e_mean_s: float  # client clock
    e2e_tok_s: float  # sum(tokens) / sum(client e2e time)
    acceptance_length: float | None


def summarize(answers: list[Answer]) -> RunSummary:
    decode_s = sum(a.decode_s for a in answers)
    after_first = sum(max(a.output_tokens - 1, 0) for a in answers)
    e2e = sum(a.e2e_s for a in answers)
    tokens = sum(a.output_tokens for a in answers)
    als = [a.acceptance_length for a in answers if a.acceptance_length is not None]
    return RunSummary(
        right=sum(a.correct for a in answers),
        n=len(answers),
        output_tokens=tokens,
        decode_tok_s=after_first / decode_s if decode_s > 0 else None,
        e2e_mean_s=e2e / len(answers),
        e2e_tok_s=tokens / e2e,
        acceptance_length=statistics.fmean(als) if als else None,
    )


def choose_model(model: str | None) -> tuple[str, str]:
    """(checkpoint dir, description): ``--model``, else the embedded MXFP4 checkpoint
    (:class:`~.common.MissingCheckpointError` when it is not there)."""
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    from .common import require_checkpoint

    if model:
        return model, f"{model} (--model)"
    return (
        str(require_checkpoint(MXFP4_CHECKPOINT_DIR, "--model DIR")),
        "the embedded tiny DeepSeek-V4, MXFP4 experts (Quark OCP MX)",
    )


def ask_all(base_url: str, model: str, problems: list[dict], prompts: list[str], max_tokens: int) -> list[Answer]:
    """Each problem alone (concurrency 1), so the ``/metrics`` growth around a request is that request's."""
    from .client import complete
    from .common import is_correct
    from .engine_clock import snapshot, wait_finished

    before = snapshot(base_url)
    complete(base_url, model, prompts[0], max_tokens=4)  # warm-up: a server's first request is slow
    before = wait_finished(base_url, before)
    out = []
    for p, prompt in zip(problems, prompts):
        c = complete(base_url, model, prompt, max_tokens=max_tokens, temperature=0.0, stop=STOP, stream=True)
        after = wait_finished(base_url, before)
        spec = after.spec.since(before.spec) if after.spec is not None and before.spec is not None else None
        out.append(
            Answer(
                c.text,
                is_correct(c.text, p),
                c.output_tokens,
                c.latency_s,
                after.totals.since(before.totals).decode_s,
                spec.mean_acceptance_length if spec is not None else None,
            )
        )
        before = after
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="serve the embedded MXFP4 model with MTP on CPU and ask it held-out problems",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", help="checkpoint directory (default: the embedded MXFP4 model)")
    p.add_argument("--mtp-k", type=int, default=2, help="draft tokens K (default 2)")
    p.add_argument("--num-problems", type=int, default=5, help="held-out problems to ask (default 5)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random draw of problems (default: a new one)")
    p.add_argument("--num-fewshot", type=int, default=0, help="solved examples before each question (default 0)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length limit (default 128)")
    p.add_argument("--no-baseline", action="store_true", help="skip the MTP-off run (no tokens/s comparison)")
    p.add_argument("--profile", default="cpu-tiny", help="dsv4-mtp serve profile (default cpu-tiny)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the server logs go (default: a temp dir)")
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for each server's /health (default 600)"
    )
    p.set_defaults(func=run)
    return p


def _fmt(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.embedded import data as gsm

    from .common import MissingCheckpointError, fewshot_examples, load_problems, prompt_for
    from .engine_clock import EngineClockError
    from .server import ManagedServer, ServerSpec, ServerStartError, served_model_name, spec_label

    try:
        model, described = choose_model(args.model)
    except MissingCheckpointError as e:
        print(f"dsv4-mtp demo: error: {e}", file=sys.stderr)
        return 2
    k: int | None = args.mtp_k
    seed = args.seed if args.seed is not None else secrets.randbelow(10**6)
    problems = draw_problems(load_problems(), args.num_problems, seed)
    fewshot = fewshot_examples(args.num_fewshot)
    prompts = [prompt_for(p, fewshot) for p in problems]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dsv4-demo-logs-"))

    print(
        f"dsv4-mtp demo: {described}\n  checkpoint: {model}\n  serving with vLLM on CPU through "
        f"`dsv4-mtp serve --profile {args.profile}`, {spec_label(k)}; {len(problems)} held-out problems drawn "
        f"with --seed {seed}, {args.num_fewshot}-shot, greedy",
        flush=True,
    )

    runs: dict[str, list[Answer]] = {}
    order = [k] + ([None] if k is not None and not args.no_baseline else [])
    try:
        for kk in order:
            spec = ServerSpec(model=model, mtp_k=kk, profile=args.profile)
            label = spec_label(kk)
            print(f"\n== {label}: starting the server (vLLM engine start takes a minute on CPU) ...", flush=True)
            t0 = time.perf_counter()
            with ManagedServer(
                spec,
                log_path=log_dir / f"server-{'off' if kk is None else f'k{kk}'}.log",
                start_timeout_s=args.start_timeout,
                quiet=True,
            ) as srv:
                print(f"   ready after {time.perf_counter() - t0:.0f} s on {srv.base_url}", flush=True)
                answers = ask_all(srv.base_url, served_model_name(srv.base_url), problems, prompts, args.max_tokens)
            runs[label] = answers
            if kk == k:  # the main run: show every answer
                for i, (p, a) in enumerate(zip(problems, answers), 1):
                    got, want = gsm.answer_number(a.text), gsm.answer_number(p["answer"])
                    print(f"\n[{i}] Q: {p['question']}")
                    print("    A: " + a.text.strip().replace("\n", "\n       "))
                    print(
                        f"    -> {got if got is not None else '(no #### answer)'}: "
                        f"{'RIGHT' if a.correct else 'WRONG'} (expected {want}) | acceptance length "
                        f"{_fmt(a.acceptance_length, '{:.2f}')} | {a.output_tokens} tokens, decode "
                        f"{_fmt(a.decode_tok_s)} tok/s, {a.e2e_s:.2f} s end to end",
                        flush=True,
                    )
    except (ServerStartError, EngineClockError) as e:
        print(f"dsv4-mtp demo: error: {e}", file=sys.stderr)
        return 1
    print_summary(described, runs, k)
    if not args.model:
        print(f"   {measured_line(args.num_fewshot)}")
    return 0


def draw_problems(pool: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` distinct problems of ``pool``, in the order a ``random.Random(seed)`` draws them."""
    return random.Random(seed).sample(pool, min(n, len(pool)))


def measured_line(num_fewshot: int) -> str:
    """What the shipped model scored over the whole held-out set, as recorded in ``embedded/assets/measured.json``
    by ``embedded.training.record`` from a ``dsv4-mtp eval --ab`` run."""
    from vllm_dsv4_mtp.embedded import MEASURED_JSON

    try:
        rec = json.loads(MEASURED_JSON.read_text())
    except (OSError, ValueError) as e:
        return f"held-out accuracy of the whole set: not recorded ({MEASURED_JSON}: {e})"
    runs = {r["label"]: r for r in rec["runs"]}
    row = runs.get("MXFP4 MTP K=2") or next(iter(runs.values()))
    shots = "" if rec["num_fewshot"] == num_fewshot else f", {rec['num_fewshot']}-shot"
    return (
        f"held-out accuracy measured over all {row['n']} problems ({row['label']}{shots}, dsv4-mtp eval --ab): "
        f"{row['correct']}/{row['n']} = {100 * row['accuracy']:.1f} % (95 % interval {100 * row['ci95'][0]:.1f}"
        f"-{100 * row['ci95'][1]:.1f} %)"
    )


def print_summary(described: str, runs: dict[str, list[Answer]], k: int | None) -> None:
    """The table (one row per server) and, with a baseline, the speedup on both clocks and answer identity."""
    from .server import spec_label

    sums = {label: summarize(answers) for label, answers in runs.items()}
    main = sums[spec_label(k)]
    print(f"\n== summary ({described})")
    print(f"   right: {main.right}/{main.n}")
    print(
        "   | run | right | mean acceptance length | answer tokens | decode tok/s (engine clock) "
        "| e2e s (mean) | e2e tok/s |\n   |---|---:|---:|---:|---:|---:|---:|"
    )
    for label, r in sums.items():
        print(
            f"   | {label} | {r.right}/{r.n} | {_fmt(r.acceptance_length, '{:.2f}')} | {r.output_tokens} | "
            f"{_fmt(r.decode_tok_s)} | {r.e2e_mean_s:.2f} | {r.e2e_tok_s:.1f} |"
        )
    print(
        "   decode tok/s: answer tokens after the first / the engine's first-to-last-token time (vLLM's "
        "request_decode_time_seconds); e2e: this client's clock, request sent to last chunk read"
    )
    if k is None or "MTP off" not in runs:
        return
    on, off = main, sums["MTP off"]
    if on.decode_tok_s and off.decode_tok_s:
        print(
            f"   MTP K={k} vs MTP off: decode {on.decode_tok_s:.1f} vs {off.decode_tok_s:.1f} tokens/s "
            f"({on.decode_tok_s / off.decode_tok_s:.2f}x); end to end {on.e2e_tok_s:.1f} vs {off.e2e_tok_s:.1f} "
            f"tokens/s ({on.e2e_tok_s / off.e2e_tok_s:.2f}x, mean {off.e2e_mean_s:.2f} s -> {on.e2e_mean_s:.2f} s)"
        )
    same = sum(a.text == b.text for a, b in zip(runs[spec_label(k)], runs["MTP off"]))
    print(f"   answers identical with and without MTP: {same}/{main.n}")
