"""`dsv4-mtp eval`: the local GSM8K-style lm-eval task, lm-eval's strict / flexible scoring read back, and a real
lm-eval `local-completions` run against a vLLM server serving the embedded tiny DeepSeek-V4 (MXFP4, MTP K=1, one
server for the module).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import procs
import pytest
import yaml

from vllm_dsv4_mtp.cli import build_parser
from vllm_dsv4_mtp.embedded import FEWSHOT_JSONL, TEST_JSONL
from vllm_dsv4_mtp.evaluate import common
from vllm_dsv4_mtp.evaluate.common import wilson_interval
from vllm_dsv4_mtp.evaluate.eval_ab import AbRun, compare, report
from vllm_dsv4_mtp.evaluate.eval_runs import lmeval_run
from vllm_dsv4_mtp.evaluate.lmeval import LOCAL_TASK, LmEvalError, SampleAnswer, parse_results, write_local_task

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")
LMEVAL_GSM8K = Path(__import__("lm_eval").__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"


# ------------------------------------------------------------------------------------------ the local task


def test_local_task_is_lm_evals_gsm8k_on_local_jsonl(tmp_path):
    inc = write_local_task(tmp_path, TEST_JSONL, FEWSHOT_JSONL)
    ours = yaml.safe_load((inc / f"{LOCAL_TASK}.yaml").read_text())
    stock = yaml.safe_load(LMEVAL_GSM8K.read_text())
    # everything that decides the prompt, the stop strings and the score is gsm8k's own
    for key in (
        "output_type",
        "doc_to_text",
        "doc_to_target",
        "metric_list",
        "filter_list",
        "generation_kwargs",
        "training_split",
        "fewshot_split",
        "test_split",
        "repeats",
    ):
        assert ours[key] == stock[key], key
    assert [f["name"] for f in ours["filter_list"]] == ["strict-match", "flexible-extract"]
    # only the data source differs: the shipped JSONL, absolute paths; 8-shot like vLLM's DeepSeek-V4 recipe
    assert ours["task"] == LOCAL_TASK and ours["dataset_path"] == "json" and "dataset_name" not in ours
    assert ours["dataset_kwargs"]["data_files"] == {"train": str(FEWSHOT_JSONL), "test": str(TEST_JSONL)}
    assert ours["num_fewshot"] == 8


def test_local_task_refuses_missing_or_non_gsm8k_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="test JSONL .*nope.jsonl does not exist"):
        write_local_task(tmp_path, tmp_path / "nope.jsonl", FEWSHOT_JSONL)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "solution": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 1 has no answer field"):
        write_local_task(tmp_path, TEST_JSONL, bad)


class _ScriptedLM:
    """An lm-eval LM whose answer to each held-out question is scripted (built lazily: lm_eval import is slow)."""

    def __new__(cls, answers: dict[str, str]):
        from lm_eval.api.model import LM

        class Scripted(LM):
            def __init__(self):
                super().__init__()
                self.contexts = []

            def generate_until(self, requests, disable_tqdm: bool = False):
                out = []
                for r in requests:
                    context, _ = r.args
                    self.contexts.append(context)
                    question = context.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
                    out.append(answers[question])
                return out

            def loglikelihood(self, requests):
                raise NotImplementedError

            def loglikelihood_rolling(self, requests):
                raise NotImplementedError

        return Scripted()


def test_lm_eval_scores_strict_and_flexible_as_gsm8k_and_parse_reads_them(tmp_path):
    """lm-eval itself scores scripted answers with the task's filters; parse_results reads strict and flexible."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    problems = common.load_problems(limit=4)
    gold = [p["answer"].rsplit("#### ", 1)[1] for p in problems]
    answers = {
        problems[0]["question"]: f" The answer is {gold[0]}.\n#### {gold[0]}",  # strict and flexible right
        problems[1]["question"]: f" So the result is {gold[1]}.",  # no '####': flexible (last number) only
        problems[2]["question"]: f" #### {gold[2]}\nand 1000 more",  # strict right, flexible takes 1000
        problems[3]["question"]: f" #### {int(gold[3]) + 1}\nI mean {gold[3]}",  # strict wrong, flexible right
    }
    lm = _ScriptedLM(answers)
    inc = write_local_task(tmp_path, TEST_JSONL, FEWSHOT_JSONL)
    res = simple_evaluate(
        model=lm,
        tasks=[LOCAL_TASK],
        num_fewshot=2,
        limit=4,
        task_manager=TaskManager(include_path=str(inc)),
        log_samples=False,
    )
    score = parse_results(res, LOCAL_TASK)
    assert (score.n, score.num_fewshot) == (4, 2)
    assert score.strict == pytest.approx(0.5) and score.flexible == pytest.approx(0.75)
    assert score.strict_stderr is not None and score.strict_stderr > 0
    # 2-shot prompts in the gsm8k layout, examples from the shipped few-shot file
    shots = [json.loads(line)["question"] for line in FEWSHOT_JSONL.read_text().splitlines()]
    assert all(c.count("Question: ") == 3 and c.endswith("\nAnswer:") for c in lm.contexts)
    assert all(any(q in c for q in shots) for c in lm.contexts)
    # our own judge (used by the demo) agrees with lm-eval's strict rule on these answers
    assert [common.is_correct(answers[p["question"]], p) for p in problems] == [True, False, True, False]


def test_parse_results_names_what_is_missing(tmp_path):
    with pytest.raises(LmEvalError, match=r"no results for task 'gsm_tiny' \(tasks present: \['gsm8k'\]\)"):
        parse_results({"results": {"gsm8k": {}}}, LOCAL_TASK)
    f = tmp_path / "results_x.json"
    f.write_text(json.dumps({"results": {"gsm_tiny": {"exact_match,strict-match": 1.0}}}))
    with pytest.raises(LmEvalError, match=r"results_x.json: task 'gsm_tiny' has no 'exact_match,flexible-extract'"):
        parse_results(f, LOCAL_TASK)


# vLLM's DeepSeek-V4 recipe, as published (model and host filled in)
RECIPE = [
    "--model",
    "local-completions",
    "--model_args",
    "model=deepseek-ai/DeepSeek-V4-Pro,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=128,"
    "max_retries=10,max_gen_toks=2048,timeout=60000",
    "--batch_size",
    "auto",
    "--tasks",
    "gsm8k",
    "--num_fewshot",
    "8",
]


def _eval_args(*argv: str):
    return build_parser("eval").parse_args(["eval", *argv])


def test_gsm8k_by_default_is_exactly_the_recipe(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    for argv in ((), ("--task", "gsm8k")):
        args = _eval_args("--base-url", "http://127.0.0.1:8000", *argv)
        run = lmeval_run(args, args.base_url, "deepseek-ai/DeepSeek-V4-Pro", Path("out"), None)
        # the recipe's arguments, in its order; --output_path/--log_samples only write the answers down
        assert run.lm_eval_args() == RECIPE + ["--output_path", "out", "--log_samples"]
        assert run.argv() == [sys.executable, "-m", "lm_eval", *run.lm_eval_args()]
        assert run.command_line() == shlex.join(["lm_eval", *RECIPE, "--output_path", "out", "--log_samples"])
        # online stays online: the Hub is not switched off behind the user's back
        assert "HF_HUB_OFFLINE" not in run.env() and "HF_DATASETS_OFFLINE" not in run.env()
    args = _eval_args("--base-url", "http://127.0.0.1:8000", "--offline")
    run = lmeval_run(args, args.base_url, "m", Path("out"), None)
    assert run.env()["HF_HUB_OFFLINE"] == run.env()["HF_DATASETS_OFFLINE"] == "1"
    assert run.command_line().startswith("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions")


def test_local_task_keeps_the_recipe_settings_and_sends_text():
    args = _eval_args("--base-url", "http://127.0.0.1:8000/v1", "--task", "local", "--limit", "5")
    run = lmeval_run(args, args.base_url, "dsv4-tiny", Path("o"), Path("inc"))
    assert run.lm_eval_args() == [
        "--model",
        "local-completions",
        "--model_args",
        "model=dsv4-tiny,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=128,max_retries=10,"
        "max_gen_toks=2048,timeout=60000,tokenizer_backend=None,tokenized_requests=False",
        "--batch_size",
        "auto",
        "--tasks",
        LOCAL_TASK,
        "--num_fewshot",
        "8",
        "--output_path",
        "o",
        "--log_samples",
        "--include_path",
        "inc",
        "--limit",
        "5",
    ]
    assert run.offline and run.env()["HF_DATASETS_OFFLINE"] == "1"


@pytest.mark.parametrize("task_args", [(), ("--task", "gsm8k")])
def test_gsm8k_offline_without_the_dataset_fails_in_one_line(tmp_path, task_args):
    """Offline with an empty Hugging Face cache: one line saying what is missing and how to get it, before any
    server is asked (port 9 has none), and never a silent switch to the shipped tiny task."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")
    }
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "out"
    r = subprocess.run(
        [DSV4_MTP, "eval", "--base-url", "http://127.0.0.1:9", *task_args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(
        f"dsv4-mtp eval: error: lm-eval's gsm8k dataset (openai/gsm8k, config main) is not cached ({tmp_path / 'hf'})"
    )
    assert "python -c \"import datasets; datasets.load_dataset('openai/gsm8k', 'main')\"" in lines[0]
    assert "--task local" in lines[0]
    assert not out.exists() or not any(out.rglob("*"))  # no task written, no lm-eval run


def _sample(doc_id: int, text: str, correct: bool) -> SampleAnswer:
    number = text.rsplit("#### ", 1)[-1]
    return SampleAnswer(doc_id, text, number, correct, number, correct)


def test_ab_report_compares_answer_by_answer():
    def result(strict, flex, al=None, pos=None):
        sd = None if al is None else {"mean_acceptance_length": al, "per_position_acceptance": pos}
        return {
            "score": {"strict": strict, "strict_stderr": 0.05, "flexible": flex, "flexible_stderr": None, "n": 3},
            "spec_decode": sd,
            "wall_s": 12.0,
            "lm_eval_command": f"lm_eval --x {strict}",
        }

    base = AbRun(
        "off",
        base_url="http://a",
        model="m",
        mtp="off",
        result=result(2 / 3, 0.6),
        answers={i: _sample(i, f"#### {i}", i != 2) for i in range(3)},
    )
    on = AbRun(
        "k2",
        base_url="http://b",
        model="m",
        mtp="K=2",
        baseline="off",
        result=result(1 / 3, 0.6, 2.5, [0.8, 0.7]),
        answers={0: _sample(0, "#### 0", True), 1: _sample(1, "#### 7", False), 2: _sample(2, "#### 2", False)},
    )
    compare([base, on])
    assert on.identical == (2, 3) and on.differing == [1]
    lines = report([base, on]).splitlines()
    # the 95 % intervals of 2/3 and 1/3 are the Wilson intervals of the textbooks
    assert lines[2] == (
        "| off | m | off | – | – | 0.6667 ± 0.0500 | 0.2077-0.9385 | 0.6000 | 3 | – | – | (baseline) | 12 | [1] |"
    )
    assert lines[3] == (
        "| k2 | m | K=2 | – | – | 0.3333 ± 0.0500 | 0.0615-0.7923 | 0.6000 | 3 | 2.500 | 0.80 / 0.70 "
        "| 2/3 (off) | 12 | [2] |"
    )
    assert f"[1] `lm_eval --x {2 / 3}`" in lines and f"[2] `lm_eval --x {1 / 3}`" in lines
    assert "- k2 vs off: 1 differ: doc 1: `1` (right) vs `7` (wrong)" in lines


def test_wilson_interval_matches_published_values():
    """Newcombe (1998), table I: 0/10, 10/10 and 50/100 (and it never leaves [0, 1])."""
    for (k, n), want in {(0, 10): (0.0, 0.2775), (10, 10): (0.7225, 1.0), (50, 100): (0.4038, 0.5962)}.items():
        assert wilson_interval(k, n) == pytest.approx(want, abs=5e-5)
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


def _fake_server(precision: str, accepted: tuple[int, int]):
    """A server's /health and /metrics as vLLM with the plugin exports them: K=2 spec-decode counters after 10
    drafts, and the plugin's draft-precision sample."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    text = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20.0\n'
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {sum(accepted)}.0\n'
        + "".join(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {a}.0\n'
            for i, a in enumerate(accepted)
        )
        + f'dsv4_mtp_draft_precision{{precision="{precision}"}} 1.0\n'
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = {"/metrics": text, "/health": b""}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_ab_names_servers_by_their_draft_precision_and_states_each_drafts_memory():
    """Two servers given by URL alone, one per VLLM_DSV4_MTP_DRAFT_PRECISION: each is labelled by the precision its
    /metrics reports, and the report gives each draft's weights per GPU under the profile, its acceptance and
    its decode speed per concurrency."""
    from vllm_dsv4_mtp.evaluate.eval_ab import draft_memory, label_by_precision, plan_url_runs
    from vllm_dsv4_mtp.serve.capacity import PRECISION_DRAFTS, Parallelism, check_capacity

    servers = [_fake_server("bf16", (9, 7)), _fake_server("stored", (8, 5))]
    try:
        urls = [f"http://127.0.0.1:{s.server_port}" for s in servers]
        runs = plan_url_runs(urls, None)
        assert [r.label for r in runs] == ["server 1", "server 2"] and runs[0].baseline is None
        label_by_precision(runs, None)
    finally:
        for s in servers:
            s.shutdown()
    assert [(r.label, r.precision, r.mtp, r.baseline) for r in runs] == [
        ("bf16", "bf16", "K=2", None),
        ("stored", "stored", "K=2", "bf16"),
    ]
    memory = draft_memory("mi355x-pro-tp8")
    for precision, draft in PRECISION_DRAFTS.items():  # the arithmetic `serve --dry-run` prints for that draft
        want = check_capacity(
            "amd/DeepSeek-V4-Pro-MXFP4",
            hardware="mi355x",
            par=Parallelism(tp=8),
            gpu_memory_utilization=0.85,
            max_model_len=None,
            kv_cache_dtype="fp8",
            mtp=True,
            draft=draft,
        )
        assert memory["gb"][precision] == pytest.approx(want.draft_gb[precision])
    assert memory["gb"]["bf16"] > 3 * memory["gb"]["stored"]  # MXFP4 experts: ~4x fewer bytes than BF16
    assert draft_memory(None) is None and draft_memory("cpu-tiny") is None  # no GPU: no per-GPU arithmetic
    with pytest.raises(ValueError, match="unknown profile 'mi300'"):
        draft_memory("mi300")
    for r, al in zip(runs, (1 + 16 / 10, 1 + 13 / 10), strict=True):
        r.result = {
            "score": {"strict": 0.9, "strict_stderr": 0.01, "flexible": 0.9, "flexible_stderr": 0.01, "n": 5},
            "spec_decode": {"mean_acceptance_length": al, "per_position_acceptance": [0.9, 0.7]},
            "wall_s": 3.0,
            "lm_eval_command": "lm_eval",
        }
        r.model = "m"
        r.sweep = [
            {"concurrency": c, "output_tok_s": 10.0 * c, "tpot_mean_ms": 5.0, "acceptance_length": al}
            | {"per_position_acceptance": [0.9, 0.7]}
            for c in (1, 8)
        ]
    lines = report(runs, memory).splitlines()
    gb = memory["gb"]
    assert lines[2].startswith(f"| bf16 | m | K=2 | bf16 | {gb['bf16']:.2f} GB | 0.9000 ± 0.0100 |")
    assert lines[3].startswith(f"| stored | m | K=2 | stored | {gb['stored']:.2f} GB | 0.9000 ± 0.0100 |")
    assert "| 2.600 | 0.90 / 0.70 |" in lines[2] and "| 2.300 | 0.90 / 0.70 |" in lines[3]
    trade = next(x for x in lines if x.startswith("Draft weights per GPU under mi355x-pro-tp8"))
    assert f"costs {gb['bf16'] - gb['stored']:.2f} GB = {memory['bf16_kv_tokens']:,.0f} KV-cache tokens" in trade
    assert "| stored | stored | 8 | 80.0 | 5.0 | 2.300 | 0.90 / 0.70 |" in lines


# ------------------------------------------------------------------------------- against a real server


K = 1


@pytest.fixture(scope="module")
def server(start_server, embedded_mxfp4):
    return start_server(embedded_mxfp4, mtp_k=K)


@pytest.mark.engine
def test_eval_local_task_against_server(server, tmp_path):
    from vllm_dsv4_mtp.evaluate.client import complete

    out = tmp_path / "eval"
    r = procs.run(
        [
            DSV4_MTP,
            "eval",
            "--base-url",
            server.base_url,
            "--task",
            "local",
            "--limit",
            "3",
            "--num-fewshot",
            "2",
            "--max-gen-toks",
            "48",
            "--num-concurrent",
            "1",
            "--out",
            str(out),
            "--json",
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["lm_eval_command"].startswith(
        "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions --model_args model=dsv4-tiny,"
    )
    score = res["score"]
    assert score["task"] == LOCAL_TASK and score["n"] == 3 and score["num_fewshot"] == 2
    assert 0.0 <= score["strict"] <= 1.0 and 0.0 <= score["flexible"] <= 1.0
    # the samples lm-eval logged are this server's greedy answers to 2-shot held-out prompts
    samples_file = next(Path(score["results_file"]).parent.glob("samples_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    by_filter = {f: {s["doc_id"]: s for s in samples if s["filter"] == f} for f in ("strict-match", "flexible-extract")}
    assert all(sorted(rows) == [0, 1, 2] for rows in by_filter.values())
    problems = common.load_problems(limit=3)
    for doc_id, s in by_filter["strict-match"].items():
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        assert prompt.count("Question: ") == 3
        assert prompt.endswith(f"Question: {problems[doc_id]['question']}\nAnswer:")
        answer = s["resps"][0][0]
        again = complete(server.base_url, "dsv4-tiny", prompt, max_tokens=48, stop=["Question:"], stream=False)
        # greedy, one request at a time in both runs (same batch shapes, so bf16 near-ties cannot flip):
        # what lm-eval scored is this server's answer
        assert again.text == answer
        # lm-eval's strict-match verdict on the real answer agrees with the demo's judge
        assert bool(s["exact_match"]) == common.is_correct(answer, problems[doc_id])
    assert score["strict"] == pytest.approx(sum(s["exact_match"] for s in by_filter["strict-match"].values()) / 3)
    assert score["flexible"] == pytest.approx(sum(s["exact_match"] for s in by_filter["flexible-extract"].values()) / 3)
    sd = res["spec_decode"]
    assert sd["num_drafts"] > 0 and 1.0 <= sd["mean_acceptance_length"] <= 1.0 + K
    assert len(sd["per_position_acceptance"]) == K


@pytest.mark.engine
def test_ab_over_running_servers_compares_every_answer(server, tmp_path):
    """--ab over servers given by URL (here the same one twice, the second without a label): both runs scored, MTP
    and the draft precision read from /metrics (the unlabelled run named by it), every answer compared with the
    baseline's (greedy, one request at a time: all identical), and a decode-speed level per run."""
    out = tmp_path / "ab"
    r = procs.run(
        [
            DSV4_MTP,
            "eval",
            "--ab",
            "--task",
            "local",
            "--server",
            f"first={server.base_url}",
            "--server",
            f"{server.base_url}/v1",
            "--concurrency",
            "1",
            "--bench-requests",
            "2",
            "--bench-max-tokens",
            "8",
            "--limit",
            "3",
            "--num-fewshot",
            "2",
            "--max-gen-toks",
            "48",
            "--num-concurrent",
            "1",
            "--out",
            str(out),
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    mtp = f"K={K}"
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| first | dsv4", "| bf16 | dsv4"))]
    assert len(rows) == 2
    assert rows[0].startswith(f"| first | dsv4-tiny | {mtp} | bf16 | – | ") and "| 3 | " in rows[0]
    assert "(baseline)" in rows[0]
    assert rows[1].startswith(f"| bf16 | dsv4-tiny | {mtp} | bf16 | – | ") and "| 3/3 (first) |" in rows[1]
    assert "- bf16 vs first: none, all 3 identical" in r.stdout
    speed = [line for line in r.stdout.splitlines() if line.startswith(("| first | bf16 | 1 |", "| bf16 | bf16 | 1 |"))]
    assert len(speed) == 2 and all(float(x.split("|")[4]) > 0 for x in speed), r.stdout
    assert r.stdout.count("`HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions") == 2
    report = json.loads((out / "eval_ab.json").read_text())
    assert [row["identical_to_baseline"] for row in report["rows"]] == [None, [3, 3]]
    for row in report["rows"]:
        assert row["strict_correct"] == round(3 * row["score"]["strict"])
        assert row["strict_ci95"] == pytest.approx(wilson_interval(row["strict_correct"], 3))
    assert [row["draft_precision"] for row in report["rows"]] == ["bf16", "bf16"]
    assert all(row["speed"][0]["requests"] == 2 and row["speed"][0]["failed"] == 0 for row in report["rows"])
    answers = [json.loads(line) for line in (out / "eval_ab_answers.jsonl").read_text().splitlines()]
    assert [a["doc_id"] for a in answers] == [0, 1, 2]
    assert all(a["runs"]["first"]["response"] == a["runs"]["bf16"]["response"] for a in answers)


def test_eval_reports_an_unreachable_server(tmp_path):
    r = subprocess.run(
        [DSV4_MTP, "eval", "--base-url", "http://127.0.0.1:9", "--task", "local", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:9/health" in r.stderr, r.stderr


def test_ab_refuses_an_unknown_baseline(tmp_path):
    r = subprocess.run(
        [
            DSV4_MTP,
            "eval",
            "--ab",
            "--task",
            "local",
            "--server",
            "a=http://127.0.0.1:9",
            "--baseline",
            "b",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "--baseline 'b' is none of the runs ['a']" in r.stderr, r.stderr


def test_ab_without_the_embedded_checkpoints_says_what_to_pass(monkeypatch, tmp_path, capsys):
    """--ab with neither --server nor --checkpoint serves the shipped BF16 and MXFP4 checkpoints; when one is absent
    (an installed wheel) it names it and the flags, and starts nothing."""
    from vllm_dsv4_mtp import embedded
    from vllm_dsv4_mtp.cli import main

    missing = tmp_path / "tiny-dsv4-mxfp4"
    monkeypatch.setattr(embedded, "MXFP4_CHECKPOINT_DIR", missing)
    assert main(["eval", "--ab", "--task", "local", "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"dsv4-mtp eval --ab: error: no checkpoint at {missing} (the embedded checkpoints ship with the "
        "repository, not the wheel): pass --server URL or --checkpoint NAME=DIR\n"
    )
    assert out == "" and not (tmp_path / "out").exists()


def test_wait_healthy_fails_fast_with_the_exit_status_of_a_crashed_server():
    """The one /health poll that ManagedServer, eval --wait and the launcher test share: a server process that
    died while loading is reported at once with its status, not after the whole timeout."""
    import time

    from vllm_dsv4_mtp.evaluate.server import ServerExitedError, ServerNotReadyError, free_port, wait_healthy

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.monotonic()
    with pytest.raises(
        ServerExitedError,
        match=rf"^the server for http://127.0.0.1:{port}/health exited with status 3 "
        r"before becoming healthy$",
    ) as e:
        wait_healthy(f"http://127.0.0.1:{port}/v1", 300, poll_s=0.2, exit_status=proc.poll)
    assert e.value.status == 3 and time.monotonic() - t0 < 60
    # without a process to watch, the time allowed runs out and says so
    with pytest.raises(ServerNotReadyError, match=rf"^cannot reach http://127.0.0.1:{port}/health after waiting 1 s: "):
        wait_healthy(f"http://127.0.0.1:{port}", 1, poll_s=0.2)
