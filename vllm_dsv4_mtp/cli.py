"""The ``dsv4-mtp`` console script.

Each sub-command lives in its own module exposing ``add_parser(subparsers)`` (which must not import torch or
vllm, so that ``--help`` is instant) and sets ``func`` on its parser to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module that implements it
COMMANDS: dict[str, str] = {
    "inspect": "vllm_dsv4_mtp.tools.inspect_cmd",
    "quantize": "vllm_dsv4_mtp.quant.cli",
    "build-tiny": "vllm_dsv4_mtp.tools.tiny_cmd",
    "serve": "vllm_dsv4_mtp.serve.cli",
    "metrics": "vllm_dsv4_mtp.serve.metrics",
    "eval": "vllm_dsv4_mtp.evaluate.eval_cmd",
    "bench": "vllm_dsv4_mtp.evaluate.bench",
    "demo": "vllm_dsv4_mtp.evaluate.demo",
    "tune": "vllm_dsv4_mtp.evaluate.tune",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``only``) just one sub-command's, so that running one command never imports
    the others' modules."""
    parser = argparse.ArgumentParser(prog="dsv4-mtp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
