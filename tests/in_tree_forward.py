"""The real in-tree MTP class's forward and compute_logits on CPU, and the float32 reference's, on the same inputs.

Used by tests/in_tree_real_worker.py for cases with ``forward``: after the plugin's loader filled the draft, the
target's embedding and LM head (which vLLM's proposer shares into the draft) are copied in, the ROCm-only kernels
are replaced (tests/rocm_standins.py ``install_forward``: the two Triton RMSNorms and the attention core), and one
prompt catch-up step runs through vLLM's modules: ``e_proj`` / ``h_proj`` (vLLM's unquantized linears), the
decoder block's mHC pre/post ops, norms, vLLM's DeepSeek-V4 MoE (router with bias, unquantized fused MoE with the
SwiGLU clamp, shared-expert MLP) and ``compute_logits`` (vLLM's hc_head op and logits processor).

``mutation`` (a deliberate error the comparison must catch) is applied to the draft's loaded parameters, or to the
reference, before the forward: ``transpose-shared`` (the shared expert's down projection transposed, square
here), ``swap-e-h`` (``e_proj`` and ``h_proj`` exchanged), ``no-clamp`` (the reference's shared expert without
its SwiGLU clamp), ``zero-attn`` / ``zero-routed`` (the attention's ``wo_b`` / the routed experts' ``w2`` zeroed:
each part of the layer contributes).
"""

from __future__ import annotations

from pathlib import Path

import rocm_standins
import torch

TOKENS = 48


def _inputs(spec, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (TOKENS,), generator=g)
    positions = torch.arange(TOKENS)
    hidden = torch.randn(TOKENS, spec.hc_mult, spec.hidden_size, generator=g) * 2.0
    return ids, positions, hidden


def run_forward(case: dict, out: Path, rank: int, model, vc) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP

    ckpt = case["ckpt"]
    spec = DeepseekV4Spec.from_dir(ckpt)
    reader = CheckpointReader(ckpt)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(reader.get("embed.weight"))
        layer = model.model.layers[str(spec.num_hidden_layers)]
        layer.shared_head.head.weight.copy_(reader.get("head.weight"))
        mutation = case.get("mutation")
        if mutation == "transpose-shared":
            w = layer.mtp_block.ffn.shared_experts.down_proj.weight
            assert w.shape[0] == w.shape[1], "transpose-shared needs moe_intermediate_size == hidden_size"
            w.copy_(w.t().contiguous())
        elif mutation == "zero-attn":
            layer.mtp_block.attn.wo_b.weight.zero_()
        elif mutation == "zero-routed":
            layer.mtp_block.ffn.experts.routed_experts.w2_weight.zero_()
        elif mutation == "swap-e-h":
            e, h = layer.e_proj.weight, layer.h_proj.weight
            tmp = e.clone()
            e.copy_(h)
            h.copy_(tmp)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    rocm_standins.install_forward(model, spec.rope_theta, spec.sliding_window)
    with set_current_vllm_config(vc):  # what vLLM's model loader runs after load_weights (CPU kernels' setup)
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    ids, positions, hidden = _inputs(spec, case.get("seed", 0))
    result = {}
    captured = {}

    def grab_ffn(module, args, output):
        captured["ffn_in"] = args[0].detach().float().clone()
        captured["ffn_out"] = output.detach().float().clone()

    hook = layer.mtp_block.ffn.register_forward_hook(grab_ffn)
    with torch.no_grad(), set_current_vllm_config(vc), set_forward_context(None, vc):
        x = hidden.to(vc.model_config.dtype).flatten(1)
        state = model(input_ids=ids, positions=positions, hidden_states=x)
        logits = model.compute_logits(state)
    hook.remove()
    ref = ReferenceMTP.from_checkpoint(ckpt)
    if mutation == "no-clamp":
        ref.block.mlp.shared_experts.limit = float("inf")
    with torch.no_grad():
        want_state = ref(hidden.float(), ids, positions)
        want = ref.logits(want_state[None])[0]  # logits takes [B, T, hc, D]
    got = logits.float()[:, : want.shape[-1]]
    result["rel"] = float((got - want).norm() / want.norm())
    result["state_rel"] = float((state.float().view_as(want_state) - want_state).norm() / want_state.norm())
    result["max_abs"] = float((got - want).abs().max())
    result["span"] = float(want.max() - want.min())
    result["argmax_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    result["state_max_abs"] = float((state.float().view_as(want_state) - want_state).abs().max())
    result["state_span"] = float(want_state.max() - want_state.min())
    torch.save(
        {"got": got, "want": want, "ffn_in": captured.get("ffn_in"), "ffn_out": captured.get("ffn_out"), "ids": ids},
        out / f"{case['name']}-fwd{rank}.pt",
    )
    return result
