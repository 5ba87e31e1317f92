"""`dsv4-mtp bench`: a small concurrency sweep against a real vLLM server on the embedded tiny DeepSeek-V4 (MXFP4, MTP
K=2, one server for the module) producing the markdown table, the PNG plot and the JSON; and the report arithmetic
(speedups, step costs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest

from vllm_dsv4_mtp.evaluate.bench import BenchRun, LevelResult, build_report, markdown, percentile, write_outputs

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")


def _level(c, e2e, tpot, toks, al=None, pos=None):
    return LevelResult(
        concurrency=c,
        requests=8,
        failed=0,
        duration_s=1.0,
        output_tokens=toks,
        mean_prompt_tokens=50,
        output_tok_s=float(toks),
        requests_per_s=8.0,
        e2e_mean_ms=e2e,
        e2e_p50_ms=e2e,
        e2e_p90_ms=e2e,
        ttft_mean_ms=10.0,
        tpot_mean_ms=tpot,
        tpot_p50_ms=tpot,
        tpot_p90_ms=tpot,
        acceptance_length=al,
        per_position_acceptance=pos,
    )


def test_percentile_interpolates():
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)


def test_report_speedup_step_costs_table_and_plot(tmp_path):
    off = BenchRun("MTP off", "http://127.0.0.1:1", None, [_level(1, 1000.0, 20.0, 400), _level(2, 1200.0, 24.0, 640)])
    on = BenchRun(
        "MTP K=2",
        "http://127.0.0.1:2",
        2,
        [_level(1, 500.0, 10.0, 800, 2.5, [0.9, 0.6]), _level(2, 800.0, 16.0, 960, 2.4, [0.9, 0.5])],
    )
    rep = build_report([off, on], argv=["--serve"], model="/m/tiny", max_tokens=64, num_fewshot=2)
    assert rep["speedup"] == [
        {"concurrency": 1, "e2e": 2.0, "tpot": 2.0, "throughput": 2.0},
        {"concurrency": 2, "e2e": 1.5, "tpot": 1.5, "throughput": 1.5},
    ]
    # one step without MTP = TPOT (20 ms, 1 token); with MTP = TPOT x acceptance length (10 x 2.5 = 25 ms)
    assert rep["step_costs"] == {
        "target_step_ms": 20.0,
        "mtp_step_ms": 25.0,
        "mtp_step_over_target_step": 1.25,
        "acceptance_length": 2.5,
        "predicted_tpot_speedup": 2.0,
    }
    md = markdown(rep)
    assert "| 1 | 8 | 1000.0 | 500.0 | 2.00 | 20.0 | 10.0 | 400.0 | 800.0 | 2.500 | 0.90 / 0.60 |" in md
    assert "| Max conc | requests | no MTP e2e (ms) | MTP K=2 e2e (ms) | Speedup |" in md
    paths = write_outputs(rep, tmp_path)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text())["speedup"][1]["e2e"] == 1.5


def test_bench_refuses_a_non_loopback_server(tmp_path):
    r = subprocess.run(
        [DSV4_MTP, "bench", "--base-url", "http://10.1.2.3:8000", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "request loops to 127.0.0.1 / localhost only (host '10.1.2.3' is not a loopback address)" in r.stderr


def test_bench_serve_without_the_embedded_checkpoint_says_pass_model(monkeypatch, tmp_path, capsys):
    """No stand-in model when the shipped MXFP4 checkpoint is absent (an installed wheel): one error, no server."""
    from vllm_dsv4_mtp import embedded
    from vllm_dsv4_mtp.cli import main

    missing = tmp_path / "tiny-dsv4-mxfp4"
    monkeypatch.setattr(embedded, "MXFP4_CHECKPOINT_DIR", missing)
    assert main(["bench", "--serve", "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"dsv4-mtp bench: error: no checkpoint at {missing} (the embedded checkpoints ship with the "
        "repository, not the wheel): pass --model DIR\n"
    )
    assert out == "" and not (tmp_path / "out").exists()


K = 2


@pytest.fixture(scope="module")
def server(start_server, embedded_mxfp4):
    return start_server(embedded_mxfp4, mtp_k=K)


@pytest.mark.engine
def test_bench_sweep_against_server(server, tmp_path):
    out = tmp_path / "bench"
    r = procs.run(
        [
            DSV4_MTP,
            "bench",
            "--base-url",
            server.base_url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "3",
            "--max-tokens",
            "12",
            "--out",
            str(out),
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())
    assert rep["machine"]["cores"] >= 1 and rep["max_tokens"] == 12 and rep["temperature"] == 0.0
    (run,) = rep["runs"]
    assert run["mtp_k"] == K
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    for lv in run["levels"]:
        assert lv["requests"] == 3 and lv["failed"] == 0
        assert lv["output_tokens"] == 3 * 12  # ignore_eos: exactly max_tokens each
        assert lv["mean_prompt_tokens"] > 20  # 2-shot held-out prompts
        assert 0 < lv["ttft_mean_ms"] <= lv["e2e_mean_ms"]
        assert lv["e2e_p50_ms"] <= lv["e2e_p90_ms"]
        assert 0 < lv["tpot_mean_ms"] < lv["e2e_mean_ms"]
        assert lv["output_tok_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"], rel=0.01)
        # from the /metrics deltas around this level only
        assert lv["drafts"] > 0 and 1.0 <= lv["acceptance_length"] <= 1.0 + K
        assert len(lv["per_position_acceptance"]) == K
        assert all(0.0 <= a <= 1.0 for a in lv["per_position_acceptance"])
    md = (out / "bench.md").read_text()
    assert md.count("\n| 1 | 3 | 0 |") == 1 and md.count("\n| 2 | 3 | 0 |") == 1
    assert md in r.stdout
    import matplotlib.image

    img = matplotlib.image.imread(out / "bench.png")
    assert img.shape[0] > 200 and img.shape[1] > 600


def test_stepcost_splits_each_decode_step_into_its_parts():
    from vllm_dsv4_mtp.evaluate.stepcost import explain, summarize

    # one request, MTP K=2: prefill at t=0, then two decode steps of 30 ms each (target 3 tokens, 2 draft calls)
    recs = [
        ("target", 40, 0.000, 0.010),
        ("draft", 40, 0.011, 0.013),
        ("target", 3, 0.020, 0.032),
        ("target_logits", 3, 0.032, 0.033),
        ("draft", 3, 0.035, 0.039),
        ("draft_logits", 1, 0.039, 0.040),
        ("draft", 1, 0.041, 0.043),
        ("draft_logits", 1, 0.043, 0.044),
        ("target", 3, 0.050, 0.062),
        ("target_logits", 3, 0.062, 0.063),
        ("draft", 3, 0.065, 0.069),
        ("draft_logits", 1, 0.069, 0.070),
        ("draft", 1, 0.071, 0.073),
        ("draft_logits", 1, 0.073, 0.080),
    ]
    on = summarize([recs], output_tokens=[6])
    assert on["decode_steps"] == 2 and on["step_ms"] == pytest.approx(30.0)
    assert on["tokens_per_step"] == pytest.approx(2.5)  # 6 tokens, the first from the prefill
    assert on["parts_ms"]["target"] == pytest.approx(12.0) and on["parts_ms"]["draft"] == pytest.approx(6.0)
    assert on["calls_per_step"]["draft"] == 2 and on["tokens_per_call"]["draft"] == pytest.approx(2.0)
    assert on["parts_ms"]["other"] == pytest.approx(30.0 - 12.0 - 1.0 - 6.0 - on["parts_ms"]["draft_logits"])
    off_recs = [
        ("target", 40, 0.0, 0.01),
        ("target", 1, 0.02, 0.028),
        ("target", 1, 0.03, 0.038),
        ("target", 1, 0.04, 0.048),
        ("target_logits", 1, 0.048, 0.049),
    ]
    off = summarize([off_recs], output_tokens=[4])
    assert off["decode_steps"] == 3 and off["step_ms"] == pytest.approx(29.0 / 3, abs=1e-3)
    ex = explain(off, dict(on, mtp_k=2))
    assert ex["predicted_speedup"] == pytest.approx(2.5 * off["step_ms"] / 30.0, abs=1e-3)


def test_stepcost_drops_the_slowest_steps_whole():
    from vllm_dsv4_mtp.evaluate.stepcost import summarize

    recs, t = [("target", 30, 0.0, 0.005)], 0.01
    for i in range(10):  # ten 10 ms decode steps (8 ms target), the 6th interrupted for 100 ms
        dur = 0.100 if i == 5 else 0.010
        recs.append(("target", 1, t, t + 0.008))
        t += dur
    recs.append(("target_logits", 1, t - 0.001, t))  # marks the end of the last step
    s = summarize([recs], output_tokens=[11])
    assert (s["decode_steps"], s["steps_kept"]) == (10, 9)
    assert s["step_ms"] == pytest.approx(10.0, abs=1e-3) and s["step_mean_all_ms"] == pytest.approx(19.0, abs=1e-3)
    assert s["parts_ms"]["target"] == pytest.approx(8.0, abs=1e-3)
    assert s["tokens_per_step"] == pytest.approx(1.0)


def test_forward_hooks_time_every_call_with_its_tokens_and_profile_range():
    """The hooks both step benchmarks install in vLLM's worker, on a plain torch model: each forward recorded once,
    innermost inside outermost, with its token count, and (while profiling) as a ``bench::`` profiler range."""
    import torch

    from vllm_dsv4_mtp.evaluate import forward_hooks as fh

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ffn = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.ffn(self.attn(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.attn = torch.nn.Linear(4, 4)  # not a decoder block's: outside `layers`

        def forward(self, positions, hidden_states):
            for layer in self.layers:
                hidden_states = layer(hidden_states)
            return hidden_states

    model = Model()
    blocks = list(fh.decoder_blocks(model))
    assert [(name, kind) for name, kind, _ in blocks] == [
        ("layers.0.attn", "attention"),
        ("layers.0.ffn", "moe"),
        ("layers.1.attn", "attention"),
        ("layers.1.ffn", "moe"),
    ]
    fh.time_forward(model, "forward")
    for _, kind, mod in blocks:
        fh.time_forward(mod, kind)
    fh.take_records(None)
    model(torch.arange(5), hidden_states=torch.zeros(5, 4))
    recs = fh.take_records(None)
    assert [(part, n) for part, n, _, _ in recs] == [
        ("attention", 5),
        ("moe", 5),
        ("attention", 5),
        ("moe", 5),
        ("forward", 5),
    ]
    (_, _, f0, f1) = recs[-1]
    assert all(f0 <= t0 <= t1 <= f1 for _, _, t0, t1 in recs[:-1])
    assert fh.take_records(None) == []

    fh.start_profile(None)
    model(torch.arange(3), torch.zeros(3, 4))
    prof = fh.finish_profile()
    names = [e.name for e in prof.events() if e.name.startswith("bench::")]
    assert sorted(names) == sorted(["bench::forward:3"] + ["bench::attention:3", "bench::moe:3"] * 2)
    assert fh.take_records(None) == []  # the profiled pass's records are dropped with the session
