"""`dsv4-mtp eval`: the local GSM8K-style lm-eval task, lm-eval's strict / flexible scoring read back, and a real
lm-eval `local-completions` run against a vLLM server serving a tiny DeepSeek-V4 (one server for the module).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_dsv4_mtp.embedded import FEWSHOT_JSONL, TEST_JSONL
from vllm_dsv4_mtp.evaluate import common
from vllm_dsv4_mtp.evaluate.eval_cmd import AbRow, ab_table
from vllm_dsv4_mtp.evaluate.lmeval import LOCAL_TASK, LmEvalError, LmEvalRun, parse_results, write_local_task

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")
LMEVAL_GSM8K = Path(__import__("lm_eval").__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"


# ------------------------------------------------------------------------------------------ the local task


def test_local_task_is_lm_evals_gsm8k_on_local_jsonl(tmp_path):
    inc = write_local_task(tmp_path, TEST_JSONL, FEWSHOT_JSONL)
    ours = yaml.safe_load((inc / f"{LOCAL_TASK}.yaml").read_text())
    stock = yaml.safe_load(LMEVAL_GSM8K.read_text())
    # everything that decides the prompt, the stop strings and the score is gsm8k's own
    for key in ("output_type", "doc_to_text", "doc_to_target", "metric_list", "filter_list", "generation_kwargs",
                "training_split", "fewshot_split", "test_split", "repeats"):
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
    res = simple_evaluate(model=lm, tasks=[LOCAL_TASK], num_fewshot=2, limit=4,
                          task_manager=TaskManager(include_path=str(inc)), log_samples=False)
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


def test_lm_eval_command_has_the_recipe_shape():
    run = LmEvalRun(base_url="http://127.0.0.1:8000", model="m", num_fewshot=8, num_concurrent=16, limit=5)
    argv = run.argv()
    assert argv[1:4] == ["-m", "lm_eval", "run"]
    assert argv[argv.index("--model") + 1] == "local-completions"
    assert argv[argv.index("--tasks") + 1] == "gsm8k" and argv[argv.index("--num_fewshot") + 1] == "8"
    margs = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert margs["base_url"] == "http://127.0.0.1:8000/v1/completions" and margs["num_concurrent"] == "16"
    assert margs["tokenized_requests"] == "False"
    assert "--apply_chat_template" not in argv


def test_ab_table_rows():
    def res(strict, flex, al=None, pos=None):
        sd = None if al is None else {"mean_acceptance_length": al, "per_position_acceptance": pos}
        return {"score": {"strict": strict, "flexible": flex, "n": 10}, "spec_decode": sd, "wall_s": 12.0}

    table = ab_table([AbRow("BF16", None, res(0.5, 0.6)), AbRow("BF16", 1, res(0.5, 0.6, 1.9, [0.9]), identical=(10, 10)),
                      AbRow("MXFP4", 3, res(0.4, 0.5, 2.5, [0.8, 0.5, 0.2]), identical=(9, 10))])
    lines = table.strip().splitlines()
    assert len(lines) == 5
    assert lines[2].startswith("| BF16 | MTP off | 0.5000 | 0.6000 | 10 | – | – | – |")
    assert "| BF16 | MTP K=1 | 0.5000 | 0.6000 | 10 | 1.900 | 0.90 | 10/10 |" in lines[3]
    assert "| MXFP4 | MTP K=3 | 0.4000 | 0.5000 | 10 | 2.500 | 0.80 / 0.50 / 0.20 | 9/10 |" in lines[4]


# ------------------------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_dsv4_mtp.evaluate.server import ManagedServer, ServerSpec

    models = common.embedded_models()
    if models:
        model = str(models.get("MXFP4") or models["BF16"])
    else:
        from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

        model = str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", experts="mxfp4"))
    k = 1 if common.mtp_draft_registered() else None
    srv = ManagedServer(ServerSpec(model=model, mtp_k=k), log_path=tmp_path_factory.mktemp("srv") / "server.log",
                        start_timeout_s=600)
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.engine
def test_eval_local_task_against_server(server, tmp_path):
    from vllm_dsv4_mtp.evaluate.client import complete

    out = tmp_path / "eval"
    r = subprocess.run([DSV4_MTP, "eval", "--base-url", server.base_url, "--limit", "3", "--num-fewshot", "2",
                        "--max-gen-toks", "48", "--num-concurrent", "1", "--out", str(out), "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout)
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
    assert score["flexible"] == pytest.approx(
        sum(s["exact_match"] for s in by_filter["flexible-extract"].values()) / 3)
    if server.spec.mtp_k is not None:
        sd = res["spec_decode"]
        assert sd["num_drafts"] > 0 and 1.0 <= sd["mean_acceptance_length"] <= 2.0
        assert len(sd["per_position_acceptance"]) == 1
    else:
        assert res["spec_decode"] is None


def test_eval_reports_an_unreachable_server(tmp_path):
    r = subprocess.run([DSV4_MTP, "eval", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:9" in r.stderr
