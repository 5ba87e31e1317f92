"""vLLM's REAL in-tree AMD MTP draft's forward and compute_logits on CPU against the float32 reference MTP.

For vLLM 0.32, 0.33 and 0.34 (one subprocess each: tests/in_tree_real_worker.py, tests/in_tree_forward.py) the
plugin's ``DeepSeekV4MTPModel`` is built from real engine args with MTP on, loaded by the plugin's loader, set up
by vLLM's ``process_weights_after_loading``, and runs one prompt catch-up step (48 tokens, window 16) through
vLLM's modules; only ROCm-only kernels are stood in (tests/rocm_standins.py): the two Triton RMSNorms and the
attention core (projections + paged KV cache + sparse MLA), replaced as a whole by the spec's sliding-window
attention with the sink reading the module's loaded weights. Everything else is vLLM's: e_proj / h_proj, the mHC
pre/post ops, the norms, the DeepSeek-V4 MoE (bias router, unquantized fused experts, shared-expert MLP with its
SwiGLU clamp), the hc_head op and the logits processor.

The checkpoint: BF16, the MTP shared expert's ``w1`` / ``w3`` scaled x8 so its SwiGLU clamp binds (checked:
its gate pre-activations exceed ``swiglu_limit``), the routed experts' ``w2`` x8 so their output weighs more;
attention, routed and shared experts each contribute (checked: zeroing any one of them fails the comparison).
The routed experts are kept below the limit (checked) because vLLM's CPU fused-MoE kernel ignores
``swiglu_limit`` (found by this harness: with the clamp binding there, the real MoE matches the reference only
with the reference's routed clamp removed); on MI355 AITER's kernel runs them, which CPU cannot check.

Tolerance: relative L2 error of the logits and of the returned pre-hc_head state <= :data:`REL_TOL` (2.5 %), and
the argmax on >= 90 % of positions; BF16 weights and activations through one block (with bf16 router scores picking
among near-tied experts) come to about half of that. Each deliberate error is a case that must FAIL it by more
than 3x the tolerance; they measure (logits): the routed experts zeroed ~9 %, the reference without the shared
clamp ~31 %, the attention output zeroed ~49 %, a transposed shared-expert weight ~140 %, e_proj / h_proj
swapped ~140 %.

The fused shared expert is never on in the plugin's draft (tests/test_in_tree_mtp_real.py), so there is no
fused forward to compare; with AITER's MoE switched on the unquantized experts run AITER kernels, which CPU has not.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_in_tree_mtp_real import VERSIONS, rank0_results, run_worker

pytestmark = pytest.mark.engine

REL_TOL = 0.025
ARGMAX_MIN = 0.9
SHARED_SCALE = 8.0
ROUTED_OUT_SCALE = 8.0
MUTATIONS = ["transpose-shared", "swap-e-h", "no-clamp", "zero-attn", "zero-routed"]
#: n_routed_experts / top-k that vLLM's CPU router kernel (biased_topk_cpu) accepts; moe_intermediate_size =
#: hidden_size makes the shared expert's down projection square (the transposition error); window 16 < 48 tokens
FORWARD_DIMS = dict(moe_intermediate_size=128, n_routed_experts=64, num_experts_per_tok=8, sliding_window=16)


@pytest.fixture(scope="session")
def forward_checkpoint(tmp_path_factory):
    from vllm_dsv4_mtp.testing.mtp_checkpoints import rewrite_tensors
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("forward") / "bf16", tiny_config(**FORWARD_DIMS), seed=7)
    # the shared expert's pre-activations past the clamp; the routed experts' output (not their pre-activations)
    # as large, so that both contribute
    shared = re.compile(r"mtp\.0\.ffn\.shared_experts\.w[13]\.weight")
    routed = re.compile(r"mtp\.0\.ffn\.experts\.\d+\.w2\.weight")

    def scale(name, t):
        f = SHARED_SCALE if shared.fullmatch(name) else ROUTED_OUT_SCALE if routed.fullmatch(name) else None
        return None if f is None else (t.float() * f).to(t.dtype)

    rewrite_tensors(ckpt, scale)
    return ckpt


@pytest.fixture(scope="module", params=VERSIONS)
def forward(request, forward_checkpoint, tmp_path_factory):
    version = request.param
    out = tmp_path_factory.mktemp(f"forward-{version}")
    cases = [dict(name="base", ckpt=str(forward_checkpoint), tp=1, load=True, forward=True)]
    cases += [dict(name=m, ckpt=str(forward_checkpoint), tp=1, load=True, forward=True, mutation=m) for m in MUTATIONS]
    run_worker(version, out, cases)
    return version, out, rank0_results(out, cases, "forward")


def agrees(f: dict) -> bool:
    return f["rel"] <= REL_TOL and f["state_rel"] <= REL_TOL and f["argmax_agree"] >= ARGMAX_MIN


def test_the_real_forward_equals_the_reference(forward):
    version, out, results = forward
    f = results["base"]
    assert agrees(f), (version, f)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_deliberate_error_fails_the_comparison(forward, mutation):
    version, out, results = forward
    f = results[mutation]
    assert not agrees(f), (version, mutation, f)
    assert f["rel"] > 3 * REL_TOL, (version, mutation, f)  # caught by a margin, not at the edge


def test_the_shared_clamp_binds_and_the_routed_experts_stay_below_it(forward, forward_checkpoint):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    version, out, results = forward
    reader = CheckpointReader(forward_checkpoint)
    limit = reader.config["swiglu_limit"]
    x = torch.load(out / "base-fwd0.pt")["ffn_in"]  # the MoE's input in the real forward (after ffn_norm)
    shared = torch.cat([x @ reader.get(f"mtp.0.ffn.shared_experts.{w}.weight").float().T for w in ("w1", "w3")], -1)
    assert shared.max() > limit  # the gate's upper clamp (and the up projection's) act
    n = reader.config["n_routed_experts"]
    routed = max(
        float((x @ reader.get(f"mtp.0.ffn.experts.{e}.{w}.weight").float().T).abs().max())
        for e in range(n)
        for w in ("w1", "w3")
    )
    assert routed < limit
