"""What ``dsv4-mtp eval`` and its ``--ab`` comparison share: one lm-eval run against one server, scored."""

from __future__ import annotations

import time
from pathlib import Path


def lmeval_run(args, base_url: str, model: str, out_dir: Path, include: Path | None):
    """The :class:`~.lmeval.LmEvalRun` the command line asks for (the recipe's, by default)."""
    from .lmeval import LOCAL_MODEL_ARGS, LOCAL_TASK, LmEvalRun

    local = args.task == "local"
    return LmEvalRun(
        base_url=base_url,
        model=model,
        task=LOCAL_TASK if local else "gsm8k",
        include_path=include,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        num_concurrent=args.num_concurrent,
        max_retries=args.max_retries,
        max_gen_toks=args.max_gen_toks,
        timeout_s=args.timeout,
        batch_size=args.batch_size,
        output_path=out_dir,
        extra_model_args={**(LOCAL_MODEL_ARGS if local else {}), **dict(args.model_arg)},
        offline=local or args.offline,
    )


def prepare_task(args) -> Path | None:
    """Write the local task (returns its --include_path), or check that gsm8k's dataset can be loaded."""
    from vllm_dsv4_mtp.embedded import FEWSHOT_JSONL, TEST_JSONL

    from .lmeval import check_dataset, write_local_task

    if args.task == "local":
        return write_local_task(Path(args.out) / "task", args.data or TEST_JSONL, args.fewshot_data or FEWSHOT_JSONL)
    if args.data or args.fewshot_data:
        raise ValueError("--data / --fewshot-data are for --task local (gsm8k reads openai/gsm8k)")
    check_dataset(lmeval_run(args, "http://unused", "unused", Path(args.out), None))
    return None


def evaluate_server(run) -> dict:
    """One lm-eval run against one server, with the spec-decode counters scraped around it."""
    from vllm_dsv4_mtp.serve.metrics import scrape

    from .server import server_root

    before = scrape(server_root(run.base_url))
    t0 = time.perf_counter()
    score = run.run()
    wall = time.perf_counter() - t0
    after = scrape(server_root(run.base_url))
    row = {
        "score": score.to_dict(),
        "wall_s": round(wall, 1),
        "spec_decode": None,
        "lm_eval_command": run.command_line(),
    }
    if before is not None and after is not None:
        row["spec_decode"] = after.since(before).to_dict()
    return row


def score_line(res: dict) -> str:
    s, sd = res["score"], res["spec_decode"]

    def pm(v, se):
        return f"{v:.4f}" + (f" ± {se:.4f}" if se is not None else "")

    line = (
        f"{s['task']} {s['n']} problems {s['num_fewshot']}-shot: strict-match {pm(s['strict'], s['strict_stderr'])}, "
        f"flexible-extract {pm(s['flexible'], s['flexible_stderr'])}"
    )
    if sd and sd.get("mean_acceptance_length") is not None:
        line += f"; mean acceptance length {sd['mean_acceptance_length']:.3f}"
    return line
