"""``dsv4-mtp eval --ab``: the same lm-eval run against several servers, compared run by run and answer by answer.

Runs are either servers already running (``--server [LABEL=]URL``, e.g. a Pro MTP-off and MTP-on pair, or a
BF16 and an MXFP4 one, that the user started and may still be loading: ``--wait``), or servers started here
one at a time through ``dsv4-mtp serve`` for each ``--checkpoint`` x ``--mtp`` setting (``--start-timeout``).
Each run is one :class:`~.lmeval.LmEvalRun` (the recipe's settings unless overridden) with the server's
spec-decode counters scraped around it; its answers are read back from lm-eval's samples file and compared,
problem by problem, with its baseline run's (greedy speculative decoding should change none).

Each server's draft precision (``bf16`` / ``stored``) is read from its ``/metrics``, where the plugin exports the
``VLLM_DSV4_MTP_DRAFT_PRECISION`` it runs with; a ``--server URL`` given without a LABEL is named by it, so two
servers started with the two values compare with one command. ``--profile`` (a GPU profile) adds each draft's
weights per GPU from the capacity arithmetic, and ``--concurrency`` a decode-speed sweep per server (bench's
requests: held-out prompts, greedy, a fixed number of output tokens, acceptance from ``/metrics`` per level).

Written to ``--out``: ``eval_ab.md`` (what is printed), ``eval_ab.json`` (everything, with the machine) and
``eval_ab_answers.jsonl`` (one line per problem: each run's answer, what strict / flexible extracted, right or
wrong).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_LISTED_DIFFERENCES = 20


@dataclass
class AbRun:
    """One server to evaluate: ``base_url`` (running) or ``spec`` (started here), and its comparison baseline."""

    label: str
    label_given: bool = True
    base_url: str | None = None
    spec: object | None = None  # ServerSpec
    baseline: str | None = None
    model: str | None = None
    mtp: str = "?"
    precision: str | None = None  # the draft precision the server's /metrics reports (None: no draft / not said)
    result: dict | None = None
    sweep: list[dict] | None = None  # bench levels: concurrency, output tok/s, TPOT, acceptance
    answers: dict = field(default_factory=dict, repr=False)  # doc_id -> SampleAnswer
    identical: tuple[int, int] | None = None  # (same answer as the baseline, compared)
    differing: list[int] = field(default_factory=list)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"


def plan_url_runs(servers: list[str], baseline: str | None) -> list[AbRun]:
    runs = []
    for i, item in enumerate(servers, 1):
        m = re.fullmatch(r"(?:(.+)=)?(https?://\S+)", item)  # the label may itself hold '=' ("MTP K=2")
        if m is None:
            raise ValueError(f"--server takes [LABEL=]http://HOST:PORT, got {item!r}")
        runs.append(AbRun(label=m.group(1) or f"server {i}", label_given=bool(m.group(1)), base_url=m.group(2)))
    if all(r.label_given for r in runs):  # otherwise once the servers have said their precision
        _set_baseline(runs, baseline or runs[0].label)
    return runs


def probe(run: AbRun) -> None:
    """MTP setting and draft precision from one read of the server's ``/metrics``: ``off`` when it exports no
    spec-decode counters, else ``K=k`` from its per-position counters; no draft, no precision."""
    from vllm_dsv4_mtp.serve.metrics import draft_precision_from_metrics, fetch_metrics_text, spec_decode_metrics

    from .server import server_root

    text = fetch_metrics_text(server_root(run.base_url))
    m = spec_decode_metrics(text)
    if m is None:
        run.mtp = "off"
    else:
        run.mtp = f"K={len(m.accepted_per_position)}" if m.accepted_per_position else "on"
    run.precision = None if run.mtp == "off" else draft_precision_from_metrics(text)


def label_by_precision(runs: list[AbRun], baseline: str | None) -> None:
    """Name each unlabelled server by the draft precision it reports, when no other unlabelled one reports the
    same; then fix the baseline."""
    for r in runs:
        if r.base_url is not None:
            probe(r)
    unnamed = [r.precision for r in runs if not r.label_given]
    for r in runs:
        if not r.label_given and r.precision and unnamed.count(r.precision) == 1:
            r.label = r.precision
    _set_baseline(runs, baseline or runs[0].label)


def draft_memory(profile: str | None) -> dict | None:
    """Both drafts' weights per GPU under a GPU profile (its model and split), from the capacity arithmetic."""
    if profile is None:
        return None
    from vllm_dsv4_mtp.serve.cli import capacity_report
    from vllm_dsv4_mtp.serve.command import build_command
    from vllm_dsv4_mtp.serve.profiles import get_profile

    try:
        cmd = build_command(get_profile(profile), None, [])
    except KeyError as e:  # eval's error path reports ValueErrors in one line
        raise ValueError(e.args[0]) from None
    rep = capacity_report(cmd)
    if rep is None or rep.draft_gb is None:
        return None
    tp = cmd.flag("tensor-parallel-size", 1)
    return {"profile": profile, "model": cmd.model, "tp": tp, "gb": rep.draft_gb, "bf16_kv_tokens": rep.bf16_kv_tokens}


def plan_managed_runs(
    models: dict[str, Path], settings: list[int | None], profile: str, serve_args: list[str], baseline: str | None
) -> list[AbRun]:
    from .server import ServerSpec, spec_label

    runs = []
    for name, ckpt in models.items():
        for k in settings:
            base = f"{name} MTP off" if (k is not None and None in settings) else None
            spec = ServerSpec(model=str(ckpt), mtp_k=k, profile=profile, extra_args=list(serve_args))
            runs.append(
                AbRun(label=f"{name} {spec_label(k)}", spec=spec, baseline=base, mtp="off" if k is None else f"K={k}")
            )
    if baseline:
        _set_baseline(runs, baseline)
    return runs


def _set_baseline(runs: list[AbRun], baseline: str) -> None:
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be distinct, got {labels}")
    if baseline not in labels:
        raise ValueError(f"--baseline {baseline!r} is none of the runs {labels}")
    for r in runs:
        r.baseline = None if r.label == baseline else baseline


def evaluate_run(run: AbRun, args, include: Path | None) -> None:
    from .eval_runs import evaluate_server, lmeval_run
    from .lmeval import read_samples
    from .server import ManagedServer, served_model_name, wait_healthy

    out_dir = Path(args.out) / _slug(run.label)
    if run.base_url is not None:
        wait_healthy(run.base_url, args.wait)
        run.model = args.model or served_model_name(run.base_url)  # probed by label_by_precision
        run.result = evaluate_server(lmeval_run(args, run.base_url, run.model, out_dir, include))
        speed_sweep(run, args)
    else:
        with ManagedServer(
            run.spec, log_path=Path(args.out) / f"server-{_slug(run.label)}.log", start_timeout_s=args.start_timeout
        ) as srv:
            run.base_url = srv.base_url
            run.model = served_model_name(srv.base_url)
            probe(run)
            run.result = evaluate_server(lmeval_run(args, srv.base_url, run.model, out_dir, include))
            speed_sweep(run, args)
    run.answers = read_samples(run.result["score"]["results_file"])


def speed_sweep(run: AbRun, args) -> None:
    """bench's concurrency sweep against the run's server, after its lm-eval run (``--concurrency``)."""
    if not args.concurrency:
        return
    from dataclasses import asdict

    from .bench import sweep
    from .common import fewshot_examples, load_problems, prompt_for

    fewshot = fewshot_examples(2)
    prompts = [prompt_for(p, fewshot) for p in load_problems(None)]
    res = sweep(
        run.base_url,
        run.model,
        prompts,
        args.concurrency,
        max_tokens=args.bench_max_tokens,
        num_requests=args.bench_requests,
        label=run.label,
    )
    run.sweep = [asdict(lv) for lv in res.levels]


def compare(runs: list[AbRun]) -> None:
    """Each run's answers against its baseline's, problem by problem (the raw generated text)."""
    by_label = {r.label: r for r in runs}
    for r in runs:
        if r.baseline is None or r.baseline not in by_label:
            continue
        base = by_label[r.baseline].answers
        common = sorted(set(base) & set(r.answers))
        r.differing = [i for i in common if base[i].response != r.answers[i].response]
        r.identical = (len(common) - len(r.differing), len(common))


def _pm(v: float, se: float | None) -> str:
    return f"{v:.4f}" + (f" ± {se:.4f}" if se is not None else "")


def strict_interval(score: dict) -> tuple[int, tuple[float, float]]:
    """(problems right under strict-match, its 95 % Wilson interval)."""
    from .common import wilson_interval

    correct = round(score["strict"] * score["n"])
    return correct, wilson_interval(correct, score["n"])


def report(runs: list[AbRun], memory: dict | None = None) -> str:
    """The table, the lm-eval command of each run, the answers that differ from the baseline, and with them each
    draft's weights per GPU (``memory``: :func:`draft_memory`) and the decode-speed sweep."""
    gb = (memory or {}).get("gb") or {}
    lines = [
        "| run | served model | MTP | draft | draft weights per GPU | strict-match | strict 95 % interval "
        "| flexible-extract | problems | mean acceptance length | per-position acceptance "
        "| answers identical to baseline | lm-eval wall (s) | lm-eval command |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for i, r in enumerate(runs, 1):
        s, sd = r.result["score"], r.result["spec_decode"]
        al = sd.get("mean_acceptance_length") if sd else None
        pos = " / ".join(f"{p:.2f}" for p in (sd.get("per_position_acceptance") or [])) if sd else ""
        ident = "(baseline)" if r.identical is None else f"{r.identical[0]}/{r.identical[1]} ({r.baseline})"
        mem = f"{gb[r.precision]:.2f} GB" if r.precision in gb else "–"
        _, (lo, hi) = strict_interval(s)
        lines.append(
            f"| {r.label} | {r.model} | {r.mtp} | {r.precision or '–'} | {mem} "
            f"| {_pm(s['strict'], s['strict_stderr'])} | {lo:.4f}-{hi:.4f} "
            f"| {_pm(s['flexible'], s['flexible_stderr'])} | {s['n']} | {'–' if al is None else f'{al:.3f}'} "
            f"| {pos or '–'} | {ident} | {r.result['wall_s']:.0f} | [{i}] |"
        )
    lines += _memory_lines(memory) + _speed_lines(runs)
    lines += ["", "lm-eval commands:"]
    lines += [f"[{i}] `{r.result['lm_eval_command']}`" for i, r in enumerate(runs, 1)]
    lines += ["", "Answers that differ from the baseline (strict-match extraction, right/wrong):"]
    by_label = {r.label: r for r in runs}
    for r in runs:
        if r.identical is None:
            continue
        if not r.differing:
            lines.append(f"- {r.label} vs {r.baseline}: none, all {r.identical[1]} identical")
            continue
        base = by_label[r.baseline].answers
        shown = [
            f"doc {i}: {_verdict(base[i])} vs {_verdict(r.answers[i])}" for i in r.differing[:MAX_LISTED_DIFFERENCES]
        ]
        more = len(r.differing) - len(shown)
        lines.append(
            f"- {r.label} vs {r.baseline}: {len(r.differing)} differ: "
            + "; ".join(shown)
            + (f"; and {more} more (eval_ab_answers.jsonl)" if more > 0 else "")
        )
    return "\n".join(lines) + "\n"


def _memory_lines(memory: dict | None) -> list[str]:
    if not memory:
        return []
    gb = memory["gb"]
    return [
        "",
        f"Draft weights per GPU under {memory['profile']} ({memory['model']}, TP={memory['tp']}; the capacity "
        f"arithmetic of `dsv4-mtp serve --dry-run`): bf16 {gb['bf16']:.2f} GB, stored {gb['stored']:.2f} GB; bf16 "
        f"costs {gb['bf16'] - gb['stored']:.2f} GB = {memory['bf16_kv_tokens']:,.0f} KV-cache tokens per GPU.",
    ]


def _speed_lines(runs: list[AbRun]) -> list[str]:
    swept = [r for r in runs if r.sweep]
    if not swept:
        return []
    lines = [
        "",
        "Decode speed per concurrency (held-out prompts, greedy, fixed output length; acceptance from /metrics):",
        "",
        "| run | draft | concurrency | output tok/s | TPOT mean (ms) | mean acceptance length "
        "| per-position acceptance |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in swept:
        for lv in r.sweep:
            al, pos, tpot = lv["acceptance_length"], lv["per_position_acceptance"], lv["tpot_mean_ms"]
            lines.append(
                f"| {r.label} | {r.precision or '–'} | {lv['concurrency']} | {lv['output_tok_s']:.1f} "
                f"| {'–' if tpot is None else f'{tpot:.1f}'} | {'–' if al is None else f'{al:.3f}'} "
                f"| {' / '.join(f'{p:.2f}' for p in pos) if pos else '–'} |"
            )
    return lines


def _verdict(a) -> str:
    return f"`{a.strict}` ({'right' if a.strict_correct else 'wrong'})"


def write_outputs(out: Path, runs: list[AbRun], args, text: str, memory: dict | None = None) -> None:
    from .common import machine

    out.mkdir(parents=True, exist_ok=True)
    strict = {r.label: strict_interval(r.result["score"]) for r in runs}
    rows = [
        {
            "label": r.label,
            "base_url": r.base_url,
            "served_model": r.model,
            "mtp": r.mtp,
            "draft_precision": r.precision,
            "draft_weights_gb_per_gpu": ((memory or {}).get("gb") or {}).get(r.precision),
            "speed": r.sweep,
            "checkpoint_dir": getattr(r.spec, "model", None),
            "baseline": r.baseline,
            **r.result,
            "strict_correct": strict[r.label][0],
            "strict_ci95": strict[r.label][1],
            "identical_to_baseline": r.identical,
            "differing_doc_ids": r.differing,
        }
        for r in runs
    ]
    report_json = {
        "task": args.task,
        "num_fewshot": args.num_fewshot,
        "limit": args.limit,
        "machine": machine(),
        "draft_memory": memory,
        "rows": rows,
    }
    (out / "eval_ab.json").write_text(json.dumps(report_json, indent=1) + "\n")
    (out / "eval_ab.md").write_text(text)
    docs = sorted(set().union(*(r.answers for r in runs)))
    with open(out / "eval_ab_answers.jsonl", "w") as f:
        for d in docs:
            per_run = {r.label: vars(r.answers[d]) for r in runs if d in r.answers}
            f.write(json.dumps({"doc_id": d, "runs": per_run}) + "\n")


def run_ab(args) -> int:
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR

    from .client import require_loopback
    from .common import MissingCheckpointError, require_checkpoint
    from .eval_runs import prepare_task, score_line
    from .server import wait_healthy

    if args.server:
        runs = plan_url_runs(args.server, args.baseline)
        if args.concurrency:  # bench's rule: request loops go to this machine only
            for r in runs:
                require_loopback(r.base_url)
    else:
        try:
            models = (
                _model_dirs(args.checkpoint)
                if args.checkpoint
                else {
                    name: require_checkpoint(path, "--server URL or --checkpoint NAME=DIR")
                    for name, path in (("BF16", BF16_CHECKPOINT_DIR), ("MXFP4", MXFP4_CHECKPOINT_DIR))
                }
            )
        except MissingCheckpointError as e:
            print(f"dsv4-mtp eval --ab: error: {e}", file=sys.stderr)
            return 2
        settings = list(args.mtp)
        runs = plan_managed_runs(models, settings, args.profile or "cpu-tiny", args.serve_arg, args.baseline)
    memory = draft_memory(args.profile) if args.server else None
    include = prepare_task(args)
    for r in runs:  # every given server up before the first (long) lm-eval run
        if r.base_url is not None:
            wait_healthy(r.base_url, args.wait)
    if args.server:
        label_by_precision(runs, args.baseline)
    for r in runs:
        evaluate_run(r, args, include)
        print(f"# {r.label}: " + score_line(r.result), file=sys.stderr, flush=True)
    compare(runs)
    text = report(runs, memory)
    write_outputs(Path(args.out), runs, args, text, memory)
    print(Path(args.out, "eval_ab.json").read_text() if args.json else text, end="")
    return 0


def _model_dirs(items: list[str]) -> dict[str, Path]:
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--checkpoint needs NAME=DIR, got {it!r}")
        out[name] = Path(path)
    return out
