"""``dsv4-mtp build-tiny OUT``: write the tiny random DeepSeek-V4 checkpoint used by tests and the demo."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build-tiny",
        help="write a tiny random DeepSeek-V4 checkpoint (native names, MTP layer, tokenizer)",
        description="Write a tiny DeepSeek-V4 checkpoint with random weights in the native release naming: "
        "SWA, C4 and C128 layers, a hash-routed layer, one MTP layer, and a tokenizer vLLM loads.",
    )
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--experts",
        choices=("bf16", "mxfp4", "fp4-official"),
        default="bf16",
        help="routed-expert storage (mxfp4: Quark OCP MXFP4 with a quantization_config)",
    )
    p.add_argument(
        "--linears",
        choices=("bf16", "fp8"),
        default="bf16",
        help="attention / shared-expert storage (fp8: official 128x128 block FP8)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* tensors")
    p.add_argument("--config", help="JSON object of config.json overrides, e.g. '{\"compress_ratios\": [0,4,8,0]}'")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.config import DeepseekV4Spec, parameter_count, weight_slots
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    try:
        overrides = json.loads(args.config) if args.config else {}
        if not isinstance(overrides, dict):
            raise ValueError(f"--config must be a JSON object of config.json fields, got {args.config!r}")
        cfg = tiny_config(**overrides)
        out = build_tiny_checkpoint(
            args.out, cfg, seed=args.seed, experts=args.experts, linears=args.linears, mtp=not args.no_mtp
        )
    except ValueError as e:  # ConfigError and json.JSONDecodeError are ValueErrors; nothing was written
        print(f"dsv4-mtp build-tiny: error: {e}", file=sys.stderr)
        return 2
    r = CheckpointReader(out)
    spec = DeepseekV4Spec.from_dir(out)
    n = parameter_count(s.shape for s in weight_slots(spec, mtp=not args.no_mtp).values())
    print(
        f"wrote {out}: {len(r)} tensors, {n:,} parameters, {r.total_bytes / 2**20:.1f} MiB "
        f"(experts {args.experts}, linears {args.linears}, MTP {'no' if args.no_mtp else 'yes'})"
    )
    return 0
