"""vLLM's in-place weight reload (``LLM.collective_rpc("reload_weights", ...)``, what RL trainers use to push new
weights into a running engine) on the plugin's model, on the float32 GEMM route (``model/cpu_linear.py``).

vLLM's reload processes each layer as soon as its tensors are in, so the route has already emptied the shared
expert's 16-bit weights when the model's ``load_weights`` packs the MoE's joined expert pass; that pack reads them
back from the float32 copy (``cpu_linear.loaded_weight``). Before, the reload failed half way with the MoE's
pack error, leaving a model of mixed weights behind. A float32 model's reload cannot work on vLLM's CPU
dispatch (second test) and is refused naming the layer.
"""

from __future__ import annotations

import pytest
from engines import target, vllm_engine

pytestmark = pytest.mark.engine

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 17, 33]}, {"prompt_token_ids": [2, 7, 100, 3, 250, 41, 8]}]
ENGINE = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=4, skip_tokenizer_init=True,
              seed=0, env={"VLLM_MLA_DISABLE": "1"})


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))]


def test_in_place_reload_on_the_float32_route_serves_exactly_the_new_weights(tmp_path, monkeypatch):
    """An engine started on checkpoint A and reloaded in place with checkpoint B generates what a fresh engine
    on B generates, token for token, with the route still taken (float32 copies of B's weights)."""
    import torch

    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.model import cpu_linear
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    monkeypatch.setattr(cpu_linear, "native_16bit_gemm", lambda d: False)  # the route on any CPU
    a = build_tiny_checkpoint(tmp_path / "a", seed=0, tokenizer=False)
    b = build_tiny_checkpoint(tmp_path / "b", seed=1, tokenizer=False)
    b_tensors = CheckpointReader(b)
    with vllm_engine(b, in_process=True, **ENGINE) as llm:
        fresh_b = _greedy(llm)
    with vllm_engine(a, in_process=True, **ENGINE) as llm:
        before = _greedy(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
        after = _greedy(llm)
        shared = target(llm).model.layers[1].ffn.shared_experts.gate_up_proj
        assert shared.weight.numel() == 0
        assert torch.equal(shared.float32_weight, torch.cat([b_tensors.get(f"layers.1.ffn.shared_experts.{s}.weight")
                                                             for s in ("w1", "w3")]).float())
    assert before != fresh_b  # the two checkpoints differ where it shows
    assert after == fresh_b


def test_in_place_reload_of_a_float32_model_is_refused_naming_the_layer(tmp_path):
    """A float32 model keeps ``wo_b`` and the shared expert's ``down_proj`` (sums TP splits) in float64, made from
    the loaded weights; vLLM's float32 CPU dispatch packs those weights away after loading, and its reload
    processes a layer before the model packs, so there is nothing to make them from: the reload fails naming
    the first such layer and what to do (before, ``wide_linear``'s error said neither)."""
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    a = build_tiny_checkpoint(tmp_path / "a", seed=0, tokenizer=False)
    with vllm_engine(a, in_process=True, **{**ENGINE, "dtype": "float32"}) as llm:
        with pytest.raises(RuntimeError, match=r"model\.layers\.0\.attn\.wo_b: vLLM's CPU GEMM "
                                               r"dispatch packed this weight away.*start a new engine"):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(a)})
