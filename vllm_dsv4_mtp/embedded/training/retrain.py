"""Retrain the embedded model from scratch, one command (what made the shipped assets):

    python -m vllm_dsv4_mtp.embedded.training.retrain --seed 0 --work /tmp/dsv4-train

1. the held-out set, few-shot examples and tokenizer (``embedded.data``, byte for byte from the seed);
2. training (``training.train``, 1 thread: deterministic for a seed and a thread count; ``--resume`` continues
   from ``WORK/state.pt`` with the same data order);
3. the native BF16 checkpoint (``training.export``) and its MXFP4 twin (``dsv4-mtp quantize``, MTP kept BF16).

Measuring it is the next command (``dsv4-mtp eval --ab --task local --mtp off,2``, then ``training.record``):
it serves both checkpoints through vLLM.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .. import ASSETS_DIR, BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR


def steps(seed: int, work: Path, train_steps: int, threads: int, resume: bool, assets: Path) -> list[list[str]]:
    """The commands, in order; ``assets`` is the shipped assets folder unless a test writes elsewhere."""
    py = sys.executable
    bf16, mxfp4 = assets / BF16_CHECKPOINT_DIR.name, assets / MXFP4_CHECKPOINT_DIR.name
    train = [py, "-m", "vllm_dsv4_mtp.embedded.training.train", "--seed", str(seed), "--steps", str(train_steps)]
    train += ["--threads", str(threads), "--out", str(work), "--no-export", "--assets", str(assets)]
    export = [py, "-m", "vllm_dsv4_mtp.embedded.training.export", "--state", str(work / "state.pt")]
    export += ["--assets", str(assets), "--out", str(bf16)]
    return [
        [py, "-m", "vllm_dsv4_mtp.embedded.data", "--seed", str(seed), "--out", str(assets)],
        train + (["--resume"] if resume else []),
        export,
        [py, "-m", "vllm_dsv4_mtp.cli", "quantize", str(bf16), str(mxfp4), "--force"],
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, required=True, help="training state and log (WORK/state.pt, WORK/train.log)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--assets", type=Path, default=ASSETS_DIR, help="output folder (default: the shipped assets)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    for cmd in steps(args.seed, args.work, args.steps, args.threads, args.resume, args.assets):
        print("# " + " ".join(cmd), flush=True)
        if "vllm_dsv4_mtp.embedded.training.train" in cmd:  # its loss log goes where the README reads it
            with open(args.work / "train.log", "a") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        else:
            rc = subprocess.run(cmd).returncode
        if rc:
            print(f"retrain: step failed with status {rc}: {' '.join(cmd)}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
