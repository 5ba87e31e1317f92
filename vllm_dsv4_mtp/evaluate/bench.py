"""``dsv4-mtp bench``: a concurrency sweep, MTP off against MTP K, as in the DeepSeek-V3 MTP articles.

For each concurrency C (default 1, 2, 4, 8, 16, 32, 64) a fixed number of requests (``max(8, 2 C)`` unless
``--num-requests``) is sent with at most C in flight, to a server on 127.0.0.1. Every request is a held-out
problem in lm-eval's gsm8k layout, greedy (temperature 0), streamed, with exactly ``--max-tokens`` output
tokens (``ignore_eos``), so MTP on and off do the same work. Reported per C: requests, end-to-end latency
(mean / p50 / p90), TTFT, TPOT (mean / p50 / p90), output tokens/s, and, from the server's ``/metrics``
spec-decode counters scraped before and after the level, the mean acceptance length and per-position
acceptance; with both runs, the speedup of MTP over off (mean end-to-end latency, TPOT, throughput).

Servers: ``--base-url`` (and ``--baseline-url`` for the MTP-off server) for running servers, or ``--serve``
to start them one at a time through ``dsv4-mtp serve --profile cpu-tiny`` (off first, then MTP K).
Writes ``bench.json``, ``bench.md`` and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class LevelResult:
    """One concurrency level of one server. Times in milliseconds."""

    concurrency: int
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    mean_prompt_tokens: float
    output_tok_s: float
    requests_per_s: float
    e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    ttft_mean_ms: float | None
    tpot_mean_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    acceptance_length: float | None = None
    acceptance_rate: float | None = None
    per_position_acceptance: list[float] | None = None
    drafts: float | None = None
    errors: list[str] = field(default_factory=list)


@dataclass
class BenchRun:
    """A sweep against one server."""

    label: str
    base_url: str
    mtp_k: int | None
    levels: list[LevelResult]
    startup_s: float | None = None

    def level(self, c: int) -> LevelResult | None:
        return next((lv for lv in self.levels if lv.concurrency == c), None)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def run_level(
    base_url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    num_requests: int,
    *,
    max_tokens: int,
    offset: int = 0,
    timeout_s: float = 600.0,
) -> LevelResult:
    """``num_requests`` requests with at most ``concurrency`` in flight; acceptance from ``/metrics`` deltas."""
    from vllm_dsv4_mtp.serve.metrics import scrape

    from .client import complete
    from .server import server_root

    def one(i: int):
        try:
            return complete(
                base_url,
                model,
                prompts[(offset + i) % len(prompts)],
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                stream=True,
                timeout=timeout_s,
            )
        except (OSError, urllib.error.URLError, RuntimeError, ValueError) as e:
            return f"request {i}: {type(e).__name__}: {e}"

    before = scrape(server_root(base_url))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as ex:
        results = list(ex.map(one, range(num_requests)))
    duration = time.perf_counter() - t0
    after = scrape(server_root(base_url))

    ok = [r for r in results if not isinstance(r, str)]
    errors = [r for r in results if isinstance(r, str)]
    if not ok:
        raise RuntimeError(f"concurrency {concurrency}: all {num_requests} requests to {base_url} failed: {errors[:3]}")
    e2e = [r.latency_s for r in ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    lv = LevelResult(
        concurrency=concurrency,
        requests=num_requests,
        failed=len(errors),
        duration_s=round(duration, 3),
        output_tokens=out_tokens,
        mean_prompt_tokens=round(statistics.fmean(r.prompt_tokens for r in ok), 1),
        output_tok_s=round(out_tokens / duration, 2),
        requests_per_s=round(len(ok) / duration, 3),
        e2e_mean_ms=_ms(statistics.fmean(e2e)),
        e2e_p50_ms=_ms(percentile(e2e, 50)),
        e2e_p90_ms=_ms(percentile(e2e, 90)),
        ttft_mean_ms=_ms(statistics.fmean(ttfts)) if ttfts else None,
        tpot_mean_ms=_ms(statistics.fmean(tpots)) if tpots else None,
        tpot_p50_ms=_ms(percentile(tpots, 50)) if tpots else None,
        tpot_p90_ms=_ms(percentile(tpots, 90)) if tpots else None,
        errors=errors[:5],
    )
    if before is not None and after is not None:
        m = after.since(before)
        lv.drafts = m.num_drafts
        lv.acceptance_length = None if m.mean_acceptance_length is None else round(m.mean_acceptance_length, 4)
        lv.acceptance_rate = None if m.acceptance_rate is None else round(m.acceptance_rate, 4)
        lv.per_position_acceptance = None if m.per_position is None else [round(a, 4) for a in m.per_position]
    return lv


def sweep(
    base_url: str,
    model: str,
    prompts: list[str],
    levels: list[int],
    *,
    max_tokens: int,
    num_requests: int | None = None,
    label: str = "",
    mtp_k: int | None = None,
    log=sys.stderr,
) -> BenchRun:
    """All levels against one server, after one warm-up request (the first request of a server is slow)."""
    from .client import complete

    complete(base_url, model, prompts[0], max_tokens=max_tokens, ignore_eos=True)
    out = []
    offset = 0
    for c in levels:
        n = num_requests or max(8, 2 * c)
        lv = run_level(base_url, model, prompts, c, n, max_tokens=max_tokens, offset=offset)
        offset += n
        al = "" if lv.acceptance_length is None else f", acceptance length {lv.acceptance_length:.3f}"
        print(
            f"# {label or base_url}: concurrency {c:>3}: {n} requests in {lv.duration_s:.1f} s, "
            f"e2e {lv.e2e_mean_ms:.0f} ms, TPOT {lv.tpot_mean_ms or float('nan'):.1f} ms, "
            f"{lv.output_tok_s:.1f} tok/s{al}" + (f", {lv.failed} FAILED" if lv.failed else ""),
            file=log,
            flush=True,
        )
        out.append(lv)
    return BenchRun(label=label, base_url=base_url, mtp_k=mtp_k, levels=out)


# ------------------------------------------------------------------------------------------------ report


def speedups(off: BenchRun, on: BenchRun) -> list[dict]:
    """Per concurrency: MTP over off in mean end-to-end latency, mean TPOT and output throughput."""
    rows = []
    for lv in on.levels:
        base = off.level(lv.concurrency)
        if base is None:
            continue
        rows.append(
            {
                "concurrency": lv.concurrency,
                "e2e": round(base.e2e_mean_ms / lv.e2e_mean_ms, 3),
                "tpot": round(base.tpot_mean_ms / lv.tpot_mean_ms, 3)
                if base.tpot_mean_ms and lv.tpot_mean_ms
                else None,
                "throughput": round(lv.output_tok_s / base.output_tok_s, 3),
            }
        )
    return rows


def step_costs(off: BenchRun, on: BenchRun) -> dict | None:
    """At concurrency 1, from the measured TPOTs and acceptance length: the time of one engine step without MTP
    (one target forward, one token) and with MTP (one verify forward of K+1 tokens + K draft forwards,
    ``acceptance length`` tokens on average) and what that predicts for the speedup."""
    a, b = off.level(1), on.level(1)
    if a is None or b is None or not a.tpot_mean_ms or not b.tpot_mean_ms or not b.acceptance_length:
        return None
    step_off = a.tpot_mean_ms
    step_on = b.tpot_mean_ms * b.acceptance_length
    return {
        "target_step_ms": round(step_off, 3),
        "mtp_step_ms": round(step_on, 3),
        "mtp_step_over_target_step": round(step_on / step_off, 3),
        "acceptance_length": b.acceptance_length,
        "predicted_tpot_speedup": round(b.acceptance_length * step_off / step_on, 3),
    }


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    runs = {r["label"]: r for r in report["runs"]}
    off = next((r for r in report["runs"] if r["mtp_k"] is None), None)
    on = next((r for r in report["runs"] if r["mtp_k"] is not None), None)
    lines = []
    if off and on:
        sp = {s["concurrency"]: s for s in report["speedup"]}
        k = on["mtp_k"]
        lines += [
            f"| Max conc | requests | no MTP e2e (ms) | MTP K={k} e2e (ms) | Speedup | no MTP TPOT (ms) | "
            f"MTP TPOT (ms) | no MTP tok/s | MTP tok/s | acceptance length | per-position acceptance |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        offl = {lv["concurrency"]: lv for lv in off["levels"]}
        for lv in on["levels"]:
            b = offl.get(lv["concurrency"])
            if b is None:
                continue
            s = sp.get(lv["concurrency"], {})
            pos = " / ".join(f"{p:.2f}" for p in lv["per_position_acceptance"] or [])
            lines.append(
                f"| {lv['concurrency']} | {lv['requests']} | {b['e2e_mean_ms']:.1f} | {lv['e2e_mean_ms']:.1f} | "
                f"{_f(s.get('e2e'), '{:.2f}')} | {_f(b['tpot_mean_ms'])} | {_f(lv['tpot_mean_ms'])} | "
                f"{b['output_tok_s']:.1f} | {lv['output_tok_s']:.1f} | {_f(lv['acceptance_length'], '{:.3f}')} "
                f"| {pos or '–'} |"
            )
        lines.append("")
    for label, r in runs.items():
        lines += [
            f"**{label}** ({r['base_url']})",
            "",
            "| conc | requests | failed | e2e mean / p50 / p90 (ms) | TTFT (ms) | TPOT mean / p50 / p90 (ms) | "
            "output tok/s | req/s | acceptance length |",
            "|---:|---:|---:|---|---:|---|---:|---:|---:|",
        ]
        for lv in r["levels"]:
            lines.append(
                f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | {lv['e2e_mean_ms']:.1f} / "
                f"{lv['e2e_p50_ms']:.1f} / {lv['e2e_p90_ms']:.1f} | {_f(lv['ttft_mean_ms'])} | "
                f"{_f(lv['tpot_mean_ms'])} / {_f(lv['tpot_p50_ms'])} / {_f(lv['tpot_p90_ms'])} | "
                f"{lv['output_tok_s']:.1f} | {lv['requests_per_s']:.2f} | "
                f"{_f(lv['acceptance_length'], '{:.3f}')} |"
            )
        lines.append("")
    bd = report.get("step_breakdown")
    if bd:
        from .stepcost import step_breakdown_markdown

        lines += step_breakdown_markdown(bd), ""
    sc = report.get("step_costs")
    if sc:
        lines.append(
            f"From the server's TPOT at concurrency 1: one engine step without MTP {sc['target_step_ms']:.1f} ms "
            "(1 token); with "
            f"MTP {sc['mtp_step_ms']:.1f} ms ({sc['mtp_step_over_target_step']:.2f}x) for "
            f"{sc['acceptance_length']:.2f} tokens on average -> TPOT speedup "
            f"{sc['predicted_tpot_speedup']:.2f}x."
        )
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> Path:
    """Mean end-to-end latency, output throughput and speedup against concurrency (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in report["runs"]:
        xs = [lv["concurrency"] for lv in r["levels"]]
        axes[0].plot(xs, [lv["e2e_mean_ms"] for lv in r["levels"]], marker="o", label=r["label"])
        axes[1].plot(xs, [lv["output_tok_s"] for lv in r["levels"]], marker="o", label=r["label"])
    if report.get("speedup"):
        xs = [s["concurrency"] for s in report["speedup"]]
        axes[2].plot(xs, [s["e2e"] for s in report["speedup"]], marker="o", label="e2e latency")
        axes[2].plot(xs, [s["throughput"] for s in report["speedup"]], marker="s", label="throughput")
        axes[2].axhline(1.0, color="grey", lw=0.8, ls="--")
    else:
        axes[2].text(0.5, 0.5, "needs an MTP-off and an MTP run", ha="center", va="center", transform=axes[2].transAxes)
    titles = ("mean end-to-end latency (ms)", "output tokens/s", "MTP speedup over off (x)")
    levels = sorted({lv["concurrency"] for r in report["runs"] for lv in r["levels"]})
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(report.get("title", "dsv4-mtp bench"))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(runs: list[BenchRun], *, argv: list[str], model: str, max_tokens: int, num_fewshot: int) -> dict:
    from .common import machine

    off = next((r for r in runs if r.mtp_k is None), None)
    on = next((r for r in runs if r.mtp_k is not None), None)
    rep = {
        "title": f"dsv4-mtp bench: {Path(model).name}, {max_tokens} output tokens, {num_fewshot}-shot prompts",
        "command": "dsv4-mtp bench " + shlex.join(argv),
        "machine": machine(),
        "model": model,
        "max_tokens": max_tokens,
        "num_fewshot": num_fewshot,
        "temperature": 0.0,
        "runs": [dict(asdict(r), levels=[asdict(lv) for lv in r.levels]) for r in runs],
        "speedup": speedups(off, on) if off and on else [],
        "step_costs": step_costs(off, on) if off and on else None,
    }
    return rep


def write_outputs(report: dict, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["md"].write_text(markdown(report))
    plot(report, paths["png"])
    return paths


# --------------------------------------------------------------------------------------------------- CLI


def server_spec_tokens(base_url: str) -> int | None:
    """K of a running server, read from ``/metrics`` (vLLM labels one per-position counter per draft token
    from start-up on); None when it exports no spec-decode counters (speculation off)."""
    from vllm_dsv4_mtp.serve.metrics import scrape

    from .server import server_root

    m = scrape(server_root(base_url))
    return None if m is None else len(m.accepted_per_position)


def _levels(s: str) -> list[int]:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency needs comma-separated integers, got {s!r}") from None
    if not xs or any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"--concurrency needs positive integers, got {s!r}")
    return xs


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="concurrency sweep: latency, TPOT, tokens/s, acceptance, MTP speedup",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    src = p.add_argument_group("servers (one of)")
    src.add_argument("--base-url", help="running server to measure (MTP on, or whatever it serves)")
    src.add_argument("--baseline-url", help="running MTP-off server to compare against (speedup column)")
    src.add_argument(
        "--serve",
        action="store_true",
        help="start the servers here, one at a time: MTP off, then MTP K (dsv4-mtp serve profile)",
    )
    p.add_argument(
        "--model",
        help="with --serve: checkpoint directory (default: the embedded MXFP4 model); "
        "else the served model name (default: the first of /v1/models)",
    )
    p.add_argument("--mtp-k", type=int, default=2, help="with --serve: draft tokens K for the MTP run (default 2)")
    p.add_argument("--profile", default="cpu-tiny", help="with --serve: dsv4-mtp serve profile (default cpu-tiny)")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=list(DEFAULT_LEVELS),
        help="comma-separated levels (default 1,2,4,8,16,32,64)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default max(8, 2 x C))")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (fixed; default 64)")
    p.add_argument("--num-fewshot", type=int, default=2, help="solved examples before each question (default 2)")
    p.add_argument("--prompts", type=Path, default=None, help="GSM8K-style JSONL (default: the shipped held-out set)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="directory for bench.json/.md/.png")
    p.add_argument(
        "--step-costs",
        action="store_true",
        help="with --serve: afterwards, time one engine step's parts at concurrency 1, MTP off vs K\n"
        "(python -m vllm_dsv4_mtp.evaluate.stepcost; an in-process LLM with forward hooks)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    from .client import NotLoopbackError, require_loopback
    from .common import MissingCheckpointError, fewshot_examples, load_problems, prompt_for, require_checkpoint
    from .server import ManagedServer, ServerSpec, served_model_name, spec_label

    argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "bench" else []
    if args.serve == bool(args.base_url):
        print(
            "dsv4-mtp bench: error: give --base-url URL (a running server) or --serve (start them here)",
            file=sys.stderr,
        )
        return 2
    fewshot = fewshot_examples(args.num_fewshot)
    prompts = [prompt_for(p, fewshot) for p in load_problems(args.prompts)]
    levels = args.concurrency
    runs: list[BenchRun] = []
    try:
        if args.serve:
            model = args.model or str(require_checkpoint(MXFP4_CHECKPOINT_DIR, "--model DIR"))
            ks = [None, args.mtp_k]
            for k in ks:
                spec = ServerSpec(
                    model=model, mtp_k=k, profile=args.profile, extra_args=["--max-num-seqs", str(max(levels))]
                )
                with ManagedServer(spec, log_path=args.out / f"server-{'off' if k is None else f'k{k}'}.log") as srv:
                    r = sweep(
                        srv.base_url,
                        served_model_name(srv.base_url),
                        prompts,
                        levels,
                        max_tokens=args.max_tokens,
                        num_requests=args.num_requests,
                        label=spec_label(k),
                        mtp_k=k,
                    )
                    r.startup_s = round(srv.startup_s, 1)
                    runs.append(r)
        else:
            for url in (args.baseline_url, args.base_url):
                if url:
                    require_loopback(url)
            model = args.model or served_model_name(args.base_url)
            for url in filter(None, (args.baseline_url, args.base_url)):
                k = server_spec_tokens(url)
                runs.append(
                    sweep(
                        url,
                        model,
                        prompts,
                        levels,
                        max_tokens=args.max_tokens,
                        num_requests=args.num_requests,
                        label=spec_label(k),
                        mtp_k=k,
                    )
                )
    except (NotLoopbackError, MissingCheckpointError) as e:
        print(f"dsv4-mtp bench: error: {e}", file=sys.stderr)
        return 2
    report = build_report(runs, argv=argv, model=model, max_tokens=args.max_tokens, num_fewshot=args.num_fewshot)
    if args.step_costs and args.serve and any(r.mtp_k for r in runs):
        from .stepcost import run_stepcost

        report["step_breakdown"] = run_stepcost(model, args.mtp_k, args.max_tokens, args.num_fewshot, args.out)
    paths = write_outputs(report, args.out)
    print(markdown(report))
    print("# wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(lv.failed == 0 for r in runs for lv in r.levels) else 1
