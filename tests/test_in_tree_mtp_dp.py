"""The MI355 draft under data parallelism and expert parallelism, through vLLM's REAL in-tree AMD MTP class (issue 49).

vLLM runs one engine per DP rank; with ``--enable-expert-parallel`` the routed experts are split over every rank of
every engine (``EP = DP x TP``), while attention and the dense weights are whole in each. The harness
(tests/in_tree_real_worker.py) forks DP x TP ranks. Each rank builds its config as vLLM's engine-core process does
(the DP rank, its local rank and index set on the engine's config) and starts vLLM's distributed state with vLLM's
own ``init_distributed_environment``, which widens the world from TP to DP x TP and builds the DP and EP groups.
The rank then builds the plugin's ``DeepSeekV4MTPModel`` on that release's real ``DeepSeekV4MTP`` and loads it,
for vLLM 0.32, 0.33 and 0.34. Checked:

* every rank's parameters equal an independent exact decode of the checkpoint: attention, shared expert and norms
  whole, the routed experts this rank's EP slice (linear placement, as vLLM's loader's EP weight filter computes it);
  with the filter (each rank sees only its experts' tensors) and without (each rank sees all, loads its own);
* the fused shared expert stays off under EP, the MI355 profiles' switch set;
* ``dsv4-mtp serve --profile mi355x-pro-tp8 --data-parallel-size 2 --dry-run`` (the image's command with that flag)
  prints a command that builds and loads the draft on TP8 x DP2 ranks, where the same command with the profile's
  fused-shared-expert switch kept (what it printed before ``serve`` dropped it under DP) gets vLLM's refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_in_tree_mtp_real import (  # noqa: F401  (checkpoints: a fixture)
    FSE_ON,
    VERSIONS,
    _ok,
    checkpoints,
    decoded_mtp,
    expected_rank,
    profile_dry_run,
    run_worker,
    unpadded,
)

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.evaluate.server import free_port

pytestmark = pytest.mark.engine

FSE = "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"
#: vLLM's refusal (vllm/models/deepseek_v4/amd/model.py, ``_fuse_shared_experts_enabled``; vllm#57919)
FSE_UNDER_DP = "fused shared experts (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1) are not supported"


def dp_cases(version: str, checkpoints: dict[str, Path], out: Path) -> list[dict]:  # noqa: F811
    ep = {"data_parallel_size": 2, "enable_expert_parallel": True}
    port = free_port()
    cases = [
        dict(
            name=f"dp2-ep-{layout}-filter{int(weight_filter)}",
            ckpt=str(checkpoints[layout]),
            tp=1,
            dp=2,
            dp_port=port,
            load=True,
            ep_filter=weight_filter,
            env=FSE_ON,  # asked for, as the TP8 profile asks: vLLM turns it off under EP
            engine={**ep, "enable_ep_weight_filter": weight_filter},
        )
        for layout, weight_filter in (("amd", True), ("official", False), ("amd-mtp-original", True))
    ]
    printed, env, argv = profile_dry_run(version, "mi355x-pro-tp8", out, "--data-parallel-size", "2")
    (out / "dry-run-dp2.txt").write_text(printed)
    port = free_port()
    profile = dict(ckpt=str(checkpoints["amd-tp8"]), tp=8, dp=2, dp_port=port, cli=argv)
    cases.append(dict(profile, name="profile-pro-tp8-dp2", load=True, env=env))
    # the fix reverted: the profile's switch kept under DP, as the command carried it before `serve` dropped it
    cases.append(dict(profile, name="profile-pro-tp8-dp2-fse-kept", env={**env, FSE: "1"}))
    return cases


@pytest.fixture(scope="module", params=VERSIONS)
def real_dp(request, checkpoints, tmp_path_factory):  # noqa: F811
    version = request.param
    out = tmp_path_factory.mktemp(f"dp-{version}")
    cases = dp_cases(version, checkpoints, out)
    run_worker(version, out, cases)
    results = {
        (c["name"], r): json.loads((out / f"{c['name']}-rank{r}.json").read_text())
        for c in cases
        for r in range(c["tp"] * c["dp"])
    }
    return version, out, cases, results


@pytest.mark.parametrize("layout", ["amd", "official", "amd-mtp-original"])
def test_each_dp_rank_holds_the_exact_decode_and_its_expert_slice(real_dp, checkpoints, layout):  # noqa: F811
    version, out, cases, results = real_dp
    (case,) = [c for c in cases if c["name"].startswith(f"dp2-ep-{layout}-filter")]
    ranks = _ok(results, case["name"], 2)
    native = decoded_mtp(checkpoints[layout])
    spec = DeepseekV4Spec.from_dir(checkpoints[layout])
    whole = expected_rank(native, spec, 0, 1)  # TP 1 in each engine: everything but the routed experts whole
    shared = {"model.embed_tokens.weight", f"model.layers.{spec.num_hidden_layers}.shared_head.head.weight"}
    n_local = spec.n_routed_experts // 2
    for r, res in enumerate(ranks):
        assert res["fused_shared_expert"] is False, (version, case["name"], r)
        got = torch.load(out / f"{case['name']}-rank{r}.pt")
        assert set(got) - shared == set(whole), (version, case["name"], (set(got) - shared) ^ set(whole))
        mine = range(r * n_local, (r + 1) * n_local)  # vLLM's linear placement over EP = DP x TP = 2 ranks
        for name, w in whole.items():
            if "routed_experts" in name:
                w = w[r * n_local : (r + 1) * n_local]
            g = unpadded(name, got[name], w)
            assert g.shape == w.shape and torch.equal(g, w.to(g.dtype)), (version, case["name"], r, name)
        experts = f"model.layers.{spec.num_hidden_layers}.mtp_block.ffn.experts.routed_experts.w2_weight"
        assert all(torch.equal(got[experts][i], native[f"mtp.0.ffn.experts.{e}.w2.weight"]) for i, e in enumerate(mine))


def test_the_tp8_profile_with_data_parallelism_builds_and_keeping_its_switch_is_refused(real_dp):
    """The must-show: the dry run of the TP8 profile with ``--data-parallel-size 2`` says it dropped the fused
    shared expert; its command's flags and environment, parsed by this release's own ``EngineArgs``, build and load
    the draft on all 16 ranks (DP 2 x TP 8) with the fused shared expert off; the same command with the switch kept
    reaches vLLM's refusal, on every rank."""
    version, out, cases, results = real_dp
    ranks = _ok(results, "profile-pro-tp8-dp2", 16)
    printed = (out / "dry-run-dp2.txt").read_text()
    assert f"# note: {FSE}=1 dropped from profile mi355x-pro-tp8: --data-parallel-size 2" in printed
    assert f"{FSE}=" not in printed.split("# note:")[-1]  # the command carries no switch
    assert all(r["fused_shared_expert"] is False for r in ranks)
    assert ranks[0]["target"]["tensor_parallel_size"] == 8 and ranks[0]["target"]["k"] == 2
    for r in range(16):
        error = results[("profile-pro-tp8-dp2-fse-kept", r)]["error"]
        assert error is not None and FSE_UNDER_DP in error and "data parallelism" in error, (version, r, error)
