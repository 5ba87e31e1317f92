"""Record the shipped model's held-out accuracy from a ``dsv4-mtp eval --ab`` run, for ``dsv4-mtp demo`` to print.

    dsv4-mtp eval --ab --task local --mtp off,2 --out /tmp/ab-heldout      # the embedded BF16 and MXFP4 models
    python -m vllm_dsv4_mtp.embedded.training.record /tmp/ab-heldout/eval_ab.json

Writes ``embedded/assets/measured.json``: per run its label, problems, right answers (strict-match), the 95 %
Wilson interval, the mean acceptance length and a digest of the weights it served, with the commit it was
measured at and the command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

from .. import MEASURED_JSON


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"


def weights_digest(ckpt_dir: str | Path) -> str:
    """sha256 over a checkpoint's safetensors shards in name order: ties a record to the weights it measured."""
    h = hashlib.sha256()
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def measured(eval_ab: dict, command: str) -> dict:
    """The record of one eval --ab report: every run over the whole held-out set (a ``--limit`` run is refused:
    the demo would print it as the held-out accuracy)."""
    if eval_ab.get("limit"):
        raise ValueError(f"the eval --ab run stopped at --limit {eval_ab['limit']}: record a run over the whole set")
    runs = []
    for row in eval_ab["rows"]:
        sd = row.get("spec_decode") or {}
        n = row["score"]["n"]
        runs.append(
            {
                "label": row["label"],
                "n": n,
                "correct": row["strict_correct"],
                "accuracy": row["strict_correct"] / n,
                "ci95": row["strict_ci95"],
                "mean_acceptance_length": sd.get("mean_acceptance_length"),
                "weights": weights_digest(row["checkpoint_dir"]) if row.get("checkpoint_dir") else None,
            }
        )
    return {
        "task": eval_ab["task"],
        "num_fewshot": eval_ab["num_fewshot"],
        "commit": commit(),
        "command": command,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_ab_json", type=Path, help="eval_ab.json of a `dsv4-mtp eval --ab` run")
    ap.add_argument("--command", default="dsv4-mtp eval --ab --task local --mtp off,2", help="the command it ran")
    ap.add_argument("--out", type=Path, default=MEASURED_JSON)
    args = ap.parse_args(argv)
    rec = measured(json.loads(args.eval_ab_json.read_text()), args.command)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    for r in rec["runs"]:
        print(f"{r['label']}: {r['correct']}/{r['n']} (95 % interval {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
