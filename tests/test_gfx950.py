"""What must hold on MI350/MI355 (gfx950, ROCm vLLM with AITER): skipped elsewhere (tests/conftest.py).

There the target is vLLM's in-tree ``DeepseekV4ForCausalLM`` and the draft the plugin's BF16 build of vLLM's
in-tree AMD MTP layers (``vllm_dsv4_mtp.gfx950.draft``). The tiny checkpoints use dimensions the in-tree gfx950
kernels accept (head_dim 512 = 448 NoPE + 64 RoPE, index_head_dim 128, 64 indexer heads, 16 query heads,
hidden a multiple of 256 for AITER's mHC and MoE): the embedded model's are refused there
(``Unsupported head_dim for fused quant+cache: 64``). On CPU the same class is built and checked against the
reference by tests/test_in_tree_mtp_real.py, with ROCm's kernels stood in; these tests run AITER's own.

Every checkpoint here has an MTP layer where each part moves the result and the SwiGLU clamp engages
(``testing.mtp_checkpoints.engage_mtp``, checked with ``mtp_activity`` on the inputs vLLM fed the draft), and the
engines run what the MI355 profiles run: the fused shared expert requested
(``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``, which the BF16 draft declines and the target keeps),
``--moe-backend aiter`` and, for the greedy tests, an FP8 KV cache.

1. The draft's logits equal the plugin's float32 reference MTP (``vllm_dsv4_mtp.reference.mtp``) on the same
   weights and the inputs vLLM fed it, within a BF16 bound: logits within 5 % of their range, the same argmax on
   95 % of positions. A dropped clamp moves ~30 % of the experts' gate entries, a transposed or swapped
   projection everything: each is far outside the bound (the CPU harness shows the same comparison failing them).
2. Greedy output with MTP equals MTP off, at batch 1 with K = 3 (a 4-token verify window: the kernel class of
   ROCm/aiter#3933, where GSM8K fell to 0.04 at concurrency 4) and for a batch of prompts with K = 1, 2, 3.
3. On the permutation model (a draft that agrees with the target by construction) vLLM's counters show the
   drafts accepted, so a wrong draft computation shows as rejections.
"""

from __future__ import annotations

import pytest
import torch
from engines import drafter, vllm_engine

pytestmark = [pytest.mark.gfx950, pytest.mark.engine]

GFX950_DIMS = dict(
    hidden_size=256,
    head_dim=512,
    qk_rope_head_dim=64,
    index_n_heads=64,
    index_head_dim=128,
    num_attention_heads=16,
    o_groups=4,
    moe_intermediate_size=256,
)
#: what the MI355 profiles set (vllm_dsv4_mtp/serve/profiles.py)
PROFILE_ENV = {
    "VLLM_ROCM_USE_AITER": "1",
    "VLLM_ROCM_USE_AITER_MOE": "1",
    "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
}


def _engaged_checkpoint(path, seed: int):
    from vllm_dsv4_mtp.testing.mtp_checkpoints import engage_mtp, scale_head
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    ckpt = build_tiny_checkpoint(path, tiny_config(**GFX950_DIMS), seed=seed)
    engage_mtp(ckpt)
    scale_head(ckpt, 4.0)  # peaked logits: greedy choices stable under BF16 and batch-shape changes
    return ckpt


@pytest.mark.parametrize("fse", [True, False], ids=["fse-requested", "fse-off"])
@pytest.mark.parametrize("moe_backend", ["aiter", "auto"])
def test_gfx950_draft_logits_equal_the_reference(tmp_path, fse, moe_backend):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.gfx950.draft import DeepSeekV4MTPModel
    from vllm_dsv4_mtp.reference.mtp import ReferenceMTP
    from vllm_dsv4_mtp.testing.mtp_checkpoints import mtp_activity
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    cfg = tiny_config(**GFX950_DIMS)
    ckpt = _engaged_checkpoint(tmp_path / "engaged", seed=0)
    env = dict(PROFILE_ENV, VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS="1" if fse else "0")
    # in-process: the test reaches the draft model object
    with vllm_engine(
        ckpt,
        in_process=True,
        env=env,
        dtype="bfloat16",
        max_model_len=512,
        skip_tokenizer_init=True,
        moe_backend=moe_backend,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ) as llm:
        draft = drafter(llm)
        assert isinstance(draft, DeepSeekV4MTPModel)
        layer = draft.model.layers[str(cfg["num_hidden_layers"])]
        assert layer.mtp_block.ffn.shared_experts is not None  # the draft never fuses its shared expert
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
    activity = mtp_activity(ref, hidden[:t].view(t, hc, d), ids[:t], pos)
    assert min(activity["attention"], activity["routed"], activity["shared"]) > 0.05, activity
    assert min(activity["routed_clamped"], activity["shared_clamped"]) > 0.05, activity
    with torch.no_grad():
        want = ref(hidden[:t].view(t, hc, d), ids[:t], pos)
        # ReferenceMTP.logits takes [B, T, hc, D] (its hc_head flattens from dim 2)
        lw, lg = ref.logits(want[None])[0], ref.logits(got[:t].view(1, t, hc, d))[0]
    span = (lw.max() - lw.min()).item()
    assert (lg - lw).abs().max().item() <= 0.05 * span, "draft logits differ beyond BF16 rounding"
    assert (lg.argmax(-1) == lw.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize(
    "k,lens", [(3, (37,)), (1, (5, 40, 130)), (2, (5, 40, 130)), (3, (5, 40, 130))], ids=["batch1-k3", "k1", "k2", "k3"]
)
def test_gfx950_greedy_mtp_equals_mtp_off(tmp_path, k, lens):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm

    ckpt = _engaged_checkpoint(tmp_path / "engaged", seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = {}
    for spec in (None, {"method": "mtp", "num_speculative_tokens": k}):
        # one request at a time for batch 1: every verify window of K = 3 is the 4-token path
        with vllm_engine(
            ckpt,
            in_process=True,
            env=PROFILE_ENV,
            dtype="bfloat16",
            max_model_len=512,
            skip_tokenizer_init=True,
            disable_log_stats=False,
            moe_backend="aiter",
            kv_cache_dtype="fp8",
            max_num_seqs=len(prompts),
            speculative_config=spec,
        ) as llm:
            outs[spec is None] = [
                list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            ]
            m = spec_decode_from_llm(llm.get_metrics())
        if spec is not None:
            assert m is not None and m.num_drafts > 0 and m.num_draft_tokens == k * m.num_drafts
    assert outs[False] == outs[True]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gfx950_permutation_model_drafts_are_accepted(tmp_path, k):
    from vllm import SamplingParams

    from vllm_dsv4_mtp.serve.metrics import spec_decode_from_llm
    from vllm_dsv4_mtp.testing.mtp_checkpoints import make_permutation_model, permutation_chain
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    ckpt = build_tiny_checkpoint(tmp_path / "perm", tiny_config(**GFX950_DIMS), seed=5)
    perm = make_permutation_model(ckpt, seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    with vllm_engine(
        ckpt,
        in_process=True,
        env=PROFILE_ENV,
        dtype="bfloat16",
        max_model_len=512,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        moe_backend="aiter",
        kv_cache_dtype="fp8",
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    ) as llm:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        m = spec_decode_from_llm(llm.get_metrics())
    assert outs == [permutation_chain(perm, p[-1], 24) for p in prompts]
    # the MTP layer agrees with the target by construction: a wrong draft computation shows as rejections
    assert m is not None and m.num_drafts > 0 and m.acceptance_rate >= 0.9, m.to_dict() if m else None
