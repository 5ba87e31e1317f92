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
    req = urllib.request.Request(
        base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def stream_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def greedy_tokens(base_url: str, prompt: list[int], n: int = 8) -> list[int]:
    status, text = call(
        base_url,
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


def fuzz_cases(seed: int, count: int, prompt_lens: tuple[int, ...], vocab: int = 512) -> list[dict]:
    """``count`` request bodies: random mixes of the sampling parameters, prompts (token ids) of the given
    lengths, streamed or not. About one value in twenty is out of range on purpose (those must be 4xx)."""
    rng = random.Random(seed)

    def pick(p, valid, invalid=()):
        """None (parameter left out) with probability 1 - p, else a valid value, rarely an invalid one."""
        if rng.random() >= p:
            return None
        return rng.choice(invalid) if invalid and rng.random() < 0.05 else rng.choice(valid)

    cases = []
    for _ in range(count):
        body = {
            "model": MODEL,
            "prompt": [rng.randrange(2, vocab) for _ in range(rng.choice(prompt_lens))],
            "max_tokens": rng.choice([1, 2, 5, 8, 16]),
            "temperature": pick(0.9, [0.0, 0.0, 0.3, 0.8, 1.0, 1.5], [-0.5]),
            "top_k": pick(0.5, [-1, 0, 1, 2, 5, 50, 10_000], [-7]),
            "top_p": pick(0.4, [1.0, 0.95, 0.5, 0.01], [0.0, 1.2]),
            "min_p": pick(0.2, [0.0, 0.05, 0.5, 1.0], [2.0]),
            "seed": pick(0.4, [0, 1, 12345, 2**31 - 1]),
            "n": pick(0.2, [1, 2, 3]),
            "logprobs": pick(0.2, [0, 1, 5], [100]),
            "prompt_logprobs": pick(0.15, [0, 1, 3], [-2]),
            "stop": pick(0.2, [["\n"], ["a", "b"], "x"]),
            "frequency_penalty": pick(0.2, [0.0, 0.5, 2.0], [3.0]),
            "presence_penalty": pick(0.2, [0.0, -1.0, 1.5], [-3.0]),
            "repetition_penalty": pick(0.2, [1.0, 1.3, 0.8], [0.0]),
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
    bad = [
        (s, case, text[-300:])
        for s, (_, text, case) in zip(statuses, results)
        if not (200 <= s < 300 or 400 <= s < 500)
    ]
    assert not bad, f"{len(bad)} of {len(results)} requests got no 2xx/4xx answer: {bad[:3]}"
    for s, text, case in results:
        if s == 200 and case.get("stream"):
            events = stream_events(text)
            assert events and events[-1] == "[DONE]", (case, text[-300:])
    return statuses
