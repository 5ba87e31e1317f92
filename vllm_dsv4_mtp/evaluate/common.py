"""What eval, bench, demo and the benchmarks share: the held-out problems and their judge, the shipped checkpoints
as default models, the machine a number was measured on, and an engine's stop however its block ends.

Answers are judged with :func:`vllm_dsv4_mtp.embedded.data.answer_number` (the ``#### N`` value, the same
rule the training engineer's HF-only evaluation uses); lm-eval runs apply lm-eval's own gsm8k filters.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_dsv4_mtp.embedded import FEWSHOT_JSONL, TEST_JSONL
from vllm_dsv4_mtp.embedded import data as gsm


def has_checkpoint(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


class MissingCheckpointError(FileNotFoundError):
    """A default (embedded) checkpoint directory is not there; the message says which flag to pass instead."""


def require_checkpoint(path: Path, flag: str) -> Path:
    """``path`` when it holds a checkpoint, else :class:`MissingCheckpointError`. The embedded checkpoints ship
    in the repository, not in the wheel: an installed wheel without its assets has none."""
    if not has_checkpoint(path):
        raise MissingCheckpointError(
            f"no checkpoint at {path} (the embedded checkpoints ship with the repository, not the wheel): pass {flag}"
        )
    return Path(path)


def load_problems(path: Path | None = None, limit: int | None = None) -> list[dict]:
    rows = gsm.read_jsonl(Path(path) if path else TEST_JSONL)
    return rows[:limit] if limit else rows


def fewshot_examples(k: int, path: Path | None = None) -> list[dict]:
    pool = gsm.read_jsonl(Path(path) if path else FEWSHOT_JSONL)
    if k > len(pool):
        raise ValueError(f"{k}-shot asked but {path or FEWSHOT_JSONL} holds {len(pool)} examples")
    return pool[:k]


def prompt_for(problem: dict, fewshot: list[dict]) -> str:
    """lm-eval's gsm8k layout (``Question: ...\\nAnswer:``), the layout the embedded model was trained on."""
    return gsm.format_prompt(problem["question"], fewshot)


def is_correct(completion: str, problem: dict) -> bool:
    """The completion's ``#### N`` equals the reference's (GSM8K's strict rule)."""
    got = gsm.answer_number(completion)
    return got is not None and got == gsm.answer_number(problem["answer"])


def machine() -> dict:
    """The machine a number was measured on (for benchmark reports)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        import importlib.metadata as md

        from vllm_dsv4_mtp.versions import installed_vllm

        name, version = installed_vllm()
        info["vllm"] = f"{name} {version}"
        info["torch"] = md.version("torch")
    except Exception as e:  # noqa: BLE001 - informational only
        info["vllm"] = f"unknown ({e})"
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion ``correct / n`` (unlike mean ± 1.96 se it stays inside [0, 1]
    and keeps its coverage near 0 % and 100 %, where the embedded model's accuracies sit)."""
    if n <= 0:
        raise ValueError("an interval needs at least one problem")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


#: seconds a stopped engine core gets before vLLM kills it and its worker (:func:`running`, the tests' engines).
#: vLLM 0.32's CPU engine core takes ~5.5 s to exit by itself (its worker notices the closed pipe after ~3 s, the
#: core's own teardown as long again), past vLLM's default grace of 5 s, after which it is killed anyway.
STOP_GRACE_S = 1.0


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
