"""A minimal OpenAI ``/v1/completions`` client (standard library only) that times each request.

Streaming is used so the first token's arrival is seen: ``ttft_s`` (time to first token), ``latency_s``
(end to end) and the number of output tokens from the final usage chunk (``stream_options.include_usage``).
TPOT is ``(latency - ttft) / (output tokens - 1)``; with speculative decoding one streamed chunk may carry
several tokens, so tokens are counted from usage, never from chunks.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

from .server import api_root


class NotLoopbackError(ValueError):
    """The benchmark only sends request loops to a server on this machine."""


def require_loopback(base_url: str) -> None:
    host = urllib.parse.urlsplit(api_root(base_url)).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise NotLoopbackError(
            f"{base_url}: the benchmark sends request loops to 127.0.0.1 / localhost only "
            f"(host {host!r} is not a loopback address)"
        )


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    latency_s: float
    ttft_s: float | None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def complete(
    base_url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    stream: bool = True,
    timeout: float = 600.0,
) -> Completion:
    """One completion request; raises ``urllib.error.URLError``/``HTTPError`` on failure."""
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
    }
    if stop:
        body["stop"] = stop
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: exactly max_tokens output tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        api_root(base_url) + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback server)
        if not stream:
            out = json.loads(r.read())
            latency = time.perf_counter() - t0
            ch = out["choices"][0]
            return Completion(
                ch["text"],
                out["usage"]["prompt_tokens"],
                out["usage"]["completion_tokens"],
                ch.get("finish_reason"),
                latency,
                None,
            )
        parts: list[str] = []
        usage: dict | None = None
        finish = None
        for raw in r:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(ch["text"])
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
        latency = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(f"{api_root(base_url)}/completions streamed no usage chunk (stream_options.include_usage)")
    return Completion("".join(parts), usage["prompt_tokens"], usage["completion_tokens"], finish, latency, ttft)
