"""HTTP to a test's vLLM server (started by ``tests/conftest.py``'s ``start_server``, or by the launcher test)."""

from __future__ import annotations

import json
import urllib.request


def get(url: str, timeout: float = 5.0) -> bytes:
    """The body of ``GET url``; raises ``OSError`` (``URLError``, ``HTTPError``) when there is no 2xx answer."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post_json(url: str, body: dict, timeout: float = 300.0) -> dict:
    """``POST url`` with a JSON body; the decoded JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
