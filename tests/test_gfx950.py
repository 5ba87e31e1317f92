"""What must hold on MI350/MI355 (gfx950, ROCm vLLM with AITER): skipped elsewhere (tests/conftest.py).

There the target is vLLM's in-tree ``DeepseekV4ForCausalLM`` and the draft the plugin's BF16 build of vLLM's
in-tree AMD MTP layers (``vllm_dsv4_mtp.gfx950.draft``). The tiny checkpoints use dimensions the in-tree gfx950
kernels accept (head_dim 512 = 448 NoPE + 64 RoPE, index_head_dim 128, 64 indexer heads, 16 query heads,
hidden a multiple of 256 for AITER's mHC and MoE): the embedded model's are refused there
(``Unsupported head_dim for fused quant+cache: 64``).

1. The draft's logits equal the plugin's float32 reference MTP (``vllm_dsv4_mtp.reference.mtp``, which the
   portable draft matches to 4e-6 on CPU: tests/test_mtp_reference.py) on the same weights and inputs, within
   a BF16 bound: BF16 rounding of the weights and of every activation through one decoder block, so logits
   agree to a few percent of their range and their argmax on nearly every position.
2. Greedy output with MTP K = 1, 2, 3 equals MTP off, for a model whose MTP layer agrees with the target (the
   permutation model): speculation must not change a token, and vLLM's counters must show the drafts accepted.
"""

from __future__ import annotations

import pytest
import torch
from engines import drafter, vllm_engine

pytestmark = [pytest.mark.gfx950, pytest.mark.engine]

GFX950_DIMS = dict(hidden_size=256, head_dim=512, qk_rope_head_dim=64, index_n_heads=64, index_head_dim=128,
                   num_attention_heads=16, o_groups=4, moe_intermediate_size=256)


def test_gfx950_draft_logits_equal_the_reference(tmp_path):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.gfx950.draft import DeepSeekV4MTPModel
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    cfg = tiny_config(**GFX950_DIMS)
    ckpt = build_tiny_checkpoint(tmp_path / "bf16", cfg, seed=0)
    # in-process: the test reaches the draft model object
    with vllm_engine(ckpt, in_process=True, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 1}) as llm:
        draft = drafter(llm)
        assert isinstance(draft, DeepSeekV4MTPModel)
        layer = draft.model.layers[str(cfg["num_hidden_layers"])]
        seen = []

        def hook(module, args, output):  # (input_ids, positions, previous_hidden_states, inputs_embeds, step)
            if args[1].shape[0] > 8 and not seen:  # the prompt catch-up: every position, an empty MTP cache
                seen.append((args[0].cpu(), args[1].cpu(), args[2].float().cpu(), output.float().cpu()))

        handle = layer.register_forward_hook(hook)
        prompt = torch.randint(3, 500, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0.0, detokenize=False))
        handle.remove()
    assert seen, "the draft never ran its prompt catch-up step"
    ids, pos, hidden, got = seen[0]
    t, hc, d = pos.shape[0], cfg["hc_mult"], cfg["hidden_size"]
    ref = ReferenceMTP.from_checkpoint(ckpt)
    with torch.no_grad():
        want = ref(hidden[:t].view(t, hc, d), ids[:t], pos)
        # ReferenceMTP.logits takes [B, T, hc, D] (its hc_head flattens from dim 2)
        lw, lg = ref.logits(want[None])[0], ref.logits(got[:t].view(1, t, hc, d))[0]
    span = (lw.max() - lw.min()).item()
    assert (lg - lw).abs().max().item() <= 0.05 * span, "draft logits differ beyond BF16 rounding"
    assert (lg.argmax(-1) == lw.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gfx950_greedy_mtp_equals_mtp_off_and_is_accepted(tmp_path, k):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm
    from vllm_dsv4_mtp.testing.mtp_checkpoints import make_permutation_model, permutation_chain
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    ckpt = build_tiny_checkpoint(tmp_path / "perm", tiny_config(**GFX950_DIMS), seed=5)
    perm = make_permutation_model(ckpt, seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = {}
    for spec in (None, {"method": "mtp", "num_speculative_tokens": k}):
        # in-process like the draft test above: one engine at a time in this process, each stopped with its
        # distributed groups before the next starts, and no engine-core process forked from a process using the GPU
        with vllm_engine(ckpt, in_process=True, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True,
                         disable_log_stats=False, speculative_config=spec) as llm:
            outs[spec is None] = [list(o.outputs[0].token_ids) for o in
                                  llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
            m = spec_decode_from_llm(llm.get_metrics())
        if spec is not None:
            assert m is not None and m.num_drafts > 0
            # the MTP layer agrees with the target by construction: a wrong draft computation shows as rejections
            assert m.acceptance_rate >= 0.9, m.to_dict()
    assert outs[False] == outs[True]
    assert outs[True] == [permutation_chain(perm, p[-1], 24) for p in prompts]
