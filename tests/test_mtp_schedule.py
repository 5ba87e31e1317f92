"""vLLM's K-per-batch-size schedule with the plugin's draft: a K = 0 step writes the draft's attention cache only.

Three in-process engines on the embedded model in float32 (so that greedy outputs can be compared token for
token): MTP off, static K = 2, and K = 2 up to 2 requests with K = 0 above (``[[1, 2, 2], [3, 64, 0]]``). Twelve
held-out problems with different ``max_tokens``, at most 4 running at once: the batch grows as queued requests
join and shrinks as they finish, so steps cross the threshold both ways in the middle of generations.

* lossless: the schedule's outputs equal MTP off's (and static K = 2's);
* at a K = 0 step the draft computes no MoE, no ``hc_head`` and no logits (module calls counted), and the rows it
  writes equal, bit for bit, those the whole layer writes for the same step (the static engine's first step);
* the draft's cache stays in sync: acceptance per position after K = 0 steps is that of the same schedule with
  the whole layer run at K = 0 (vLLM's own behaviour), count for count.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from engines import drafter, vllm_engine

from vllm_dsv4_mtp.draft_schedule import CACHE_ONLY_ENV

pytestmark = pytest.mark.engine

SCHEDULE = [[1, 2, 2], [3, 64, 0]]
N_PROMPTS = 12


def _prompts():
    from vllm_dsv4_mtp.evaluate.common import load_problems, prompt_for

    return [prompt_for(p, []) for p in load_problems(limit=N_PROMPTS)]


def _params():
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=12 + (7 * i) % 36, temperature=0.0, ignore_eos=True) for i in range(N_PROMPTS)]


class DraftLog:
    """Per draft forward: the step's request count, whether it wrote the cache only, and the MoE / ``hc_head`` /
    logits calls made from it until the next forward; the rows written by the first forward."""

    def __init__(self, llm):
        self.draft = drafter(llm)
        layer = self.draft.model.layer(0)
        self.attn = layer.mtp_block.attn
        self.forwards: list[dict] = []
        self.first_rows: torch.Tensor | None = None
        self.handles = [
            self.draft.register_forward_pre_hook(self._start),
            self.draft.register_forward_hook(self._end),
            layer.mtp_block.ffn.register_forward_hook(self._count("moe")),
            layer.hc_head.register_forward_hook(self._count("hc_head")),
        ]
        self._logits = self.draft.compute_logits
        self.draft.compute_logits = self._compute_logits  # an instance attribute, removed by close()

    def _start(self, module, args):
        self.forwards.append({"moe": 0, "hc_head": 0, "logits": 0})

    def _end(self, module, args, out):
        md = self.draft.model.step_metadata()
        self.forwards[-1].update(reqs=md.num_reqs, cache_only=module.step_k.last_cache_only is not None)
        if self.first_rows is None:
            self.first_rows = self.attn.sparse_attn.rows.gather(md.write_slots, 0, self.attn.head_dim).clone()

    def _count(self, what):
        def hook(module, args, out):
            self.forwards[-1][what] += 1

        return hook

    def _compute_logits(self, *args, **kwargs):
        self.forwards[-1]["logits"] += 1
        return self._logits(*args, **kwargs)

    def close(self):
        for h in self.handles:
            h.remove()
        del self.draft.compute_logits


@pytest.fixture(scope="module")
def runs(embedded_mxfp4):
    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    out = {}
    scheduled = {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": SCHEDULE}
    for name, spec in (
        ("off", None),
        ("static", {"method": "mtp", "num_speculative_tokens": 2}),
        ("schedule", scheduled),
        ("schedule-whole", scheduled),
    ):
        # what vLLM runs without the plugin's K = 0 path: the whole layer (the product's own switch)
        whole = {CACHE_ONLY_ENV: "0"} if name == "schedule-whole" else {}
        with (
            mock.patch.dict(os.environ, whole),
            vllm_engine(
                embedded_mxfp4,
                dtype="float32",
                enforce_eager=True,
                max_model_len=512,
                max_num_seqs=4,
                seed=0,
                speculative_config=spec,
                disable_log_stats=False,
            ) as llm,
        ):
            log = DraftLog(llm) if spec else None
            assert spec is None or (drafter(llm).step_k.lookup is None) == (name != "schedule")
            outs = llm.generate(_prompts(), _params(), use_tqdm=False)
            if log:
                log.close()
            out[name] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "spec": spec_decode_from_llm(llm.get_metrics()),
                "log": log,
            }
    return out


def test_the_schedule_is_lossless_while_the_batch_crosses_its_threshold(runs):
    off = runs["off"]["tokens"]
    assert [len(t) for t in off] == [p.max_tokens for p in _params()]
    for name in ("static", "schedule"):
        for i, (a, b) in enumerate(zip(runs[name]["tokens"], off)):
            assert a == b, (name, i, next(j for j in range(len(a)) if a[j] != b[j]))
    fw = runs["schedule"]["log"].forwards
    k0 = [f for f in fw if f["cache_only"]]
    assert k0 and len(k0) < len(fw), "the run must have steps on both sides of the threshold"
    assert all(f["reqs"] >= 3 for f in k0) and all(f["reqs"] <= 2 for f in fw if not f["cache_only"])
    # the batch went down through the threshold and back up (a queued request joined after a K = 2 step)
    regimes = [f["cache_only"] for f in fw]
    assert any(a and not b for a, b in zip(regimes, regimes[1:])), regimes


def test_a_k0_step_writes_the_cache_and_computes_nothing_else(runs):
    log = runs["schedule"]["log"]
    for f in log.forwards:
        if f["cache_only"]:
            assert (f["moe"], f["hc_head"], f["logits"]) == (0, 0, 0), f
    assert any(f["logits"] for f in log.forwards if not f["cache_only"])
    # the first step prefills 4 prompts: K = 0 under the schedule, the whole layer under static K; same rows
    static = runs["static"]["log"]
    assert log.forwards[0]["cache_only"] and not static.forwards[0]["cache_only"]
    assert torch.equal(log.first_rows, static.first_rows)
    assert log.first_rows.abs().sum() > 0


def test_acceptance_after_k0_steps_is_that_of_the_whole_layer_at_k0(runs):
    """Drafts made after K = 0 steps read the cache rows those steps wrote: with the whole layer run at K = 0 (what
    vLLM does without the plugin's K = 0 path) every draft and so every acceptance count is the same (float32);
    rows missing or wrong would change them. Static K = 2 is printed beside it (its drafts are made at every
    batch size, so it is no like-for-like bar)."""
    sched, whole, static = (runs[n]["spec"] for n in ("schedule", "schedule-whole", "static"))
    assert sched.num_drafts > 0 and any(f["cache_only"] for f in runs["schedule"]["log"].forwards)
    assert not any(f["cache_only"] for f in runs["schedule-whole"]["log"].forwards)
    assert (sched.num_drafts, sched.accepted_per_position) == (whole.num_drafts, whole.accepted_per_position)
    for p in (0, 1):
        rates = [m.accepted_per_position[p] / m.num_drafts for m in (sched, static)]
        print(f"position {p}: acceptance {rates[0]:.3f} with the schedule, {rates[1]:.3f} at static K=2")
