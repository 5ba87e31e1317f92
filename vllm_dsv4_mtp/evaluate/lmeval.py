"""GSM8K with lm-eval's ``local-completions`` model against an OpenAI-compatible server.

By default the command is exactly vLLM's DeepSeek-V4 recipe (completions endpoint, 8-shot, no chat template)::

    ARGS=model=$MODEL,base_url=http://HOST:PORT/v1/completions,num_concurrent=128,max_retries=10
    lm_eval --model local-completions \\
        --model_args $ARGS,max_gen_toks=2048,timeout=60000 \\
        --batch_size auto --tasks gsm8k --num_fewshot 8 --output_path OUT --log_samples

(``--log_samples`` only makes lm-eval write each answer, which the A/B compares one by one.) lm-eval runs in a
subprocess, ``python -m lm_eval`` (the same entry point as the ``lm_eval`` script), so its imports and logging
stay out of this process and :meth:`LmEvalRun.command_line` can be re-run by hand.

Stock ``gsm8k`` reads ``openai/gsm8k`` from the Hugging Face Hub (or its cache when ``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE`` is set); :func:`check_dataset` says in one line when that cannot work, before any
server is asked anything. ``--task local`` is the same task over local JSONL files (by default the shipped
held-out set; :func:`write_local_task` from ``templates/gsm_tiny_task.yaml``, passed with ``--include_path``),
always run offline.

:func:`parse_results` reads lm-eval's ``results_*.json`` into strict-match and flexible-extract exact match
with their standard errors; :func:`read_samples` reads the per-answer samples file.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
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
            raise ValueError(
                f"{p}: line 1 has no {' / '.join(missing)} field (GSM8K rows are "
                '{"question": ..., "answer": "...\\n#### N"})'
            )
    text = TEMPLATE.read_text()
    for key, val in (
        ("@TASK@", task),
        ("@TEST_JSONL@", json.dumps(str(Path(test_jsonl).resolve()))),
        ("@FEWSHOT_JSONL@", json.dumps(str(Path(fewshot_jsonl).resolve()))),
    ):
        text = text.replace(key, val)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{task}.yaml").write_text(text)
    return out_dir


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
#: lm-eval model_args the local task adds: the served name need not name a tokenizer lm-eval could load
#: (vLLM's /tokenizer_info is off by default), so prompts go to the server as text and it tokenizes them.
LOCAL_MODEL_ARGS = {"tokenizer_backend": "None", "tokenized_requests": "False"}


def offline_env(env: dict | None = None) -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to a true value."""
    env = os.environ if env is None else env
    return any(env.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in OFFLINE_ENV)


@dataclass
class LmEvalRun:
    """One lm-eval invocation (see :meth:`lm_eval_args`); defaults are vLLM's DeepSeek-V4 recipe."""

    base_url: str
    model: str
    task: str = "gsm8k"
    include_path: Path | None = None
    num_fewshot: int = 8
    limit: int | None = None
    num_concurrent: int = 128
    max_retries: int = 10
    max_gen_toks: int = 2048
    timeout_s: int = 60000
    batch_size: str = "auto"
    output_path: Path = Path("lm_eval_out")
    extra_model_args: dict[str, str] = field(default_factory=dict)  # appended, or replacing a key above
    offline: bool = False  # run lm-eval with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

    def model_args(self) -> str:
        args = {
            "model": self.model,
            "base_url": api_root(self.base_url) + "/completions",
            "num_concurrent": self.num_concurrent,
            "max_retries": self.max_retries,
            "max_gen_toks": self.max_gen_toks,
            "timeout": self.timeout_s,
            **self.extra_model_args,
        }
        return ",".join(f"{k}={v}" for k, v in args.items())

    def lm_eval_args(self) -> list[str]:
        """The arguments after ``lm_eval``."""
        a = [
            "--model",
            "local-completions",
            "--model_args",
            self.model_args(),
            "--batch_size",
            str(self.batch_size),
            "--tasks",
            self.task,
            "--num_fewshot",
            str(self.num_fewshot),
            "--output_path",
            str(self.output_path),
            "--log_samples",
        ]
        if self.include_path is not None:
            a += ["--include_path", str(self.include_path)]
        if self.limit is not None:
            a += ["--limit", str(self.limit)]
        return a

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "lm_eval", *self.lm_eval_args()]

    def env(self) -> dict[str, str]:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        return {**env, **OFFLINE_ENV} if self.offline else env

    def command_line(self) -> str:
        """The command as a user would type it (offline variables first when this run sets them)."""
        prefix = " ".join(f"{k}={v}" for k, v in OFFLINE_ENV.items()) + " " if self.offline else ""
        return prefix + shlex.join(["lm_eval", *self.lm_eval_args()])

    def run(self, *, quiet: bool = False) -> GsmScore:
        if not quiet:
            print("# " + self.command_line(), file=sys.stderr, flush=True)
        Path(self.output_path).mkdir(parents=True, exist_ok=True)
        log = Path(self.output_path) / "lm_eval.log"
        with open(log, "w") as f:
            rc = subprocess.run(self.argv(), stdout=f, stderr=subprocess.STDOUT, env=self.env()).returncode
        if rc != 0:
            raise LmEvalError(
                f"lm-eval exited with status {rc}; its output ({log}):\n{log.read_text(errors='replace')[-4000:]}"
            )
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

        return (
            f"{self.task} ({self.n} samples, {self.num_fewshot}-shot): exact_match strict-match "
            f"{pm(self.strict, self.strict_stderr)}, flexible-extract {pm(self.flexible, self.flexible_stderr)}"
        )


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
        raise LmEvalError(
            f"{source}: no results for task {task!r} (tasks present: {sorted(data.get('results', {}))})"
        ) from None
    vals = {}
    for flt in FILTERS:
        key = f"exact_match,{flt}"
        if key not in r:
            raise LmEvalError(f"{source}: task {task!r} has no {key!r} (keys: {sorted(r)})")
        vals[flt] = (float(r[key]), _stderr(r.get(f"exact_match_stderr,{flt}")))
    n_samples = data.get("n-samples", {}).get(task, {})
    n = int(n_samples.get("effective", n_samples.get("original", 0)))
    shots = data.get("n-shot", {}).get(task)
    return GsmScore(
        task=task,
        n=n,
        num_fewshot=shots,
        strict=vals["strict-match"][0],
        strict_stderr=vals["strict-match"][1],
        flexible=vals["flexible-extract"][0],
        flexible_stderr=vals["flexible-extract"][1],
        results_file=None if isinstance(results, dict) else str(results),
    )


# ------------------------------------------------------------------------------------ the stock dataset


def stock_task_dataset(task: str = "gsm8k") -> tuple[str, str | None]:
    """(dataset_path, dataset_name) of lm-eval's installed stock task, read from its YAML without importing it."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.origin:
        raise LmEvalError(
            "lm-eval is not installed here: pip install 'lm-eval[api]==0.4.13' (the plugin's `eval` extra)"
        )
    path = Path(spec.origin).parent / "tasks" / task / f"{task}.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except OSError as e:
        raise LmEvalError(f"lm-eval has no stock task {task!r} ({path}: {e.strerror})") from None
    return cfg["dataset_path"], cfg.get("dataset_name")


def check_dataset(run: LmEvalRun, timeout_s: float = 1800.0) -> None:
    """Load the stock task's dataset the way lm-eval will (same interpreter, same environment) before any
    server is asked anything; raises :class:`LmEvalError` with a one-line reason and what to do.

    Online this downloads it into the Hugging Face cache (lm-eval then reads it from there); offline it
    must already be cached.
    """
    ds_path, ds_name = stock_task_dataset(run.task)
    code = "import sys, datasets; datasets.load_dataset(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)"
    env = run.env()
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, ds_path, *([ds_name] if ds_name else [])],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise LmEvalError(f"loading {ds_path} did not finish within {timeout_s:.0f} s") from None
    if r.returncode == 0:
        return
    reason = (r.stderr.strip().splitlines() or ["no output"])[-1]
    if "No module named" in reason:
        raise LmEvalError(
            f"{reason}: lm-eval's dependencies are not installed here (pip install "
            "'lm-eval[api]==0.4.13', the plugin's `eval` extra)"
        )
    what = f"lm-eval's {run.task} dataset ({ds_path}{f', config {ds_name}' if ds_name else ''})"
    get = f"datasets.load_dataset('{ds_path}'{f', {ds_name!r}' if ds_name else ''})"
    if offline_env(env):
        cache = env.get("HF_DATASETS_CACHE") or env.get("HF_HOME") or "~/.cache/huggingface"
        raise LmEvalError(
            f"{what} is not cached ({cache}) and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set: get it "
            f'once with the Hub reachable, python -c "import datasets; {get}" (offline variables '
            f"unset, same HF_HOME), then rerun; or evaluate the shipped held-out set with --task local"
        )
    raise LmEvalError(
        f"cannot download {what} from the Hugging Face Hub ({reason}); check the network, "
        "HF_ENDPOINT and HF_TOKEN, or evaluate the shipped held-out set with --task local"
    )


# ------------------------------------------------------------------------------------ one answer at a time


@dataclass(frozen=True)
class SampleAnswer:
    """One problem's answer as lm-eval logged it: the raw text and what each filter extracted and scored."""

    doc_id: int
    response: str
    strict: str
    strict_correct: bool
    flexible: str
    flexible_correct: bool


def read_samples(results_file: str | Path) -> dict[int, SampleAnswer]:
    """doc_id -> answer, from the ``samples_<task>_<stamp>.jsonl`` lm-eval wrote next to ``results_<stamp>.json``."""
    rf = Path(results_file)
    stamp = rf.stem[len("results_") :]
    files = sorted(rf.parent.glob(f"samples_*_{stamp}.jsonl"))
    if not files:
        raise LmEvalError(f"no samples_*_{stamp}.jsonl next to {rf} (lm-eval runs with --log_samples)")
    by_doc: dict[int, dict[str, dict]] = {}
    for sf in files:
        for line in sf.read_text().splitlines():
            if line.strip():
                s = json.loads(line)
                by_doc.setdefault(int(s["doc_id"]), {})[s["filter"]] = s
    out = {}
    for doc_id, per_filter in by_doc.items():
        missing = [f for f in FILTERS if f not in per_filter]
        if missing:
            raise LmEvalError(f"{files[0]}: doc {doc_id} has no {' / '.join(missing)} sample")
        st, fl = per_filter["strict-match"], per_filter["flexible-extract"]
        out[doc_id] = SampleAnswer(
            doc_id,
            st["resps"][0][0],
            str(st["filtered_resps"][0]),
            bool(st["exact_match"]),
            str(fl["filtered_resps"][0]),
            bool(fl["exact_match"]),
        )
    return out
