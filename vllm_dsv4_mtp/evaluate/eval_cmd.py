"""``dsv4-mtp eval``: GSM8K exact match (strict and flexible) through lm-eval's ``local-completions``.

By default the run is vLLM's DeepSeek-V4 recipe, unchanged:

  lm_eval --model local-completions --model_args model=$MODEL,base_url=http://HOST:PORT/v1/completions,
    num_concurrent=128,max_retries=10,max_gen_toks=2048,timeout=60000 --batch_size auto --tasks gsm8k
    --num_fewshot 8

(plus --output_path/--log_samples, so the answers can be read back). The gsm8k dataset comes from the
Hugging Face Hub, or from its cache when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set or --offline is given;
if it cannot be had, the command says so in one line before asking any server. --task local is the same
lm-eval task over local JSONL (the shipped held-out set unless --data), always offline.

--ab evaluates several servers one after the other and compares them: running ones given with --server
(MTP off / on, BF16 / MXFP4: a Pro-size A/B over servers you started), or ones it starts itself, one at a
time, through `dsv4-mtp serve` for each --checkpoint x --mtp setting. The report gives per run: strict and
flexible accuracy with standard errors, the number of problems, the mean acceptance length from the
server's /metrics counters, how many answers are identical to the baseline run (and which differ), and the
exact lm-eval command line; and the draft precision each server reports, with --profile each draft's weights
per GPU, with --concurrency decode tok/s, TPOT and acceptance per concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def _levels(s: str) -> list[int]:
    from .bench import _levels as bench_levels

    return bench_levels(s)


def _key_value(s: str) -> tuple[str, str]:
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    return key, value


def _add_ab_arguments(p: argparse.ArgumentParser) -> None:
    ab = p.add_argument_group("A/B mode (--ab)")
    ab.add_argument("--ab", action="store_true", help="evaluate several servers and print the comparison table")
    ab.add_argument(
        "--server",
        action="append",
        metavar="[LABEL=]URL",
        help="a running server to compare (repeatable); the first is the baseline unless --baseline; without "
        "LABEL it is named by the draft precision its /metrics reports (bf16 / stored)",
    )
    ab.add_argument("--baseline", metavar="LABEL", help="the run every other run's answers are compared with")
    ab.add_argument(
        "--checkpoint",
        action="append",
        metavar="NAME=DIR",
        help="without --server: checkpoints to serve here one at a time (default: the embedded "
        "BF16 and MXFP4 models); each MTP run is compared with its checkpoint's MTP-off run",
    )
    ab.add_argument(
        "--mtp", type=_mtp_list, default=[None, 1, 3], help="without --server: MTP settings (default off,1,3)"
    )
    ab.add_argument(
        "--profile",
        default=None,
        help="without --server: dsv4-mtp serve profile (default cpu-tiny); with --server: a GPU profile "
        "(mi355x-pro-tp8, ...) whose capacity arithmetic gives each draft's weights per GPU",
    )
    ab.add_argument(
        "--concurrency",
        type=_levels,
        default=None,
        metavar="C1,C2,...",
        help="after each lm-eval run, bench's decode-speed sweep at these concurrencies (servers on this machine)",
    )
    ab.add_argument("--bench-max-tokens", type=int, default=64, help="--concurrency: output tokens per request")
    ab.add_argument(
        "--bench-requests", type=int, default=None, help="--concurrency: requests per level (default max(8, 2 x C))"
    )
    ab.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="without --server: an extra vLLM flag for the servers started here (repeatable; "
        "--serve-arg=--max-num-seqs --serve-arg=64)",
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="GSM8K through lm-eval local-completions (vLLM's recipe) and A/B tables",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--base-url", help="a running OpenAI-compatible server (http://HOST:PORT[/v1[/completions]])")
    p.add_argument("--model", help="served model name (default: the first of the server's /v1/models)")
    p.add_argument(
        "--task",
        choices=("gsm8k", "local"),
        default="gsm8k",
        help="gsm8k: lm-eval's stock task, dataset openai/gsm8k (default); local: the same task on "
        "local JSONL, offline",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="gsm8k from the Hugging Face cache only (sets HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1)",
    )
    p.add_argument("--data", type=Path, default=None, help="local task: test JSONL (default: shipped held-out set)")
    p.add_argument(
        "--fewshot-data",
        type=Path,
        default=None,
        help="local task: JSONL the few-shot examples are drawn from (default: the shipped ones)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N problems only (the recipe: all)")
    p.add_argument("--num-fewshot", type=int, default=8, help="few-shot examples (recipe: 8)")
    p.add_argument("--num-concurrent", type=int, default=128, help="requests in flight (recipe: 128)")
    p.add_argument("--max-gen-toks", type=int, default=2048, help="generation limit per answer (recipe: 2048)")
    p.add_argument("--max-retries", type=int, default=10, help="retries per request (recipe: 10)")
    p.add_argument("--timeout", type=int, default=60000, help="seconds per request (recipe: 60000)")
    p.add_argument("--batch-size", default="auto", help="lm-eval --batch_size (recipe: auto)")
    p.add_argument(
        "--model-arg",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra lm-eval model_args (repeatable), e.g. tokenizer_backend=None",
    )
    p.add_argument("--out", type=Path, default=Path("eval_out"), help="output directory (default eval_out)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_ab_arguments(p)
    p.add_argument(
        "--start-timeout",
        type=float,
        default=3600.0,
        help="seconds a server started here may take to answer /health (default 3600: Pro loads for tens of minutes)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="--base-url / --server: wait up to this long for /health (a server still loading); "
        "default 0: it must answer now",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .engine_clock import EngineClockError
    from .eval_runs import evaluate_server, lmeval_run, prepare_task, score_line
    from .lmeval import LmEvalError
    from .server import ServerStartError, served_model_name, wait_healthy

    try:
        if args.ab:
            from .eval_ab import run_ab

            return run_ab(args)
        if not args.base_url:
            print("dsv4-mtp eval: error: give --base-url URL (a running server) or --ab", file=sys.stderr)
            return 2
        include = prepare_task(args)
        wait_healthy(args.base_url, args.wait)
        model = args.model or served_model_name(args.base_url)
        res = evaluate_server(lmeval_run(args, args.base_url, model, Path(args.out), include))
    except (LmEvalError, ServerStartError, EngineClockError, FileNotFoundError, ValueError) as e:
        print(f"dsv4-mtp eval: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = args.base_url or ", ".join(args.server or []) or "the server"
        print(f"dsv4-mtp eval: error: cannot reach {where}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if args.json else score_line(res) + "\n  " + res["lm_eval_command"])
    return 0
