"""HTTP helpers for the request-robustness tests: one call -> (status, body), SSE streams, a sampling fuzz.

A server must answer every request with 2xx or 4xx; a 5xx, a dropped connection or a hung stream is the fault
these helpers report (issue 38).
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

MODEL = "dsv4-tiny"


def call(base_url: str, body: dict, timeout: float = 300.0) -> tuple[int, str]:
    """``POST /v1/completions``; ``(HTTP status, body text)``; a streamed answer is read to its end."""
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def stream_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def greedy_tokens(base_url: str, prompt: list[int], n: int = 8) -> list[int]:
    status, text = call(base_url, {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                                   "ignore_eos": True, "return_token_ids": True})
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


def fuzz_cases(seed: int, count: int, prompt_lens: tuple[int, ...], vocab: int = 512) -> list[dict]:
    """``count`` request bodies: random mixes of the sampling parameters, some values out of range on purpose
    (those must be 4xx), prompts (token ids) of the given lengths, streamed or not."""
    rng = random.Random(seed)

    def maybe(p, value):
        return value() if rng.random() < p else None

    cases = []
    for _ in range(count):
        n_prompt = rng.choice(prompt_lens)
        body = {
            "model": MODEL,
            "prompt": [rng.randrange(2, vocab) for _ in range(n_prompt)],
            "max_tokens": rng.choice([1, 2, 5, 8]),
            "temperature": rng.choice([0.0, 0.0, 0.3, 0.8, 1.0, 1.5, -0.5]),
            "top_k": maybe(0.5, lambda: rng.choice([-1, 0, 1, 2, 5, 50, 10_000, -7])),
            "top_p": maybe(0.4, lambda: rng.choice([1.0, 0.95, 0.5, 0.01, 0.0, 1.2])),
            "min_p": maybe(0.2, lambda: rng.choice([0.0, 0.05, 0.5, 1.0, 2.0])),
            "seed": maybe(0.4, lambda: rng.randrange(0, 2**31)),
            "n": maybe(0.2, lambda: rng.choice([1, 2, 3])),
            "logprobs": maybe(0.2, lambda: rng.choice([0, 1, 5, 100])),
            "prompt_logprobs": maybe(0.15, lambda: rng.choice([0, 1, 3])),
            "stop": maybe(0.2, lambda: rng.choice([["\n"], ["a", "b"], "x"])),
            "frequency_penalty": maybe(0.2, lambda: rng.choice([0.0, 0.5, 2.0, 3.0])),
            "presence_penalty": maybe(0.2, lambda: rng.choice([0.0, -1.0, 1.5])),
            "repetition_penalty": maybe(0.2, lambda: rng.choice([1.0, 1.3, 0.0])),
            "stream": rng.random() < 0.3,
            "ignore_eos": rng.random() < 0.5,
        }
        cases.append({k: v for k, v in body.items() if v is not None})
    return cases


def run_fuzz(base_url: str, cases: list[dict], workers: int = 4) -> list[tuple[int, str, dict]]:
    """Send every case (``workers`` at a time); ``(status, body, case)`` each."""
    def one(case):
        status, text = call(base_url, case)
        return status, text, case

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, cases))


def effective_status(status: int, text: str, stream: bool) -> int:
    """The HTTP status, or for a stream that vLLM opened with 200 and then ended with an error event (its way
    of refusing a streamed request whose parameters it rejects after the headers), that event's code."""
    if status != 200 or not stream:
        return status
    for event in stream_events(text):
        if event.startswith("{") and '"error"' in event:
            return int(json.loads(event)["error"].get("code") or 500)
    return status


def check_fuzz_results(results) -> list[int]:
    """Every answer 2xx or 4xx (a stream's error event counts by its code); a stream ends with ``[DONE]``.
    Returns the effective statuses."""
    statuses = [effective_status(s, text, bool(case.get("stream"))) for s, text, case in results]
    bad = [(s, case, text[-300:]) for s, (_, text, case) in zip(statuses, results)
           if not (200 <= s < 300 or 400 <= s < 500)]
    assert not bad, f"{len(bad)} of {len(results)} requests got no 2xx/4xx answer: {bad[:3]}"
    for s, text, case in results:
        if s == 200 and case.get("stream"):
            events = stream_events(text)
            assert events and events[-1] == "[DONE]", (case, text[-300:])
    return statuses
