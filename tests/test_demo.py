"""`dsv4-mtp demo` end to end (what `make demo` runs): serve the embedded tiny model with MTP K=2 on CPU, answer
held-out problems, judge them, report acceptance length and tokens/s with and without MTP, both rows measured
the same way and consistent with their end-to-end times.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import procs
import pytest

from vllm_dsv4_mtp import embedded
from vllm_dsv4_mtp.cli import main
from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR
from vllm_dsv4_mtp.evaluate import common
from vllm_dsv4_mtp.evaluate.client import complete
from vllm_dsv4_mtp.evaluate.demo import ask_all, draw_problems, measured_line, summarize

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")

# ------------------------------------------------------------------ bursty delivery (the 26431.8 tokens/s)

ANSWER_TOKENS = [" Paul", " spends", " 3", " *", " 3", " =", " $9", ".", "\n####", " 9"]
STALL_S, ENGINE_DECODE_S = 0.3, 0.2


class _BurstyServer(ThreadingHTTPServer):
    """An OpenAI completions endpoint whose answer reaches the client in one burst after a stall, as on a loaded
    2-core machine when the API server or the client is descheduled while the engine keeps generating; its
    ``/metrics`` carries the engine-clock histograms a vLLM server exports (decode took ENGINE_DECODE_S)."""

    finished = 0

    def metrics(self) -> str:
        n = self.finished
        lines = [f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {n}.0']
        for name, per_request in (
            ("request_decode_time_seconds", ENGINE_DECODE_S),
            ("request_prefill_time_seconds", 0.05),
            ("request_queue_time_seconds", 0.0),
            ("e2e_request_latency_seconds", 0.26),
            ("request_generation_tokens", len(ANSWER_TOKENS)),
        ):
            lines += [
                f'vllm:{name}_count{{engine="0",model_name="m"}} {n}.0',
                f'vllm:{name}_sum{{engine="0",model_name="m"}} {n * per_request}',
            ]
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(self.server.metrics().encode(), "text/plain")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = ANSWER_TOKENS[: req["max_tokens"]]
        time.sleep(STALL_S)
        events = [{"choices": [{"text": t, "finish_reason": None}]} for t in tokens]
        events.append({"choices": [], "usage": {"prompt_tokens": 22, "completion_tokens": len(tokens)}})
        self.server.finished += 1
        self._send(
            b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n", "text/event-stream"
        )


@pytest.fixture
def bursty_server():
    srv = _BurstyServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_bursty_delivery_cannot_inflate_the_decode_rate(bursty_server):
    """Every chunk of the answer arrives within a millisecond: a rate from the client's first-chunk time (what the
    demo printed as "MTP off 26431.8 tokens/s, 0.00x") explodes, the demo's engine-clock rate does not."""
    problems = common.load_problems(limit=3)
    prompts = [common.prompt_for(p, []) for p in problems]
    c = complete(bursty_server, "m", prompts[0], max_tokens=96, stop=["\n\n"])
    assert c.output_tokens == len(ANSWER_TOKENS) and c.latency_s >= STALL_S
    assert 1.0 / c.tpot_s > 1000  # the old per-request figure: (tokens - 1) / (latency - client TTFT)

    answers = ask_all(bursty_server, "m", problems, prompts, max_tokens=96)
    assert len(answers) == 3
    for a in answers:
        assert a.decode_s == pytest.approx(ENGINE_DECODE_S)
        assert a.decode_tok_s == pytest.approx((len(ANSWER_TOKENS) - 1) / ENGINE_DECODE_S)
        assert a.text == "".join(ANSWER_TOKENS) and a.acceptance_length is None
    row = summarize(answers)
    assert row.decode_tok_s == pytest.approx((len(ANSWER_TOKENS) - 1) / ENGINE_DECODE_S)
    assert_consistent_with_e2e(row.decode_tok_s, row.output_tokens, row.n, row.e2e_tok_s)


def assert_consistent_with_e2e(decode_tok_s: float, tokens: int, n: int, e2e_tok_s: float) -> None:
    """A run's decode rate (``tokens - n`` after the first of each of ``n`` answers) is within what its
    end-to-end rate (``tokens`` / total end-to-end time) implies.

    Lower bound: each answer's decode (first to last token) happens inside its end-to-end time, so
    decode tok/s >= (tokens - n) / total e2e. Upper bound: end to end adds one prefill of a <= 40-token prompt
    (one forward, no dearer than one of the answer's >= 4 decode steps) plus HTTP, so decode is at most a few
    times faster than end to end; 3x leaves room for a loaded machine and still fails a rate 100x off.
    """
    assert decode_tok_s >= 0.99 * e2e_tok_s * (tokens - n) / tokens, (decode_tok_s, e2e_tok_s, tokens, n)
    assert decode_tok_s <= 3.0 * e2e_tok_s, (decode_tok_s, e2e_tok_s)


def within_printed(value: float, lo: float, hi: float, step: float) -> bool:
    """``value``, printed to ``step`` (``0.1`` for ``:.1f``), lies in ``[lo, hi]`` up to that rounding."""
    return lo - step / 2 - 1e-9 <= value <= hi + step / 2 + 1e-9


def test_draws_are_seeded_distinct_and_cover_the_held_out_set():
    pool = common.load_problems()
    assert len(pool) >= 1000
    a, b = draw_problems(pool, 5, 1), draw_problems(pool, 5, 2)
    assert a == draw_problems(pool, 5, 1) and a != b
    assert len({p["question"] for p in a}) == 5 and all(p in pool for p in a)
    seen = {p["question"] for s in range(400) for p in draw_problems(pool, 5, s)}
    assert len(seen) > len(pool) // 2  # not a fixed few: the draws spread over the whole set


def test_demo_without_the_embedded_checkpoint_says_pass_model(monkeypatch, tmp_path, capsys):
    """An installed wheel carries no assets: the demo names the missing directory and the flag, serves nothing."""
    missing = tmp_path / "tiny-dsv4-mxfp4"
    monkeypatch.setattr(embedded, "MXFP4_CHECKPOINT_DIR", missing)
    assert main(["demo", "--log-dir", str(tmp_path / "logs")]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"dsv4-mtp demo: error: no checkpoint at {missing} (the embedded checkpoints ship with the "
        "repository, not the wheel): pass --model DIR\n"
    )
    assert out == "" and not (tmp_path / "logs").exists()


# --------------------------------------------------------------------------------------- the real demo
@pytest.mark.engine
def test_demo_end_to_end(tmp_path):
    n, seed = 2, 7
    r = procs.run(
        [DSV4_MTP, "demo", "--num-problems", str(n), "--seed", str(seed), "--log-dir", str(tmp_path)], timeout=1500
    )
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    # the shipped checkpoint, never a stand-in
    assert "the embedded tiny DeepSeek-V4, MXFP4 experts" in out
    assert f"  checkpoint: {MXFP4_CHECKPOINT_DIR}\n" in out
    # problems drawn at random from the held-out set, the draw named by its seed
    assert f"{n} held-out problems drawn with --seed {seed}," in out
    problems = draw_problems(common.load_problems(), n, seed)
    assert problems != common.load_problems(limit=n)
    # beside its own tally, what the model scored over the whole held-out set
    assert measured_line(0) in out and "held-out accuracy measured over all " in measured_line(0)
    # every problem asked, answered, and judged by its #### value against the reference
    verdicts = re.findall(
        r"^    -> (.+?): (RIGHT|WRONG) \(expected (\S+)\) \| acceptance length (\S+) \| (\d+) tokens", out, re.M
    )
    assert len(verdicts) == n, out
    for (got, verdict, want, al, _), p in zip(verdicts, problems):
        assert want == p["answer"].rsplit("#### ", 1)[1]
        assert verdict == ("RIGHT" if got == want else "WRONG")
        assert 1.0 <= float(al) <= 3.0
    for i, p in enumerate(problems, 1):
        assert f"[{i}] Q: {p['question']}" in out
    right = sum(v[1] == "RIGHT" for v in verdicts)
    assert f"   right: {right}/{n}" in out
    rows = {
        m[0]: m
        for m in re.findall(
            r"^   \| (MTP K=2|MTP off) \| (\d+)/(\d+) \| (\S+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
            out,
            re.M,
        )
    }
    assert set(rows) == {"MTP K=2", "MTP off"}, out
    for _label, (_, _right, n_, _al, tokens, decode, e2e_mean, e2e_tok_s) in rows.items():
        assert int(n_) == n and int(tokens) >= n
        # both rows on the same clocks and token counts, each within what its end-to-end times imply
        assert_consistent_with_e2e(float(decode), int(tokens), n, float(e2e_tok_s))
        # tok/s = tokens / (n * mean) exactly; the mean is printed to 0.01 s (an answer takes ~0.1 s here: 5 %)
        mean = float(e2e_mean)
        assert within_printed(
            float(e2e_tok_s), int(tokens) / (n * (mean + 0.005)), int(tokens) / (n * max(mean - 0.005, 1e-9)), 0.1
        ), (e2e_tok_s, tokens, n, mean)
    on, off = rows["MTP K=2"], rows["MTP off"]
    m = re.search(
        r"MTP K=2 vs MTP off: decode ([\d.]+) vs ([\d.]+) tokens/s \(([\d.]+)x\); end to end "
        r"([\d.]+) vs ([\d.]+) tokens/s \(([\d.]+)x, mean ([\d.]+) s -> ([\d.]+) s\)",
        out,
    )
    assert m, out
    d_on, d_off, d_x, e_on, e_off, e_x, mean_off, mean_on = map(float, m.groups())
    assert (d_on, d_off, e_on, e_off) == (float(on[5]), float(off[5]), float(on[7]), float(off[7]))
    assert (mean_on, mean_off) == (float(on[6]), float(off[6]))
    assert d_x == pytest.approx(d_on / d_off, abs=0.011) and e_x == pytest.approx(e_on / e_off, abs=0.011)
    # the same answers (so the same tokens): the end-to-end speedup is the ratio of the e2e column
    assert on[4] == off[4]
    slowest, fastest = (mean_off - 0.005) / (mean_on + 0.005), (mean_off + 0.005) / max(mean_on - 0.005, 1e-9)
    assert within_printed(e_x, slowest, fastest, 0.01), (e_x, mean_off, mean_on)
    # decode and end-to-end speedups tell the same story (end to end adds the same prefill to both)
    assert abs(math.log(d_x / e_x)) < math.log(2), (d_x, e_x)
    # greedy speculative decoding is lossless: the same answers with and without MTP
    assert f"answers identical with and without MTP: {n}/{n}" in out
    assert (tmp_path / "server-k2.log").is_file() and (tmp_path / "server-off.log").is_file()
