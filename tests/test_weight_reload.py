"""vLLM's in-place weight reload (``LLM.collective_rpc("reload_weights", ...)``, what RL trainers use to push new
weights into a running engine) on the plugin's model: bf16 on the float32 GEMM route (``cpu/linear.py``)
and on vLLM's own 16-bit CPU GEMM, float32, and a dummy-loaded engine with MTP on.

vLLM's reload processes each layer as soon as its tensors are in, before the model's ``load_weights`` ends. Once,
that processing emptied the shared expert's 16-bit weights before the MoE's joined expert pass was packed from them:
the reload failed half way, leaving a model of mixed weights behind (where vLLM's dispatch packs 16-bit weights,
AVX512-BF16 / AMX CPUs, the same; a float32 model's reload failed at ``wo_b``). The model's linears now keep their
loaded weights, and the one post-load stage, ``cpu.linear.prepare_weights``, runs again at the end of
``load_weights``.
"""

from __future__ import annotations

import pytest
from engines import drafter, target, vllm_engine

pytestmark = pytest.mark.engine

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 17, 33]}, {"prompt_token_ids": [2, 7, 100, 3, 250, 41, 8]}]
ENGINE = dict(
    dtype="bfloat16",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=4,
    skip_tokenizer_init=True,
    seed=0,
    env={"VLLM_MLA_DISABLE": "1"},
)


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))]


@pytest.fixture
def a_and_b(tmp_path):
    """Two tiny checkpoints of the same shapes, different weights."""
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    return (
        build_tiny_checkpoint(tmp_path / "a", seed=0, tokenizer=False),
        build_tiny_checkpoint(tmp_path / "b", seed=1, tokenizer=False),
    )


def _reload(a, b, run, *, inspect=lambda llm: None, first=None, from_tensors=False, **engine):
    """``(fresh, before, after, seen)``: ``run(llm)`` on a fresh engine on ``b``, then on an engine on ``a`` (with
    ``first``'s extra arguments) before and after its in-place reload with ``b`` (its path, or, ``from_tensors``,
    its tensors, as RL trainers push them); ``seen = inspect(llm)`` after. ``before`` is None for a dummy load."""
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    first = first or {}
    with vllm_engine(b, in_process=True, **engine) as llm:
        fresh = run(llm)
    with vllm_engine(a, in_process=True, **first, **engine) as llm:
        # a dummy load has random hash-routing tables: no forward before the reload
        before = None if first.get("load_format") == "dummy" else run(llm)
        if from_tensors:
            tensors = CheckpointReader(b)
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": [(n, tensors.get(n)) for n in tensors.names()]}
            )
        else:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
        return fresh, before, run(llm), inspect(llm)


@pytest.mark.parametrize("route", [True, False], ids=["float32-route", "vllm-16bit-gemm"])
def test_in_place_reload_of_a_bf16_model_serves_exactly_the_new_weights(a_and_b, monkeypatch, route):
    """An engine started on checkpoint A and reloaded in place with checkpoint B generates what a fresh engine
    on B generates, token for token, the joined shared expert keeping B's loaded weight beside what its GEMM
    reads: on the float32 route (forced on any CPU), its float32 copy of B; off it (forced: vLLM's own CPU GEMM
    dispatch, which on AVX512-BF16 / AMX CPUs packs a copy of bf16 weights for oneDNN / sgl-kernel), vLLM's GEMM
    and no float32 copy."""
    import torch

    from vllm_dsv4_mtp.cpu.kit import KIT
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    monkeypatch.setattr(KIT, "native_gemm", lambda d: not route)

    def shared_gate_up(llm):
        layer = target(llm).model.layers[1].ffn.shared_experts.gate_up_proj
        return layer.weight.clone(), getattr(layer, "float32_weight", None)

    fresh_b, before, after, (weight, wide) = _reload(*a_and_b, _greedy, inspect=shared_gate_up, **ENGINE)
    b = CheckpointReader(a_and_b[1])
    want = torch.cat([b.get(f"layers.1.ffn.shared_experts.{s}.weight") for s in ("w1", "w3")])
    assert torch.equal(weight, want)
    if route:
        assert torch.equal(wide, want.float())
    else:
        assert wide is None
    assert before != fresh_b  # the two checkpoints differ where it shows
    assert after == fresh_b


def test_in_place_reload_of_a_float32_model_serves_exactly_the_new_weights(a_and_b):
    """A float32 model keeps ``wo_b`` and the shared expert's ``down_proj`` (sums TP splits) in float64, made from
    the loaded weights when the model packs; vLLM's float32 CPU dispatch would pack the weights of its linears
    away, and its reload processes a layer before the model packs. The model's linears keep their loaded weight
    (``cpu.linear.prepared_linear``), so the reload serves B exactly: the same tokens and prompt log-probs as
    a fresh engine on B (float32: bit for bit). Before, the reload failed at ``wo_b``."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)

    def run(llm):
        outs = llm.generate(PROMPTS, sp)
        return (
            [list(o.outputs[0].token_ids) for o in outs],
            [[{t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs[1:]] for o in outs],
        )

    fresh_b, before, after, _ = _reload(*a_and_b, run, **{**ENGINE, "dtype": "float32"})
    assert before[0] != fresh_b[0]
    assert after == fresh_b


def test_reload_of_a_dummy_loaded_mtp_engine_serves_the_new_target_and_warns_about_the_draft(a_and_b):
    """The RL trainers' pattern: an engine started with ``load_format="dummy"`` and MTP K=2, then handed the
    trained tensors by ``reload_weights(weights_iterator=...)``. vLLM's reload reaches the target model only
    (``gpu_model_runner.reload_weights``: ``get_model()``, in 0.32 and 0.33), so the draft keeps its random MTP
    layer while its embedding and LM head, the target's tensors, are B's. Its drafts are verified by B: the
    engine generates exactly what a plain engine on B generates (float32), and the target's load warns once
    that the draft was not reloaded."""
    import logging

    import torch

    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logging.getLogger("vllm.dsv4_mtp.model").addHandler(records)  # the target's logger, in this process
    try:
        fresh_b, _, after, hc_head = _reload(
            *a_and_b,
            _greedy,
            inspect=lambda llm: drafter(llm).model.layer(0).hc_head.fn.detach().clone(),
            first={"load_format": "dummy", "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
            from_tensors=True,
            **{**ENGINE, "dtype": "float32"},
        )
    finally:
        logging.getLogger("vllm.dsv4_mtp.model").removeHandler(records)
    assert after == fresh_b
    assert sum("the MTP draft keeps the MTP layer it started with" in m for m in records.messages) == 1
    # what docs/usage.md and the warning say: the draft's own weights change only with a new engine
    assert not torch.equal(hc_head, CheckpointReader(a_and_b[1]).get("mtp.0.hc_head_fn"))
