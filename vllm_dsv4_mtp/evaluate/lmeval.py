"""GSM8K with lm-eval's ``local-completions`` model against an OpenAI-compatible server.

The command has the shape of vLLM's DeepSeek-V4 recipe (completions endpoint, 8-shot, no chat template)::

    lm_eval --model local-completions \\
        --model_args model=M,base_url=URL/v1/completions,num_concurrent=N,max_retries=...,tokenized_requests=False \\
        --tasks gsm8k --num_fewshot 8

lm-eval runs in a subprocess (its CLI, ``python -m lm_eval``) so its imports and logging stay out of this
process and the printed command can be re-run by hand. Offline, stock ``gsm8k`` cannot load its dataset from
the Hub; :func:`write_local_task` writes the same task (from ``templates/gsm_tiny_task.yaml``) pointing at local
JSONL files, by default the shipped held-out set, and it is passed with ``--include_path``.

:func:`parse_results` reads lm-eval's ``results_*.json`` into strict-match and flexible-extract exact match.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .server import api_root

TEMPLATE = Path(__file__).resolve().parent / "templates" / "gsm_tiny_task.yaml"
LOCAL_TASK = "gsm_tiny"
FILTERS = ("strict-match", "flexible-extract")


class LmEvalError(RuntimeError):
    """lm-eval failed or wrote results this module cannot read; the message says which file / key."""


def write_local_task(out_dir: Path, test_jsonl: Path, fewshot_jsonl: Path, task: str = LOCAL_TASK) -> Path:
    """Write ``<out_dir>/<task>.yaml`` from the template; returns the directory (lm-eval's ``--include_path``).

    ``fewshot_jsonl`` is the task's train split (where lm-eval draws few-shot examples from, as gsm8k does).
    """
    for name, p in (("test", test_jsonl), ("few-shot", fewshot_jsonl)):
        if not Path(p).is_file():
            raise FileNotFoundError(f"{name} JSONL {p} does not exist")
        with open(p) as f:
            first = f.readline()
        try:
            row = json.loads(first)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: line 1 is not JSON ({e})") from None
        missing = [k for k in ("question", "answer") if k not in row]
        if missing:
            raise ValueError(f"{p}: line 1 has no {' / '.join(missing)} field (GSM8K rows are "
                             '{"question": ..., "answer": "...\\n#### N"})')
    text = TEMPLATE.read_text()
    for key, val in (("@TASK@", task), ("@TEST_JSONL@", json.dumps(str(Path(test_jsonl).resolve()))),
                     ("@FEWSHOT_JSONL@", json.dumps(str(Path(fewshot_jsonl).resolve())))):
        text = text.replace(key, val)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{task}.yaml").write_text(text)
    return out_dir


@dataclass
class LmEvalRun:
    """One lm-eval invocation (see :meth:`argv`)."""

    base_url: str
    model: str
    task: str = "gsm8k"
    include_path: Path | None = None
    num_fewshot: int = 8
    limit: int | None = None
    num_concurrent: int = 8
    max_retries: int = 3
    max_gen_toks: int = 256
    timeout_s: int = 600
    output_path: Path = Path("lm_eval_out")
    eos_string: str | None = None
    seed: int = 1234

    def model_args(self) -> str:
        args = {"model": self.model, "base_url": api_root(self.base_url) + "/completions",
                "num_concurrent": self.num_concurrent, "max_retries": self.max_retries,
                "max_gen_toks": self.max_gen_toks, "timeout": self.timeout_s,
                "tokenizer_backend": "None", "tokenized_requests": "False", "seed": self.seed}
        if self.eos_string:
            args["eos_string"] = self.eos_string
        return ",".join(f"{k}={v}" for k, v in args.items())

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
             self.model_args(), "--tasks", self.task, "--num_fewshot", str(self.num_fewshot),
             "--batch_size", "1", "--output_path", str(self.output_path), "--log_samples"]
        if self.include_path is not None:
            a += ["--include_path", str(self.include_path)]
        if self.limit is not None:
            a += ["--limit", str(self.limit)]
        return a

    def run(self, *, quiet: bool = False) -> "GsmScore":
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if not quiet:
            print("# " + shlex.join(self.argv()), file=sys.stderr, flush=True)
        Path(self.output_path).mkdir(parents=True, exist_ok=True)
        log = Path(self.output_path) / "lm_eval.log"
        with open(log, "w") as f:
            rc = subprocess.run(self.argv(), stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        if rc != 0:
            raise LmEvalError(f"lm-eval exited with status {rc}; its output ({log}):\n"
                              f"{log.read_text(errors='replace')[-4000:]}")
        return parse_results(latest_results_file(self.output_path), self.task)


@dataclass
class GsmScore:
    """Exact match under lm-eval's two gsm8k filters, with lm-eval's standard errors."""

    task: str
    n: int
    num_fewshot: int | None
    strict: float
    strict_stderr: float | None
    flexible: float
    flexible_stderr: float | None
    results_file: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        def pm(v, se):
            return f"{v:.4f}" + (f" ± {se:.4f}" if isinstance(se, (int, float)) else "")
        return (f"{self.task} ({self.n} samples, {self.num_fewshot}-shot): exact_match strict-match "
                f"{pm(self.strict, self.strict_stderr)}, flexible-extract {pm(self.flexible, self.flexible_stderr)}")


def latest_results_file(output_path: Path) -> Path:
    """lm-eval writes ``<output_path>/<model name, sanitised>/results_<timestamp>.json``; the newest one."""
    files = sorted(Path(output_path).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise LmEvalError(f"lm-eval wrote no results_*.json under {output_path}")
    return files[-1]


def _stderr(v):
    return v if isinstance(v, (int, float)) else None  # lm-eval writes "N/A" when it cannot compute one


def parse_results(results: Path | dict, task: str) -> GsmScore:
    """Strict and flexible exact match of ``task`` from lm-eval's results JSON (a path or the loaded dict)."""
    source = str(results) if not isinstance(results, dict) else "results"
    data = results if isinstance(results, dict) else json.loads(Path(results).read_text())
    try:
        r = data["results"][task]
    except KeyError:
        raise LmEvalError(f"{source}: no results for task {task!r} "
                          f"(tasks present: {sorted(data.get('results', {}))})") from None
    vals = {}
    for flt in FILTERS:
        key = f"exact_match,{flt}"
        if key not in r:
            raise LmEvalError(f"{source}: task {task!r} has no {key!r} (keys: {sorted(r)})")
        vals[flt] = (float(r[key]), _stderr(r.get(f"exact_match_stderr,{flt}")))
    n_samples = data.get("n-samples", {}).get(task, {})
    n = int(n_samples.get("effective", n_samples.get("original", 0)))
    shots = data.get("n-shot", {}).get(task)
    return GsmScore(task=task, n=n, num_fewshot=shots, strict=vals["strict-match"][0],
                    strict_stderr=vals["strict-match"][1], flexible=vals["flexible-extract"][0],
                    flexible_stderr=vals["flexible-extract"][1],
                    results_file=None if isinstance(results, dict) else str(results))
