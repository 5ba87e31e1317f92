"""``dsv4-mtp demo`` (what ``make demo`` runs): the embedded MXFP4 tiny DeepSeek-V4 served on CPU by vLLM with the
plugin and its BF16 MTP draft (K = 2), answering held-out problems.

It serves the model through ``dsv4-mtp serve --profile cpu-tiny`` (MTP K=2), asks a handful of held-out
problems one at a time (greedy, stop at the blank line that ends an answer), and prints each answer, whether
its ``#### N`` is right, the acceptance length of that request (from the server's ``/metrics``) and its
decode speed; then serves the same model with MTP off, asks the same problems, and prints tokens/s with and
without MTP and whether the answers are identical (greedy speculative decoding must not change them).

What it runs falls back, saying so, while parts of the project are missing: the BF16 embedded checkpoint
when the MXFP4 one has not been built, a random tiny checkpoint when no embedded one exists, MTP off when the
plugin does not register its draft yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STOP = ["\n\n"]  # lm-eval's few-shot delimiter: the embedded model ends every answer with a blank line


@dataclass
class Answer:
    text: str
    correct: bool
    output_tokens: int
    latency_s: float
    decode_tok_s: float | None
    acceptance_length: float | None


def choose_model(model: str | None, notes: list[str]) -> tuple[str, str]:
    """(checkpoint dir, description); appends to ``notes`` what is missing and who it waits on."""
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    from .common import embedded_models

    if model:
        return model, f"{model} (--model)"
    models = embedded_models()
    if "MXFP4" in models:
        return str(models["MXFP4"]), "the embedded tiny DeepSeek-V4, MXFP4 experts (Quark OCP MX)"
    if "BF16" in models:
        notes.append(f"{MXFP4_CHECKPOINT_DIR} is not built yet (training engineer: `dsv4-mtp quantize` of the "
                     "BF16 checkpoint): serving the embedded BF16 checkpoint instead")
        return str(models["BF16"]), "the embedded tiny DeepSeek-V4, BF16 (MXFP4 not built yet)"
    notes.append("no embedded trained checkpoint yet (training engineer, vllm_dsv4_mtp/embedded/assets): "
                 "serving a RANDOM tiny MXFP4 checkpoint, so answers are noise")
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    out = Path(tempfile.mkdtemp(prefix="dsv4-demo-")) / "random-tiny-mxfp4"
    return str(build_tiny_checkpoint(out, experts="mxfp4")), f"a random tiny MXFP4 checkpoint ({out})"


def ask_all(base_url: str, model: str, problems: list[dict], prompts: list[str], max_tokens: int) -> list[Answer]:
    """Each problem alone (concurrency 1), so the ``/metrics`` delta around a request is that request's."""
    from vllm_dsv4_mtp.serve.metrics import scrape

    from .client import complete
    from .common import is_correct
    from .server import server_root

    complete(base_url, model, prompts[0], max_tokens=4)  # warm-up: a server's first request is slow
    out = []
    for p, prompt in zip(problems, prompts):
        before = scrape(server_root(base_url))
        c = complete(base_url, model, prompt, max_tokens=max_tokens, temperature=0.0, stop=STOP, stream=True)
        after = scrape(server_root(base_url))
        al = None
        if before is not None and after is not None:
            al = after.since(before).mean_acceptance_length
        tpot = c.tpot_s
        out.append(Answer(c.text, is_correct(c.text, p), c.output_tokens, c.latency_s,
                          None if not tpot else 1.0 / tpot, al))
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="serve the embedded MXFP4 model with MTP on CPU and ask it held-out problems",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the embedded MXFP4 model)")
    p.add_argument("--mtp-k", type=int, default=2, help="draft tokens K (default 2)")
    p.add_argument("--num-problems", type=int, default=5, help="held-out problems to ask (default 5)")
    p.add_argument("--num-fewshot", type=int, default=0, help="solved examples before each question (default 0)")
    p.add_argument("--max-tokens", type=int, default=96, help="answer length limit (default 96)")
    p.add_argument("--no-baseline", action="store_true", help="skip the MTP-off run (no tokens/s comparison)")
    p.add_argument("--profile", default="cpu-tiny", help="dsv4-mtp serve profile (default cpu-tiny)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the server logs go (default: a temp dir)")
    p.set_defaults(func=run)
    return p


def _fmt(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.embedded import data as gsm

    from .common import fewshot_examples, load_problems, mtp_draft_registered, prompt_for
    from .server import ManagedServer, ServerSpec, ServerStartError, spec_label

    notes: list[str] = []
    model, described = choose_model(args.model, notes)
    k: int | None = args.mtp_k
    if not mtp_draft_registered():
        notes.append("the plugin registers no MTP draft yet (MTP engineer: DeepSeekV4MTPModel in "
                     "vllm_dsv4_mtp/registration.py DRAFT_MODELS): serving with MTP OFF, no acceptance length")
        k = None
    problems = load_problems(limit=args.num_problems)
    fewshot = fewshot_examples(args.num_fewshot)
    prompts = [prompt_for(p, fewshot) for p in problems]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dsv4-demo-logs-"))

    print(f"dsv4-mtp demo: {described}\n  checkpoint: {model}\n  serving with vLLM on CPU through "
          f"`dsv4-mtp serve --profile {args.profile}`, {spec_label(k)}; {len(problems)} held-out problems, "
          f"{args.num_fewshot}-shot, greedy", flush=True)
    for n in notes:
        print(f"  WAITING: {n}", flush=True)

    runs: dict[str, list[Answer]] = {}
    order = [k] + ([None] if k is not None and not args.no_baseline else [])
    try:
        for kk in order:
            spec = ServerSpec(model=model, mtp_k=kk, profile=args.profile)
            label = spec_label(kk)
            print(f"\n== {label}: starting the server (vLLM engine start takes a minute on CPU) ...", flush=True)
            t0 = time.perf_counter()
            with ManagedServer(spec, log_path=log_dir / f"server-{'off' if kk is None else f'k{kk}'}.log",
                               quiet=True) as srv:
                print(f"   ready after {time.perf_counter() - t0:.0f} s on {srv.base_url}", flush=True)
                answers = ask_all(srv.base_url, spec.served_model_name, problems, prompts, args.max_tokens)
            runs[label] = answers
            if kk == k:  # the main run: show every answer
                for i, (p, a) in enumerate(zip(problems, answers), 1):
                    got, want = gsm.answer_number(a.text), gsm.answer_number(p["answer"])
                    print(f"\n[{i}] Q: {p['question']}")
                    print("    A: " + a.text.strip().replace("\n", "\n       "))
                    print(f"    -> {got if got is not None else '(no #### answer)'}: "
                          f"{'RIGHT' if a.correct else 'WRONG'} (expected {want}) | acceptance length "
                          f"{_fmt(a.acceptance_length, '{:.2f}')} | {a.output_tokens} tokens, "
                          f"{_fmt(a.decode_tok_s)} tok/s", flush=True)
    except ServerStartError as e:
        print(f"dsv4-mtp demo: error: {e}", file=sys.stderr)
        return 1

    main = runs[spec_label(k)]
    right = sum(a.correct for a in main)
    print(f"\n== summary ({described})")
    print(f"   right: {right}/{len(main)}")
    header = "   | run | right | mean acceptance length | decode tok/s (mean) | e2e s (mean) |"
    print(header + "\n   |---|---:|---:|---:|---:|")
    speeds = {}
    for label, answers in runs.items():
        als = [a.acceptance_length for a in answers if a.acceptance_length is not None]
        tps = [a.decode_tok_s for a in answers if a.decode_tok_s]
        speeds[label] = statistics.fmean(tps) if tps else None
        print(f"   | {label} | {sum(a.correct for a in answers)}/{len(answers)} | "
              f"{_fmt(statistics.fmean(als) if als else None, '{:.2f}')} | {_fmt(speeds[label])} | "
              f"{statistics.fmean(a.latency_s for a in answers):.2f} |")
    if k is not None and "MTP off" in runs:
        same = sum(a.text == b.text for a, b in zip(main, runs["MTP off"]))
        on, off = speeds[spec_label(k)], speeds["MTP off"]
        if on and off:
            print(f"   tokens/s with MTP K={k}: {on:.1f}, without: {off:.1f} ({on / off:.2f}x)")
        print(f"   answers identical with and without MTP: {same}/{len(main)}")
    for n in notes:
        print(f"   WAITING: {n}")
    return 0
