"""The MTP draft through vLLM's OpenAI server: concurrent requests, lossless greedy outputs, /metrics.

One server (``dsv4-mtp serve --profile cpu-tiny`` through ``ManagedServer``, with ``--dtype float32`` and the
profile's MTP speculative config at K = 2) on a random tiny checkpoint (head scaled x4, routing fixed by
``sharpen_routing``, 64 indexer heads). 8 greedy requests sent at once must each produce, at every step, the
argmax of HF transformers' float32 forward over the whole sequence (the target without speculation); sampled
requests run alongside; the server's ``/metrics`` counters, read with ``vllm_dsv4_mtp.serve.metrics``, show
one draft of K tokens per verify step.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from checkpoints import random_prompts, sharpened_tiny
from servers import post_json

pytestmark = pytest.mark.engine

K = 2
PROMPT_LENS = (4, 11, 23, 40, 64, 97, 131, 150)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return sharpened_tiny(tmp_path_factory, "mtp-server", seed=4, head_scale=4.0, index_n_heads=64)


@pytest.fixture(scope="module")
def server(ckpt, start_server):
    """The profile's flags (8 sequences, eager, served as dsv4-tiny), in float32 like the HF oracle."""
    return start_server(ckpt, mtp_k=K, extra_args=["--dtype", "float32", "--max-model-len", "512", "--seed", "0"])


def _prompts(seed=31):
    return random_prompts(PROMPT_LENS, seed)


def _complete(url, prompt, **kw):
    body = {
        "model": "dsv4-tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    choice = post_json(url + "/v1/completions", body)["choices"][0]
    return list(choice["token_ids"])


def test_the_plugin_draft_serves_mtp(server):
    text = server.log_path.read_text()
    # the wrapper's printed command: float32 (what the HF comparison needs) and the profile's MTP config at K
    assert "  --dtype float32 \\\n" in text
    spec = f'{{"method":"mtp","num_speculative_tokens":{K}}}'
    assert f"  --speculative-config '{spec}' \\\n" in text
    assert "DeepSeek-V4 MTP draft served by the plugin's portable vllm_dsv4_mtp.model.mtp.DeepSeekV4MTPModel" in text
    assert "Shared target model lm_head with MTP shared_head.head." in text


def test_concurrent_requests_lossless_and_counted(server, ckpt):
    """8 greedy requests and 4 sampled ones at once; greedy tokens == HF's full-sequence argmax at every step."""
    from vllm_dsv4_mtp.serve.metrics import scrape
    from vllm_dsv4_mtp.testing.hf_oracle import hf_logprobs, load_hf_model

    url = server.base_url
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
                assert top2[j, 0] - top2[j, 1] < 1e-4, (
                    f"prompt of {len(prompt)} tokens, step {j}: {tok} is not HF's argmax {int(ref[j].argmax())}"
                )
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
