"""Benchmarks of the plugin against vLLM's own floor, run as ``python -m vllm_dsv4_mtp.benchmarks.<name>``."""

from __future__ import annotations

import json
from typing import Any


def report(table: str, result: Any, json_path: str | None) -> int:
    """Print a benchmark's markdown ``table`` and one ``RESULT {json}`` line; also write the JSON to
    ``json_path`` when given. Returns the exit status 0."""
    print(table)
    print("RESULT " + json.dumps(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0
