"""``dsv4-mtp tune``: the picking rules on given numbers, the refusals and commands without a server, and the tuner
end to end on a tiny sweep (real servers of the embedded model: MTP off, K=0 in a schedule, K=1, then the tuned
config) whose JSON, schedule, table and plot are checked against the measurements they came from.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path

import procs
import pytest
from vllm.v1.spec_decode.dynamic.utils import (
    build_dynamic_sd_schedule_lookup,
    validate_and_normalize_dynamic_sd_schedule,
)

from vllm_dsv4_mtp.cli import main
from vllm_dsv4_mtp.evaluate import tune_pick as tp
from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")
LEVELS = [1, 2, 4, 8, 16, 32, 64]


def _table(**per_config):
    return {name: dict(zip(LEVELS, values)) for name, values in per_config.items()}


def test_pick_takes_the_fastest_candidate_and_the_lower_k_on_a_tie():
    tok = _table(
        off=[70, 130, 230, 450, 730, 1000, 1300],
        k0=[60, 110, 160, 300, 460, 740, 1100],
        k1=[80, 140, 240, 420, 700, 900, 1000],
        k2=[90, 150, 242, 410, 600, 800, 900],
    )
    picks = tp.pick(tok, LEVELS, 2, tie=0.03)
    # 242 vs 240 at 4 is a tie (within 3 %): K=1; at 64, K=0 in a schedule (1100) beats every static K
    assert [p["k"] for p in picks] == [2, 2, 1, 1, 1, 1, 0]
    assert [p["beats_off"] for p in picks] == [True, True, True, False, False, False, False]
    assert [p["best_static_k"] for p in picks] == [2, 2, 2, 1, 1, 1, 1]
    # off is never a schedule entry: at 8-32 off wins but K=1 is the fastest a schedule can hold
    assert picks[4] == {
        "concurrency": 16,
        "k": 1,
        "tok_s": 700,
        "best_k": 1,
        "best_static_k": 1,
        "off_tok_s": 730,
        "beats_off": False,
    }


def test_levels_map_to_ranges_at_geometric_midpoints_vllm_accepts():
    ks = [3, 2, 2, 1, 1, 0, 0]
    schedule = tp.ranges(LEVELS, ks, max_num_seqs=64)
    # level i's K up to floor(sqrt(C_i x C_i+1)): 1, 2, 5, 11, 22, 45; equal neighbours merged
    assert schedule == [[1, 1, 3], [2, 5, 2], [6, 22, 1], [23, 64, 0]]
    assert validate_and_normalize_dynamic_sd_schedule(schedule) == [tuple(r) for r in schedule]
    lookup = build_dynamic_sd_schedule_lookup(schedule, 64, 3)
    assert [lookup[c] for c in LEVELS] == ks  # every measured level gets the K picked there
    assert tp.thresholds(schedule) == [2, 6, 23]
    assert tp.check_levels(schedule, 64) == [1, 2, 3, 5, 6, 7, 22, 23, 24]
    assert tp.ranges([1, 4], [1, 0], max_num_seqs=8) == [[1, 2, 1], [3, 8, 0]]
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        tp.ranges([1, 16], [1, 0], max_num_seqs=8)


def test_tuned_config_is_static_when_every_k_is_the_same():
    base = {"method": "mtp", "num_speculative_tokens": 2, SCHEDULE_KEY: [[1, 2, 2]]}
    assert tp.speculative_config(base, [[1, 64, 2]], SCHEDULE_KEY) == {"method": "mtp", "num_speculative_tokens": 2}
    assert tp.speculative_config(base, [[1, 4, 2], [5, 64, 0]], SCHEDULE_KEY) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        SCHEDULE_KEY: [[1, 4, 2], [5, 64, 0]],
    }
    # K=0 everywhere: still a config vLLM takes (num_speculative_tokens must be > 0), served but never recommended
    zero = tp.speculative_config(base, [[1, 64, 0]], SCHEDULE_KEY)
    assert zero["num_speculative_tokens"] == 1 and build_dynamic_sd_schedule_lookup(zero[SCHEDULE_KEY], 64, 1)[64] == 0


def test_the_all_k0_config_runs_k0_at_every_batch_size_under_at_least_one_draft_token():
    """One builder for the tuner's K=0 candidate (under its Kmax) and the concurrency benchmark's ``k0``."""
    base = {"method": "mtp", "num_speculative_tokens": 2, SCHEDULE_KEY: [[1, 2, 2]]}
    want = {"method": "mtp", "num_speculative_tokens": 3, SCHEDULE_KEY: [[1, 64, 0]]}
    assert tp.all_k0(base, 64, SCHEDULE_KEY, 3) == want
    k0 = tp.all_k0({"method": "mtp"}, 16, SCHEDULE_KEY)
    assert k0["num_speculative_tokens"] == 1 and build_dynamic_sd_schedule_lookup(k0[SCHEDULE_KEY], 16, 1)[16] == 0


def test_collapse_is_a_fall_below_a_smaller_concurrency():
    schedule = [[1, 2, 2], [3, 8, 0]]
    fine = tp.collapses({1: 80, 2: 140, 3: 170, 4: 230}, schedule, drop=0.10)
    assert fine == [
        {
            "threshold": 3,
            "levels": [
                {"concurrency": 2, "tok_s": 140, "floor": pytest.approx(72), "collapse": False},
                {"concurrency": 3, "tok_s": 170, "floor": pytest.approx(126), "collapse": False},
                {"concurrency": 4, "tok_s": 230, "floor": pytest.approx(153), "collapse": False},
            ],
            "collapse": False,
        }
    ]
    (bad,) = tp.collapses({1: 80, 2: 140, 3: 40, 4: 230}, schedule, drop=0.10)  # vllm#49548: 232 -> 24-157
    assert bad["collapse"] and [x["collapse"] for x in bad["levels"]] == [False, True, False]
    assert tp.collapses({1: 80}, None, 0.1) == []


def test_recommendation_off_tuned_or_static():
    load = [1, 2]
    base = {"k1": {1: 100, 2: 180}, "k2": {1: 105, 2: 170}}
    # nothing with a speculative config beats off: say so, recommend no config
    rec = tp.recommend(base | {"off": {1: 120, 2: 200}, "tuned": {1: 110, 2: 180}}, load, 2, 0.03, True)
    assert rec["choice"] == "off" and "no speculative config beats serving without one" in rec["reason"]
    assert "K=0 in a schedule is not MTP off" in rec["reason"]
    rec = tp.recommend(base | {"off": {1: 80, 2: 150}, "tuned": {1: 110, 2: 180}}, load, 2, 0.03, True)
    assert rec["choice"] == "tuned" and rec["scores"]["tuned"] == pytest.approx(math.sqrt(110 * 180), abs=0.1)
    # the schedule's own cost left it more than `tie` below static K=1
    rec = tp.recommend(base | {"off": {1: 80, 2: 150}, "tuned": {1: 95, 2: 160}}, load, 2, 0.03, True)
    assert rec["choice"] == "k1" and "static K=1 beats the tuned config" in rec["reason"]
    # a K=0-everywhere schedule is never the answer, even if it measured above off
    rec = tp.recommend(base | {"off": {1: 80, 2: 150}, "tuned": {1: 200, 2: 300}}, load, 2, 0.03, False)
    assert rec["choice"] == "k1"


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "--dry-run", "--", "--data-parallel-size", "2"],
        ["tune", "--dry-run", "--profile", "mi355x-pro-tp8", "--", "-dp", "2"],
        ["tune", "--dry-run", "--command", "vllm serve some/model --data-parallel-size=2"],
    ],
)
def test_data_parallelism_is_refused_with_why(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("dsv4-mtp tune: --data-parallel-size 2: vLLM drops num_speculative_tokens_per_batch_size")
    assert "vllm#45963" in err and "Tune with --data-parallel-size 1" in err


def test_dry_run_prints_one_server_per_candidate(capsys):
    argv = ["tune", "--dry-run", "--k-max", "2", "--concurrency", "1", "16", "--", "--dtype", "float32"]
    assert main([*argv, "--port", "8000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0::2] == ["# off", "# K=0 (schedule)", "# K=1", "# K=2"]
    configs = []
    for line in out[1::2]:
        argv = shlex.split(line)
        assert argv[1:5] == ["-m", "vllm_dsv4_mtp.serve.cli", "--profile", "cpu-tiny"]
        assert argv[argv.index("--max-num-seqs") + 1] == "16"  # the profile's 8 raised to the largest level
        assert "--dtype" in argv and argv[argv.index("--port") + 1] == "0" and argv.count("--port") == 1
        configs.append(json.loads(argv[len(argv) - 1 - argv[::-1].index("--speculative-config") + 1]))
    assert configs[0] is None
    assert configs[1] == {"method": "mtp", "num_speculative_tokens": 2, SCHEDULE_KEY: [[1, 16, 0]]}
    assert validate_and_normalize_dynamic_sd_schedule(configs[1][SCHEDULE_KEY]) == [(1, 16, 0)]
    assert configs[2:] == [{"method": "mtp", "num_speculative_tokens": k} for k in (1, 2)]


def test_a_plain_vllm_command_keeps_its_flags_and_method(capsys):
    cmd = (
        "VLLM_CPU_KVCACHE_SPACE=2 vllm serve /m/dsv4 --max-num-seqs 128 --enforce-eager --port 8000 "
        '--speculative-config \'{"method":"deepseek_mtp","num_speculative_tokens":2}\''
    )
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    assert main(["tune", "--dry-run", "--k-max", "1", "--command", cmd]) == 0
    # the command's environment goes to the servers it starts, not into this process (later tests inherit it)
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == before
    lines = capsys.readouterr().out.splitlines()
    argv = shlex.split(lines[5])
    assert argv[3:5] == ["--model", "/m/dsv4"] and "--enforce-eager" in argv
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "0"] and argv.count("--port") == 1
    assert argv[argv.index("--max-num-seqs") + 1] == "128"  # the command's, above the largest level
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "deepseek_mtp",
        "num_speculative_tokens": 1,
    }
    assert main(["tune", "--dry-run", "--command", "vllm serve", "--concurrency", "1"]) == 2
    assert "names no model" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    assert main(["tune", "--dry-run", "--load", "3", "--concurrency", "1", "4"]) == 2
    assert "--load [3]: every level must be one of --concurrency [1, 4]" in capsys.readouterr().err
    assert main(["tune", "--dry-run", "--k-max", "0"]) == 2
    assert "--k-max must be >= 1" in capsys.readouterr().err


@pytest.mark.engine
def test_tune_end_to_end_on_a_tiny_sweep(tmp_path):
    """Four servers of the embedded model (off, K=0 in a schedule, K=1, tuned), held-out prompts at 1 and 4."""
    out = tmp_path / "tune"
    argv = [DSV4_MTP, "tune", "--k-max", "1", "--concurrency", "1", "4", "--prompts", "held-out"]
    argv += ["--output-len", "16", "--prompts-per-level", "2", "--min-prompts", "4", "--warmup-prompts", "2"]
    r = procs.run([*argv, "--out", str(out)], timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_tiny_sweep(out, r.stdout)


def check_tiny_sweep(out: Path, stdout: str) -> None:
    """What the tiny sweep's outputs must say, checked against the measurements in its own JSON."""
    rep = json.loads((out / "tune.json").read_text())

    # every candidate measured at every level, every request completed with its full output
    tok = tp.tok_s_table(rep["rows"])
    assert set(tok) == {"off", "k0", "k1", "tuned"}
    for row in rep["rows"]:
        assert row["output_tok_s"] > 0 and row["completed"] == row["prompts"] == max(2 * row["concurrency"], 4)
        if row["config"] == "k1":  # K=1: one draft token a step, so between 1 and 2 tokens
            assert 1.0 <= row["acceptance_length"] <= 2.0
        if row["config"] in ("off", "k0"):  # no draft counted (K=0 steps propose none)
            assert row["acceptance_length"] is None

    # the picks follow the measured numbers: the lower K within --tie of the best of K=0 (schedule) and K=1
    for p in rep["picks"]:
        c = p["concurrency"]
        k0, k1 = tok["k0"][c], tok["k1"][c]
        assert p["k"] == (0 if k0 >= (1 - rep["tie"]) * max(k0, k1) else 1)
        assert p["off_tok_s"] == tok["off"][c] and p["beats_off"] == (p["tok_s"] > tok["off"][c])

    # the schedule: vLLM's own parser takes it, and its lookup gives each level the K picked there
    schedule = rep["schedule"]
    assert validate_and_normalize_dynamic_sd_schedule(schedule) == [tuple(x) for x in schedule]
    lookup = build_dynamic_sd_schedule_lookup(schedule, rep["max_num_seqs"], 1)
    assert [lookup[p["concurrency"]] for p in rep["picks"]] == [p["k"] for p in rep["picks"]]
    tuned = rep["tuned_config"]
    assert json.loads((out / "speculative-config.json").read_text()) == tuned
    if len({k for *_, k in schedule}) > 1:
        assert tuned[SCHEDULE_KEY] == schedule and rep["check_levels"] == [2, 3, 4]
        assert [t["threshold"] for t in rep["collapse"]] == [3]
    else:
        assert rep["check_levels"] == [] and rep["collapse"] == []
    # the tuned server measured at the sweep's levels and the threshold checks, compared with each choice
    assert sorted(tok["tuned"]) == sorted({1, 4} | set(rep["check_levels"]))
    for row in rep["comparison"]:
        c = row["concurrency"]
        if c in (1, 4):
            assert row["tuned/off"] == pytest.approx(tok["tuned"][c] / tok["off"][c], abs=1e-3)
            assert row["tuned/best_static"] == pytest.approx(tok["tuned"][c] / tok["k1"][c], abs=1e-3)

    # the recommendation is the best geometric mean (off wins ties with every speculative config)
    rec = rep["recommendation"]
    scores = {n: math.exp(sum(math.log(tok[n][c]) for c in (1, 4)) / 2) for n in ("off", "k1", "tuned")}
    assert rec["scores"] == {n: pytest.approx(v, abs=0.1) for n, v in scores.items()}
    if scores["off"] >= max(scores["k1"], scores["tuned"] if any(k for *_, k in schedule) else 0):
        assert rec["choice"] == "off" and rec["speculative_config"] is None
        assert rec["command"].endswith("--speculative-config null")
    else:
        assert rec["choice"] in ("tuned", "k1") and "--speculative-config" in rec["command"]

    md = (out / "tune.md").read_text()
    assert md in stdout
    for c in (1, 4):
        assert f"\n| {c} | {tok['off'][c]:.0f} | {tok['k0'][c]:.0f} | {tok['k1'][c]:.0f} |" in md
    import matplotlib.image

    img = matplotlib.image.imread(out / "tune.png")
    assert img.shape[0] > 200 and img.shape[1] > 600
