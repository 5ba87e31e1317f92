"""A served model's output tokens/s per concurrency level, through vLLM's own ``bench serve``: what
``dsv4-mtp tune`` and the concurrency benchmark measure each server with.

::

    warm up (untimed, concurrency 1)
    for C in levels:  n = max(prompts_per_level x C, min_prompts)
        scrape the server's spec-decode counters; vllm.benchmarks.serve(n prompts, at most C at once); scrape again
        row = tok/s, acceptance length = 1 + accepted / drafts over the level (None: no drafts)
"""

from __future__ import annotations


def random_dataset(args) -> list[str]:
    """``bench serve``'s random prompts: ``args.input_len`` tokens in, ``args.output_len`` out."""
    return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len)]  # fmt: skip


def bench_serve(
    base_url: str, model_name: str, tokenizer: str, concurrency: int, n: int, args, dataset: list[str] | None = None
) -> dict:
    """One ``vllm bench serve`` level (vLLM's module, in this process); ``dataset``: its dataset flags (default
    :func:`random_dataset`). Every request makes its full output length (``--ignore-eos``), so configs compare on
    the same work."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_name, "--tokenizer", tokenizer, *(dataset or random_dataset(args)),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--seed", str(args.seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot",
        ]
    )  # fmt: skip
    return main(ns)


def measure_levels(
    base_url: str, config: str, tokenizer: str, levels: list[int], args, dataset: list[str] | None = None
) -> list[dict]:
    """After one untimed warm-up level (``args.warmup_prompts``, default 8, at concurrency 1), one
    :func:`bench_serve` level per concurrency C of ``levels`` with ``max(args.prompts_per_level x C,
    args.min_prompts)`` prompts (default minimum 16); the acceptance length from the server's spec-decode counters
    scraped around each level (None without speculation, or with no draft in the level: K = 0 steps count none)."""
    from vllm_dsv4_mtp.evaluate.server import served_model_name
    from vllm_dsv4_mtp.serve.metrics import scrape

    model_name = served_model_name(base_url)
    bench_serve(base_url, model_name, tokenizer, 1, getattr(args, "warmup_prompts", 8), args, dataset)
    rows = []
    for c in levels:
        n = max(args.prompts_per_level * c, getattr(args, "min_prompts", 16))
        before = scrape(base_url)
        res = bench_serve(base_url, model_name, tokenizer, c, n, args, dataset)
        after = scrape(base_url)
        acc = None
        if before is not None and after is not None and after.num_drafts > before.num_drafts:
            acc = 1 + (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_drafts - before.num_drafts)
        rows.append(
            {
                "config": config,
                "concurrency": c,
                "output_tok_s": round(res["output_throughput"], 1),
                "acceptance_length": None if acc is None else round(acc, 2),
                "completed": res["completed"],
                "prompts": n,
            }
        )
        print(f"# {config} c={c}: {rows[-1]}", flush=True)
    return rows
