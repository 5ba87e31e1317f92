"""``dsv4-mtp eval``: GSM8K exact match (strict and flexible) through lm-eval's ``local-completions``.

Against a running server (``--base-url``), the command vLLM's DeepSeek-V4 recipe uses: completions endpoint,
8-shot, no chat template. ``--task gsm8k`` is lm-eval's stock task (its dataset comes from the Hub);
``--task local`` (the default when ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set, as ``make`` and the
tests set it) is the same task over local JSONL files: the shipped held-out set unless ``--data``.

``--ab`` starts the servers itself, one at a time, through ``dsv4-mtp serve --profile cpu-tiny``, and prints
a table over {BF16, MXFP4} x {MTP off, K=1, K=3}: exact match, the acceptance length from ``/metrics``, and
how many answers are identical to the MTP-off run of the same checkpoint (greedy speculative decoding is
lossless, so all should be).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _mtp_list(s: str) -> list[int | None]:
    out: list[int | None] = []
    for x in s.split(","):
        x = x.strip().lower()
        if x in ("off", "0", "none"):
            out.append(None)
        else:
            try:
                k = int(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--mtp takes off or K values, e.g. off,1,3; got {x!r}") from None
            if k < 1:
                raise argparse.ArgumentTypeError(f"--mtp K must be >= 1, got {k}")
            out.append(k)
    return out


def _model_dirs(items: list[str] | None) -> dict[str, Path]:
    if not items:
        from .common import embedded_models

        return embedded_models()
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--checkpoint needs NAME=DIR, got {it!r}")
        out[name] = Path(path)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="GSM8K exact match through lm-eval local-completions (and an A/B table)",
                              description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", help="running OpenAI-compatible server (http://HOST:PORT[/v1[/completions]])")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--task", choices=("auto", "gsm8k", "local"), default="auto",
                   help="gsm8k: lm-eval's stock task (Hub); local: the same task on local JSONL (default when "
                        "offline)")
    p.add_argument("--data", type=Path, default=None, help="local task: test JSONL (default: shipped held-out set)")
    p.add_argument("--fewshot-data", type=Path, default=None,
                   help="local task: JSONL the few-shot examples are drawn from (default: the shipped ones)")
    p.add_argument("--limit", type=int, default=None, help="first N problems only")
    p.add_argument("--num-fewshot", type=int, default=8, help="few-shot examples (default 8, as the recipe)")
    p.add_argument("--num-concurrent", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="generation limit per answer (default 256)")
    p.add_argument("--out", type=Path, default=Path("eval_out"), help="lm-eval output directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    ab = p.add_argument_group("A/B mode")
    ab.add_argument("--ab", action="store_true", help="start servers here and print the checkpoint x MTP table")
    ab.add_argument("--checkpoint", action="append", metavar="NAME=DIR",
                    help="checkpoints to compare (repeatable; default BF16 and MXFP4 embedded models)")
    ab.add_argument("--mtp", type=_mtp_list, default=[None, 1, 3], help="MTP settings (default off,1,3)")
    ab.add_argument("--profile", default="cpu-tiny", help="dsv4-mtp serve profile (default cpu-tiny)")
    p.set_defaults(func=run)
    return p


def _task(args) -> tuple[str, Path | None]:
    """(lm-eval task name, --include_path) for the chosen task."""
    from vllm_dsv4_mtp.embedded import FEWSHOT_JSONL, TEST_JSONL

    from .lmeval import LOCAL_TASK, write_local_task

    task = args.task
    if task == "auto":
        task = "local" if (_offline() or args.ab or args.data) else "gsm8k"
    if task == "gsm8k":
        return "gsm8k", None
    inc = write_local_task(Path(args.out) / "task", args.data or TEST_JSONL, args.fewshot_data or FEWSHOT_JSONL)
    return LOCAL_TASK, inc


def evaluate_server(base_url: str, model: str, args, out_dir: Path, task: str, include: Path | None) -> dict:
    """One lm-eval run against one server, with the spec-decode counters scraped around it."""
    from vllm_dsv4_mtp.serve.metrics import scrape

    from .lmeval import LmEvalRun
    from .server import server_root

    before = scrape(server_root(base_url))
    t0 = time.perf_counter()
    score = LmEvalRun(base_url=base_url, model=model, task=task, include_path=include,
                      num_fewshot=args.num_fewshot, limit=args.limit, num_concurrent=args.num_concurrent,
                      max_gen_toks=args.max_gen_toks, output_path=out_dir).run()
    wall = time.perf_counter() - t0
    after = scrape(server_root(base_url))
    row = {"score": score.to_dict(), "wall_s": round(wall, 1), "spec_decode": None}
    if before is not None and after is not None:
        row["spec_decode"] = after.since(before).to_dict()
    return row


def _responses(results_file: str | None) -> dict[int, str]:
    """doc_id -> the raw generated text, from lm-eval's samples file next to the results file."""
    if not results_file:
        return {}
    rf = Path(results_file)
    stamp = rf.stem[len("results_"):]
    out = {}
    for sf in rf.parent.glob(f"samples_*_{stamp}.jsonl"):
        for line in sf.read_text().splitlines():
            if line.strip():
                s = json.loads(line)
                out[int(s["doc_id"])] = s["resps"][0][0]
    return out


@dataclass
class AbRow:
    checkpoint: str
    mtp_k: int | None
    result: dict
    identical: tuple[int, int] | None = None  # (same as MTP off, compared)
    responses: dict = field(default_factory=dict, repr=False)


def ab_table(rows: list[AbRow]) -> str:
    from .server import spec_label

    lines = ["| checkpoint | MTP | strict-match | flexible-extract | n | acceptance length | per-position acceptance "
             "| answers identical to MTP off | lm-eval wall (s) |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        s, sd = r.result["score"], r.result["spec_decode"]
        al = sd.get("mean_acceptance_length") if sd else None
        pos = " / ".join(f"{p:.2f}" for p in (sd.get("per_position_acceptance") or [])) if sd else ""
        ident = "–" if r.identical is None else f"{r.identical[0]}/{r.identical[1]}"
        lines.append(f"| {r.checkpoint} | {spec_label(r.mtp_k)} | {s['strict']:.4f} | {s['flexible']:.4f} | {s['n']} "
                     f"| {'–' if al is None else f'{al:.3f}'} | {pos or '–'} | {ident} | {r.result['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def run_ab(args) -> int:
    from .common import machine, mtp_draft_registered
    from .server import ManagedServer, ServerSpec, spec_label

    models = _model_dirs(args.checkpoint)
    if not models:
        print("dsv4-mtp eval --ab: error: no checkpoint to compare (the embedded BF16/MXFP4 models are not built "
              "yet under vllm_dsv4_mtp/embedded/assets; pass --checkpoint NAME=DIR)", file=sys.stderr)
        return 2
    settings = list(args.mtp)
    if any(k is not None for k in settings) and not mtp_draft_registered():
        print("dsv4-mtp eval --ab: note: the plugin registers no MTP draft (DeepSeekV4MTPModel) yet; "
              "running MTP off only", file=sys.stderr)
        settings = [k for k in settings if k is None] or [None]
    task, include = _task(args)
    rows: list[AbRow] = []
    for name, ckpt in models.items():
        baseline: AbRow | None = None
        for k in settings:
            spec = ServerSpec(model=str(ckpt), mtp_k=k, profile=args.profile)
            tag = f"{name}-{'off' if k is None else f'k{k}'}"
            with ManagedServer(spec, log_path=Path(args.out) / f"server-{tag}.log") as srv:
                res = evaluate_server(srv.base_url, spec.served_model_name, args, Path(args.out) / tag, task, include)
            row = AbRow(name, k, res, responses=_responses(res["score"]["results_file"]))
            if k is None:
                baseline = row
            elif baseline is not None:
                common = sorted(set(baseline.responses) & set(row.responses))
                row.identical = (sum(baseline.responses[i] == row.responses[i] for i in common), len(common))
            rows.append(row)
            print(f"# {name} {spec_label(k)}: " + _score_line(res), file=sys.stderr, flush=True)
    table = ab_table(rows)
    report = {"task": task, "num_fewshot": args.num_fewshot, "limit": args.limit, "machine": machine(),
              "rows": [{"checkpoint": r.checkpoint, "checkpoint_dir": str(models[r.checkpoint]), "mtp_k": r.mtp_k,
                        **r.result, "identical_to_mtp_off": r.identical} for r in rows]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "eval_ab.json").write_text(json.dumps(report, indent=1) + "\n")
    (Path(args.out) / "eval_ab.md").write_text(table)
    print(json.dumps(report, indent=1) if args.json else table, end="")
    return 0


def _score_line(res: dict) -> str:
    s, sd = res["score"], res["spec_decode"]
    line = (f"{s['task']} {s['n']} samples {s['num_fewshot']}-shot: strict-match {s['strict']:.4f}, "
            f"flexible-extract {s['flexible']:.4f}")
    if sd and sd.get("mean_acceptance_length") is not None:
        line += f"; mean acceptance length {sd['mean_acceptance_length']:.3f}"
    return line


def run(args: argparse.Namespace) -> int:
    from .lmeval import LmEvalError
    from .server import ServerStartError, served_model_name

    try:
        if args.ab:
            return run_ab(args)
        if not args.base_url:
            print("dsv4-mtp eval: error: give --base-url URL (a running server) or --ab (start servers here)",
                  file=sys.stderr)
            return 2
        model = args.model or served_model_name(args.base_url)
        task, include = _task(args)
        res = evaluate_server(args.base_url, model, args, Path(args.out), task, include)
    except (LmEvalError, ServerStartError, FileNotFoundError, ValueError) as e:
        print(f"dsv4-mtp eval: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"dsv4-mtp eval: error: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if args.json else _score_line(res))
    return 0
