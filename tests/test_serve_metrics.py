"""`dsv4-mtp metrics`: acceptance numbers from a real vLLM ``/metrics`` exposition.

The text is produced by vLLM's own spec-decode Prometheus code (``SpecDecodingProm``, the class the server
uses) fed with draft outcomes chosen here, so the expected numbers are computed from those outcomes, not
copied from the parser. A live server's ``/metrics`` is parsed in tests/test_serve_e2e.py.
"""

from __future__ import annotations

import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from vllm_dsv4_mtp.serve import metrics as M

K = 3
# (draft tokens proposed, tokens accepted) per verify step, over two engines (data-parallel ranks)
OUTCOMES = {0: [(3, 3), (3, 1), (3, 0), (3, 2), (2, 2)], 1: [(3, 3), (3, 3), (1, 0)]}


def _vllm_exposition() -> str:
    import prometheus_client  # vLLM's own dependency: a missing one fails here, it never skips
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()

    class PrivateRegistryProm(SpecDecodingProm):  # vLLM's class, counters on a registry of this test's own
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    prom = PrivateRegistryProm(
        SimpleNamespace(num_speculative_tokens=K),
        ["model_name", "engine"],
        {0: ["dsv4-tiny", "0"], 1: ["dsv4-tiny", "1"]},
    )
    for engine, steps in OUTCOMES.items():
        stats = SpecDecodingStats.new(K)
        for drafted, accepted in steps:
            stats.observe_draft(drafted, accepted)
        prom.observe(stats, engine_idx=engine)
    return prometheus_client.generate_latest(registry).decode()


def _expected():
    steps = [s for v in OUTCOMES.values() for s in v]
    drafts, drafted, accepted = len(steps), sum(d for d, _ in steps), sum(a for _, a in steps)
    per_pos = [sum(1 for _, a in steps if a > i) / drafts for i in range(K)]
    return drafts, drafted, accepted, per_pos


def test_parse_vllm_spec_decode_exposition():
    text = _vllm_exposition()
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="dsv4-tiny",position="2"}' in text
    m = M.spec_decode_metrics(text)
    drafts, drafted, accepted, per_pos = _expected()
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (drafts, drafted, accepted)
    assert m.acceptance_rate == pytest.approx(accepted / drafted)
    assert m.mean_acceptance_length == pytest.approx(1 + accepted / drafts)
    assert m.per_position == pytest.approx(per_pos)
    assert M.spec_decode_metrics(text, model_name="other") is None


def test_since_gives_the_numbers_between_two_scrapes():
    before = M.spec_decode_metrics(_vllm_exposition())
    after = M.SpecDecodeMetrics(
        before.num_drafts + 4,
        before.num_draft_tokens + 12,
        before.num_accepted_tokens + 9,
        {p: v + {0: 4, 1: 3, 2: 2}[p] for p, v in before.accepted_per_position.items()},
    )
    d = after.since(before)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (4, 12, 9)
    assert d.mean_acceptance_length == pytest.approx(1 + 9 / 4) and d.per_position == pytest.approx([1, 0.75, 0.5])


def test_no_spec_decode_counters_means_none():
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    )
    assert M.spec_decode_metrics(text) is None


def test_malformed_line_is_named():
    with pytest.raises(M.MetricsFormatError, match=r"line 2: not a Prometheus sample: 'this is not'"):
        M.parse_prometheus_text("# ok\nthis is not\n")


def test_label_values_with_escapes():
    (s,) = M.parse_prometheus_text('x_total{model_name="a\\"b\\\\c",engine="0"} 3.0 1700000000\n')
    assert s.labels == {"model_name": 'a"b\\c', "engine": "0"} and s.value == 3.0


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/metrics"])
def test_metrics_url(url):
    assert M.metrics_url(url) == "http://h:1/metrics"


def _serve_metrics(text: bytes) -> HTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            ok = self.path == "/metrics"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(text if ok else b"")

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_metrics_over_replicas_gives_each_and_the_sum(capsys):
    """Issue 49: ``dsv4-mtp metrics URL1 URL2`` (replicas behind a router): each replica's acceptance and all of
    them summed; a replica that cannot be read is named, the others still reported, exit status 1."""
    servers = [_serve_metrics(_vllm_exposition().encode()) for _ in range(2)]
    try:
        urls = [f"http://127.0.0.1:{s.server_port}" for s in servers]
        assert M.main([*urls, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        drafts, drafted, accepted, per_pos = _expected()
        assert set(got["replicas"]) == set(urls)
        for one in got["replicas"].values():
            assert one["num_drafts"] == drafts and one["num_accepted_tokens"] == accepted
        total = got["total"]
        assert (total["num_drafts"], total["num_draft_tokens"]) == (2 * drafts, 2 * drafted)
        assert total["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert total["per_position_acceptance"] == pytest.approx(per_pos)
        dead = "http://127.0.0.1:9"  # the discard port: nothing listens
        assert M.main([*urls, dead, "--timeout", "2"]) == 1
        out = capsys.readouterr()
        assert "all 2 of 3 replicas" in out.out and f"cannot read {dead}/metrics" in out.err
    finally:
        for s in servers:
            s.shutdown()


def test_metrics_command_against_an_http_server(capsys):
    text = _vllm_exposition().encode()
    srv = _serve_metrics(text)
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        assert M.main([url, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        drafts, drafted, accepted, per_pos = _expected()
        assert got["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert got["per_position_acceptance"] == pytest.approx(per_pos)
        assert M.main([url + "/v1"]) == 0
        assert f"mean acceptance length {1 + accepted / drafts:.4f}" in capsys.readouterr().out
    finally:
        srv.shutdown()
    assert M.main([url, "--timeout", "2"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_the_plugin_exports_its_draft_precision_and_vllm_keeps_it(monkeypatch):
    """The sample vLLM's API server serves from its default registry; read at each scrape from the environment,
    and not among the collectors vLLM unregisters when it builds its own."""
    import prometheus_client
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    assert M.export_draft_precision() and M.export_draft_precision()  # twice: registered once
    unregister_vllm_metrics()
    for value, want in (("", "bf16"), ("stored", "stored"), (" BF16 ", "bf16")):
        monkeypatch.setenv("VLLM_DSV4_MTP_DRAFT_PRECISION", value)
        text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
        assert f'dsv4_mtp_draft_precision{{precision="{want}"}} 1.0' in text.splitlines()
        assert M.draft_precision_from_metrics(text) == want
    monkeypatch.setenv("VLLM_DSV4_MTP_DRAFT_PRECISION", "fp4")  # refused by the draft: nothing claimed
    assert M.draft_precision_from_metrics(prometheus_client.generate_latest().decode()) is None
    assert M.draft_precision_from_metrics(_vllm_exposition()) is None  # a server without the plugin
