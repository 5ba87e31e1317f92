"""Benchmarks of the plugin against vLLM's own floor, run as ``python -m vllm_dsv4_mtp.benchmarks.<name>``."""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator
from typing import Any

#: seconds a stopped engine core gets before vLLM kills it and its worker (:func:`running`, the tests' engines).
#: vLLM 0.32's CPU engine core takes ~5.5 s to exit by itself (its worker notices the closed pipe after ~3 s, the
#: core's own teardown as long again), past vLLM's default grace of 5 s, after which it is killed anyway.
STOP_GRACE_S = 1.0


def report(table: str, result: Any, json_path: str | None) -> int:
    """Print a benchmark's markdown ``table`` and one ``RESULT {json}`` line; also write the JSON to
    ``json_path`` when given. Returns the exit status 0."""
    print(table)
    print("RESULT " + json.dumps(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


@contextlib.contextmanager
def running(llm) -> Iterator[Any]:
    """Yield the ``vllm.LLM`` ``llm``, then shut its engine core down however the block ends.

    Why: a benchmark that raises with an engine still running does not exit. Python's multiprocessing atexit
    handler joins the live EngineCore process, which waits for a shutdown that never comes (seen in CI, stop
    20: the traceback printed, then the process sat idle until its test's 900 s timeout). The core gets
    :data:`STOP_GRACE_S` to exit: a benchmark's engine has nothing to flush."""
    try:
        yield llm
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown(timeout=STOP_GRACE_S)
        gc.collect()
