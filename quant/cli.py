"""``dsv4-mtp quantize SRC DST``: routed experts -> Quark OCP MXFP4, MTP kept BF16, the rest copied as stored.

Importing this module is cheap (no torch): ``dsv4-mtp --help`` stays instant.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
    "T": 10**12,
    "TB": 10**12,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536870912, ``"1000"`` -> 1000."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize",
        help="DeepSeek-V4 checkpoint -> Quark OCP MXFP4 routed experts, MTP layer kept BF16",
        description="Convert a DeepSeek-V4 checkpoint (BF16, or the official FP8/FP4 release) shard by shard: "
        "routed experts become OCP MXFP4 exactly as amd-quark 0.13 writes them (weights static, "
        "activations dynamic MXFP4, group 32; official FP4 experts are re-encoded losslessly), the "
        "MTP layer is kept in BF16 and listed in `exclude`, every other tensor is copied byte for "
        "byte. Writes a hidden directory next to DST that replaces DST atomically only once complete; "
        "leftovers of interrupted runs are removed first. NaN/Inf source weights, a destination "
        "without room and I/O errors are refused with a one-line error (exit status 2).",
    )
    p.add_argument("src", help="source checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory (must not exist or be empty, unless --force)")
    p.add_argument(
        "--shared-experts",
        choices=("keep", "mxfp4"),
        default="keep",
        help="keep the shared experts as stored (default; excluded when BF16, FP8 kept as FP8), or "
        "quantize them to MXFP4 like the routed experts (the AMD export's fused-shared layout)",
    )
    p.add_argument(
        "--mtp",
        choices=("bf16", "amd"),
        default="bf16",
        help="the MTP layer: BF16 and excluded (default; quantized MTP tensors decoded exactly), or as "
        "AMD's Quark export stores it: routed experts MXFP4, shared expert FP8 128x128 blocks, the "
        "rest as the source stores it, declared in the Quark config",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="output shard size, e.g. 5GB (default: the largest source shard)",
    )
    p.add_argument(
        "--allow-missing-mtp",
        action="store_true",
        help="convert a checkpoint whose MTP weights were stripped (the output has no draft)",
    )
    p.add_argument(
        "--skip-checks", action="store_true", help="do not run the header checks of `dsv4-mtp inspect` on SRC first"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: torch's choice; use 1 on a shared or busy machine, "
        "where OpenMP threads fighting for cores make the run many times slower)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.quant.quantize import QuantizeError, quantize_checkpoint

    if args.threads is not None:
        if args.threads < 1:
            print("dsv4-mtp quantize: error: --threads must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    try:
        report = quantize_checkpoint(
            args.src,
            args.dst,
            shared_experts=args.shared_experts,
            force=args.force,
            max_shard_bytes=args.max_shard_size,
            progress=not args.no_progress,
            check=not args.skip_checks,
            allow_missing_mtp=args.allow_missing_mtp,
            mtp=args.mtp,
        )
    except (QuantizeError, ValueError) as e:  # ValueError: CheckpointError / ConfigError name the file
        print(f"dsv4-mtp quantize: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM / SIGHUP (vllm_dsv4_mtp.quant.publish.Interrupted)
        signum = getattr(e, "signum", signal.SIGINT)
        if getattr(e, "published", False):
            state = f"the conversion had finished: {args.dst} is the complete new output"
        else:
            state = f"the partial output was removed, {args.dst} is " + (
                "unchanged" if Path(args.dst).exists() else "not created"
            )
        print(f"\ndsv4-mtp quantize: interrupted by {signal.Signals(signum).name}: {state}", file=sys.stderr)
        return 128 + signum
    print(report.summary())
    return 0
