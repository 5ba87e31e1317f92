"""``dsv4-mtp inspect DIR [--json] [--mtp] [--scan-values]``: precision per module kind, MTP presence/precision,
and every problem.

Exit status 0 when the checkpoint has no error (warnings allowed), 1 otherwise. Reads headers only, unless
``--scan-values``. ``--mtp`` is the pre-flight check before serving with an MTP speculative config.
"""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="check a DeepSeek-V4 checkpoint against its config.json (precisions, MTP, problems)",
        description="Report, per module kind, the storage precision found (bf16 / fp8-block / mxfp4 / "
        "fp4-official), MTP presence and precision, parameter counts, and every problem (missing or "
        "mis-shaped tensors and scales, absent or quantized MTP layer, a quantization_config that "
        "does not cover what is stored, unexpected tensors). Exit status 1 on any error.",
    )
    p.add_argument("dir", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--json", action="store_true", help="print the machine-readable report")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument(
        "--allow-quantized-mtp",
        dest="allow_quantized_mtp",
        action="store_const",
        const=True,
        help="a quantized MTP layer is a warning (the default, unless VLLM_DSV4_MTP_QUANTIZED_MTP="
        "refuse): the plugin's BF16 draft decodes it at load",
    )
    mtp.add_argument(
        "--refuse-quantized-mtp",
        dest="allow_quantized_mtp",
        action="store_const",
        const=False,
        help="a quantized MTP tensor is an error, as the draft under VLLM_DSV4_MTP_QUANTIZED_MTP=refuse",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="check for serving with an MTP speculative config (speculative_config method 'mtp'): a "
        "checkpoint without an MTP layer is then an error, not a warning",
    )
    p.add_argument(
        "--scan-values",
        action="store_true",
        help="also read every tensor and report NaN / Inf values (reads the whole checkpoint once: "
        "about as long as copying it; the default reads headers only)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint

    report = inspect_checkpoint(
        args.dir, allow_quantized_mtp=args.allow_quantized_mtp, mtp=args.mtp, scan_values=args.scan_values
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format_table())
    return 0 if report.ok else 1
