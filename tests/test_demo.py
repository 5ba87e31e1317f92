"""`dsv4-mtp demo` end to end (what `make demo` runs): serve the embedded tiny model with MTP K=2 on CPU, answer
held-out problems, judge them, report acceptance length and tokens/s with and without MTP.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dsv4_mtp.evaluate import common

DSV4_MTP = str(Path(sys.executable).parent / "dsv4-mtp")


@pytest.mark.engine
def test_demo_end_to_end(tmp_path):
    n = 2
    r = subprocess.run([DSV4_MTP, "demo", "--num-problems", str(n), "--log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=1500)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    mtp = common.mtp_draft_registered()
    models = common.embedded_models()
    if "MXFP4" in models:
        assert "the embedded tiny DeepSeek-V4, MXFP4 experts" in out
    elif "BF16" in models:
        assert "WAITING: " in out and "is not built yet (training engineer" in out
    else:
        assert "serving a RANDOM tiny MXFP4 checkpoint" in out
    problems = common.load_problems(limit=n)
    # every problem asked, answered, and judged by its #### value against the reference
    verdicts = re.findall(r"^    -> (.+?): (RIGHT|WRONG) \(expected (\S+)\) \| acceptance length (\S+) \| (\d+) tokens",
                          out, re.M)
    assert len(verdicts) == n, out
    for (got, verdict, want, al, _), p in zip(verdicts, problems):
        assert want == p["answer"].rsplit("#### ", 1)[1]
        assert verdict == ("RIGHT" if got == want else "WRONG")
        if mtp:
            assert 1.0 <= float(al) <= 3.0
        else:
            assert al == "–"
    for i, p in enumerate(problems, 1):
        assert f"[{i}] Q: {p['question']}" in out
    right = sum(v[1] == "RIGHT" for v in verdicts)
    assert f"   right: {right}/{n}" in out
    if mtp:
        m = re.search(r"tokens/s with MTP K=2: ([\d.]+), without: ([\d.]+) \(([\d.]+)x\)", out)
        assert m, out
        assert float(m.group(1)) > 0 and float(m.group(2)) > 0
        # greedy speculative decoding is lossless: the same answers with and without MTP
        assert f"answers identical with and without MTP: {n}/{n}" in out
        assert (tmp_path / "server-k2.log").is_file() and (tmp_path / "server-off.log").is_file()
    else:
        assert "WAITING: the plugin registers no MTP draft yet" in out
