"""The MTP draft through vLLM's OpenAI server: concurrent requests, lossless greedy outputs, /metrics.

One server (``python -m vllm.entrypoints.openai.api_server``, float32, ``--speculative-config
{"method": "mtp", "num_speculative_tokens": 2}``) on a random tiny checkpoint (head scaled x4, routing fixed by
``sharpen_routing``, 64 indexer heads). 8 greedy requests sent at once must each produce, at every step, the
argmax of HF transformers' float32 forward over the whole sequence (the target without speculation); sampled
requests run alongside; the server's ``/metrics`` counters, read with ``vllm_dsv4_mtp.serve.metrics``, show
one draft of K tokens per verify step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm_dsv4_mtp.evaluate.server import free_port

pytestmark = pytest.mark.engine

K = 2
PROMPT_LENS = (4, 11, 23, 40, 64, 97, 131, 150)
MAX_TOKENS = 10
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_dsv4_mtp.testing.hf_oracle import sharpen_routing
    from vllm_dsv4_mtp.testing.mtp_checkpoints import scale_head
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    d = build_tiny_checkpoint(tmp_path_factory.mktemp("mtp-server") / "bf16", tiny_config(index_n_heads=64), seed=4)
    sharpen_routing(d)
    scale_head(d, 4.0)
    return d


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mtp-server-log") / "server.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
            "--served-model-name", "dsv4-tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--max-num-seqs", "8", "--port", str(port), "--seed", "0",
            "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": K})]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                _get(url + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")
                time.sleep(2)
        yield url, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prompts(vocab=512, seed=31):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _complete(url, prompt, **kw):
    body = {"model": "dsv4-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True, **kw}
    choice = _post(url + "/v1/completions", body)["choices"][0]
    return list(choice["token_ids"])


def test_the_plugin_draft_serves_mtp(server):
    _, log = server
    text = log.read_text()
    assert "DeepSeek-V4 MTP draft served by the plugin's portable vllm_dsv4_mtp.model.mtp.DeepSeekV4MTPModel" in text
    assert "Shared target model lm_head with MTP shared_head.head." in text


def test_concurrent_requests_lossless_and_counted(server, ckpt):
    """8 greedy requests and 4 sampled ones at once; greedy tokens == HF's full-sequence argmax at every step."""
    from vllm_dsv4_mtp.testing.hf_oracle import hf_logprobs, load_hf_model
    from vllm_dsv4_mtp.serve.metrics import scrape

    url, _ = server
    before = scrape(url)
    prompts = _prompts()
    with ThreadPoolExecutor(max_workers=12) as pool:
        greedy = [pool.submit(_complete, url, p, temperature=0.0) for p in prompts]
        sampled = [pool.submit(_complete, url, p, temperature=0.8, seed=i) for i, p in enumerate(prompts[:4])]
        gens = [f.result() for f in greedy]
        samples = [f.result() for f in sampled]
    after = scrape(url)

    assert all(len(s) == MAX_TOKENS and all(0 <= t < 512 for t in s) for s in samples)
    hf = load_hf_model(ckpt)
    steps = ties = 0
    for prompt, gen in zip(prompts, gens):
        assert len(gen) == MAX_TOKENS
        ref = hf_logprobs(hf, prompt + gen)[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
        top2 = ref.topk(2, dim=-1).values
        for j, tok in enumerate(gen):
            steps += 1
            if tok != int(ref[j].argmax()):
                assert top2[j, 0] - top2[j, 1] < 1e-4, f"prompt of {len(prompt)} tokens, step {j}: {tok} is not " \
                                                       f"HF's argmax {int(ref[j].argmax())}"
                ties += 1
    assert steps == len(prompts) * MAX_TOKENS and ties <= 1

    assert after is not None, "the server exports no vllm:spec_decode_* counters: speculation is off"
    m = after.since(before) if before is not None else after
    print(m.summary())
    assert m.num_drafts >= len(prompts) * (MAX_TOKENS - 1) / 2
    assert m.num_draft_tokens == K * m.num_drafts
    assert sorted(m.accepted_per_position) == list(range(K))
    assert m.acceptance_rate is not None and 0.0 <= m.acceptance_rate <= 1.0
    assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
