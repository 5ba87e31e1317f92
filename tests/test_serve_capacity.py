"""The capacity check: what runs on each platform, weights per GPU by part, the reserve per topology, the verdict.

The byte counts are checked against an independent count written here from the DeepSeek-V4 tensor table
(the release's safetensors index) and against published figures; the reserve against the measurements it is
derived from (recomputed here from their published numbers); the refusal message line by line against numbers
computed here.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from vllm_dsv4_mtp import platform
from vllm_dsv4_mtp.serve import capacity, cli, reserve
from vllm_dsv4_mtp.serve.capacity import (
    GB,
    GIB,
    PLUGIN_DRAFT,
    VLLM_DRAFT,
    Parallelism,
    Runs,
    check_capacity,
    load_weight_table,
)
from vllm_dsv4_mtp.serve.profiles import FLASH_CONFIG, HARDWARE, PRO_CONFIG

MXFP4_BYTES = 0.5 + 1 / 32  # packed e2m1 + one E8M0 byte per 32 elements
MI355X = 287.98 * GIB  # bytes vLLM sees per MI355X (ROCm/ATOM#1164)
PRO, AMD_PRO, AMD_FLASH = "deepseek-ai/DeepSeek-V4-Pro", "amd/DeepSeek-V4-Pro-MXFP4", "amd/DeepSeek-V4-Flash-MXFP4"
KV_1M = 14.88 * GIB  # InferenceX#2540: one 1,048,576-token Pro sequence, fp8 KV


def _mtp_params(c) -> int:
    """The MTP layer's parameters, counted from the release's tensor list (SWA block, no compressor/indexer)."""
    H, E, I, hc = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"], c["hc_mult"]
    heads, hd, qr = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    og, olr = c["o_groups"], c["o_lora_rank"]
    mix = (2 + hc) * hc
    attn = qr * H + qr + heads * hd * qr + hd * H + hd + og * olr * (heads // og * hd) + H * og * olr + heads
    ffn = E * 3 * H * I + 3 * H * I + E * H + E  # routed, shared, gate weight + bias
    block = attn + ffn + 2 * H + 2 * (mix * hc * H + mix + 3)  # + attn/ffn norms, hc_attn/hc_ffn
    return block + 2 * H * H + 3 * H + hc * hc * H + hc + 1  # e_proj, h_proj, enorm/hnorm/norm, hc_head


def _mtp_fp32_params(c) -> int:
    """The MTP layer's float32 tensors: hc_attn/hc_ffn/hc_head mixes, the sink, the router bias."""
    H, hc, E = c["hidden_size"], c["hc_mult"], c["n_routed_experts"]
    mix = (2 + hc) * hc
    return 2 * (mix * hc * H + mix + 3) + hc * hc * H + hc + 1 + c["num_attention_heads"] + E


def _check(model, tp=1, dp=1, ep=False, util=0.85, mtp=True, **kw):
    return check_capacity(
        model,
        hardware="mi355x",
        par=Parallelism(tp=tp, dp=dp, expert_parallel=ep),
        gpu_memory_utilization=util,
        max_model_len=kw.pop("max_model_len", None),
        kv_cache_dtype=kw.pop("kv_cache_dtype", "fp8"),
        mtp=mtp,
        **kw,
    )


def _value(lines, start) -> float:
    """The GB figure at the end of the report line that starts with ``start``."""
    return float(next(x for x in lines if x.strip().startswith(start)).split()[-2])


# ------------------------------------------------------------------------------------------------- weights
def test_parameter_counts_match_the_published_sizes():
    pro = load_weight_table(AMD_PRO)
    main = sum(p.params for p in pro.target.values())
    mtp = sum(p.params for p in pro.mtp.values())
    assert mtp == _mtp_params(PRO_CONFIG)
    # the model cards: "Pro 1573B main (+25.8B MTP)", "Flash 284.3B main (+6.6B MTP)"
    assert round(main / 1e9) == 1573 and round(mtp / 1e8) == 258
    flash = load_weight_table(AMD_FLASH)
    assert round(sum(p.params for p in flash.target.values()) / 1e8) == 2843
    assert sum(p.params for p in flash.mtp.values()) == _mtp_params(FLASH_CONFIG)
    assert round(sum(p.params for p in flash.mtp.values()) / 1e8) == 66


def test_official_flash_bytes_match_the_released_checkpoint():
    """deepseek-ai/DeepSeek-V4-Flash is 148.66 (GiB, as the Hub reports sizes) in 46 shards (verified table),
    and the stored bytes of target + MTP add up to it."""
    table = load_weight_table("deepseek-ai/DeepSeek-V4-Flash")
    stored = sum(p.stored_bytes for p in [*table.target.values(), *table.mtp.values()])
    # the files also hold their JSON headers (69,187 entries, ~10 MB) and the figure is rounded to 0.01
    assert 0 <= 148.66 - stored / GIB < 0.02


def test_what_runs_is_counted_per_platform_and_draft():
    """In-tree target: stored bytes; portable target: dense bf16; the plugin's draft: BF16 (fp32 stays fp32);
    vLLM's own draft: stored. Each against a count written here."""
    c = PRO_CONFIG
    L, E, H, I = c["num_hidden_layers"], c["n_routed_experts"], c["hidden_size"], c["moe_intermediate_size"]
    routed, mtp_routed = L * E * 3 * H * I, E * 3 * H * I
    table = load_weight_table(PRO)
    tp8 = Parallelism(tp=8)

    def part(component, label, runs):
        return next(
            p.nbytes(stored, runs.dtype_bytes)
            for comp, p, stored in table.parts(runs)
            if comp == component and p.label == label
        )

    in_tree = Runs(platform.IN_TREE, PLUGIN_DRAFT)
    portable = Runs(platform.PORTABLE, PLUGIN_DRAFT)
    assert part("target", "routed experts", in_tree) == routed * MXFP4_BYTES  # FP4 e2m1 + ue8m0 per 32
    assert part("target", "routed experts", portable) == routed * 2
    assert part("draft", "routed experts", Runs(draft=VLLM_DRAFT)) == mtp_routed * MXFP4_BYTES
    plugin_mtp = 2 * (_mtp_params(c) - _mtp_fp32_params(c)) + 4 * _mtp_fp32_params(c)
    assert sum(p.nbytes(s) for comp, p, s in table.parts(in_tree) if comp == "draft") == plugin_mtp
    # per GPU: the no-draft run is the target alone; the drafts differ by exactly their split bytes
    no_draft = table.per_gpu(tp8, Runs(draft=None))
    assert table.per_gpu(tp8, in_tree) - no_draft == pytest.approx(
        sum(p.nbytes(False) / p.ways(tp8) for p in table.mtp.values())
    )
    assert table.per_gpu(tp8, Runs(draft=VLLM_DRAFT)) < table.per_gpu(tp8, in_tree) - 4 * GB


def test_portable_hardware_counts_dense_weights_in_the_report():
    c = PRO_CONFIG
    routed = c["num_hidden_layers"] * c["n_routed_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]
    hw = dataclasses.replace(HARDWARE["mi355x"], implementation=platform.PORTABLE)
    r = check_capacity(
        AMD_PRO,
        hardware=hw,
        par=Parallelism(tp=8),
        gpu_memory_utilization=0.85,
        max_model_len=None,
        kv_cache_dtype="fp8",
        mtp=True,
    )
    lines = r.text.splitlines()
    assert lines[1] == "  target: the plugin's portable DeepseekV4ForCausalLM, every quantized weight decoded to bf16"
    experts = next(x for x in lines if x.strip().startswith("routed experts"))
    assert experts.split()[2] == "bf16" and f"{routed * 2 / GB:.2f} GB  / 8 (TP)" in experts
    assert not r.fits  # 1.5 T parameters in bf16 do not fit 8 GPUs
    # the portable draft decodes its weights whatever it computes: both precisions take the same bytes
    assert r.draft_gb["bf16"] == r.draft_gb["stored"] and r.bf16_kv_tokens == 0


def test_expert_parallel_changes_how_experts_are_split_not_how_much():
    """vLLM's FusedMoEParallelConfig flattens TP across DP: each of the TP x DP GPUs holds 1/(TP x DP) of the
    routed experts with or without EP; DP replicates the attention and so has a reserve of its own."""
    table = load_weight_table(AMD_PRO)
    runs = Runs()
    assert table.per_gpu(Parallelism(tp=4, dp=2), runs) == table.per_gpu(
        Parallelism(tp=4, dp=2, expert_parallel=True), runs
    )
    ep = _check(AMD_PRO, tp=4, dp=2, ep=True, util=0.85)
    assert "/ 8 (TPxDP, EP)" in ep.text and "runtime reserve, DP topologies" in ep.text
    bf16 = _check(AMD_PRO, tp=8, kv_cache_dtype="auto")
    fp8 = _check(AMD_PRO, tp=8)
    # bf16 rows are 1024 B instead of 584 B (+ the same fp8 indexer rows): more KV per token
    assert bf16.left_gb < fp8.left_gb - 5


def test_dp4_weights_agree_with_the_measured_load():
    """InferenceX#2540: vLLM loaded the official Pro's target + MTP at 224.83 GiB/GPU at DP4+EP4."""
    table = load_weight_table(PRO)
    ours = table.per_gpu(Parallelism(dp=4, expert_parallel=True), Runs(draft=VLLM_DRAFT))
    assert ours / GIB == pytest.approx(224.83, rel=0.02)


# ------------------------------------------------------------------------------------------------- reserve
def test_reserves_are_derived_from_the_measurements():
    """Recomputed here from the published numbers and this check's weights for each measured run."""
    hw = HARDWARE["mi355x"]
    table = load_weight_table(PRO)
    stored = Runs(draft=VLLM_DRAFT)
    w_tp4 = table.per_gpu(Parallelism(tp=4), stored)
    w_dp4 = table.per_gpu(Parallelism(dp=4), stored)
    tp_bound = 0.90 * MI355X - w_tp4 - KV_1M  # #2540: TP4 + MTP started at 1,048,576 tokens
    vllm_dp4 = 0.90 * MI355X - w_dp4 - 12.09 * GIB  # #2540: DP4+EP4, 12.09 GiB of KV left
    atom_dp4 = 0.90 * MI355X - w_dp4 + 10.98 * GB  # amd-master.yaml run 30277221626: KV budget -10.98 GB
    tp = reserve.reserve_for(hw, Parallelism(tp=8))
    dp = reserve.reserve_for(hw, Parallelism(tp=2, dp=4, expert_parallel=True))
    assert tp.topology == "tp" and tp.gb == pytest.approx(tp_bound / GB, abs=1e-6)
    assert dp.topology == "dp" and dp.gb == pytest.approx(atom_dp4 / GB, abs=1e-6)
    assert sorted(d.reserve_gb for d in dp.derived) == pytest.approx(sorted([vllm_dp4 / GB, atom_dp4 / GB]))
    # physically plausible: tens of GB (DeepSeek-V4 workspaces, activations, graphs), not the carveout-sized
    # share of the total, and the DP-attention reserve is the larger one
    assert 30 < tp.gb < dp.gb < 60
    assert reserve.reserve_for(hw, Parallelism(tp=4, pp=2)).gb == tp.gb  # PP keeps attention split over TP


def test_the_check_reproduces_the_measured_runs():
    """Modelled with vLLM's own (stored) draft, each measured run comes out as measured."""
    atom = _check(PRO, dp=4, util=0.90, draft=VLLM_DRAFT)
    assert atom.kv_budget_gb == pytest.approx(-10.98) and not atom.fits
    vllm_dp4 = _check(PRO, dp=4, ep=True, util=0.90, draft=VLLM_DRAFT)
    assert not vllm_dp4.fits  # #2540 excluded DP4+EP4: 12.09 GiB left < 14.88 GiB needed
    vllm_tp4 = _check(PRO, tp=4, util=0.90, draft=VLLM_DRAFT)
    assert vllm_tp4.fits and vllm_tp4.left_gb == pytest.approx(0, abs=1e-6)  # the bound: it just fits


def test_reserve_is_printed_with_its_derivation_and_source():
    lines = _check(AMD_PRO, tp=8).text.splitlines()
    i = next(i for i, x in enumerate(lines) if x.strip().startswith("runtime reserve, TP topologies"))
    assert lines[i + 1].startswith(
        "    used: vLLM 0.26.0 (its own MTP draft), deepseek-ai/DeepSeek-V4-Pro, TP4: 0.9 x total = 278.29 GB - "
    )
    assert "(one 1,048,576-token sequence fitted)" in lines[i + 1]
    assert lines[i + 2].startswith("      source: InferenceX#2540 (https://github.com/SemiAnalysisAI/InferenceX/")
    dp = _check(AMD_PRO, tp=2, dp=4, ep=True).text
    assert "    used: ATOM nightly_202607231538" in dp and "+ 10.98 GB (KV budget -10.98 GB)" in dp
    assert "run 30277221626" in dp and "    not used (smaller): vLLM 0.26.0" in dp


# ------------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("util", [0.85, 0.90])
def test_pro_tp4_with_the_bf16_draft_is_refused_with_the_arithmetic(util):
    c = PRO_CONFIG
    L, E, H, I = c["num_hidden_layers"], c["n_routed_experts"], c["hidden_size"], c["moe_intermediate_size"]
    routed = L * E * 3 * H * I
    mtp_bytes = 2 * (_mtp_params(c) - _mtp_fp32_params(c)) + 4 * _mtp_fp32_params(c)
    r = _check(AMD_PRO, tp=4, util=util)
    assert not r.fits
    lines = r.text.splitlines()
    assert lines[0] == (
        "capacity check: amd/DeepSeek-V4-Pro-MXFP4 on MI355X (287.98 GiB = 309.22 GB per GPU), TP=4, MTP draft on"
    )
    assert lines[1] == "  target: vLLM's in-tree DeepseekV4ForCausalLM (AITER) at the checkpoint's stored precision"
    assert lines[2] == "  draft:  the plugin's BF16 MTP draft (DeepSeekV4MTPModel)"
    experts = next(x for x in lines if x.strip().startswith("routed experts"))
    assert f"{routed / 1e9:,.2f} B   " in experts and experts.split()[2] == "mxfp4"
    assert f"{routed * MXFP4_BYTES / GB:.2f} GB  / 4 (TP)" in experts
    assert experts.endswith(f"{routed * MXFP4_BYTES / 4 / GB:.2f} GB")
    mtp = next(x for x in lines if x.strip().startswith("MTP layer (plugin's BF16 draft)"))
    assert f"{mtp_bytes / GB:.2f} GB  split as above" in mtp

    # the per-GPU column adds up to the weights line; left = budget - weights - reserve - KV
    end = lines.index(next(x for x in lines if "= weights per GPU" in x))
    weights = _value(lines, "= weights per GPU")
    assert abs(sum(float(x.split()[-2]) for x in lines[5:end]) - weights) < 0.05
    budget = util * MI355X / GB
    assert lines[end + 1].endswith(f"{budget:.2f} GB")
    res = reserve.reserve_for(HARDWARE["mi355x"], Parallelism(tp=4)).gb
    assert _value(lines, "runtime reserve") == pytest.approx(res, abs=0.005)
    kv = KV_1M / GB  # the measured Pro figure at its measured length
    assert _value(lines, "KV cache for one 1,048,576-token sequence") == pytest.approx(kv, abs=0.005)
    left = budget - weights - res - kv
    assert r.left_gb == pytest.approx(left, abs=0.01) and left < 0
    assert _value(lines, "left = ") == pytest.approx(r.left_gb, abs=0.005)
    assert f"  does not fit: {-r.left_gb:.2f} GB per GPU short" in lines
    assert "    --tensor-parallel-size 8" in lines
    room = (budget - weights - res) * GB  # weights as printed (rounded to 10 MB): compare to 0.1 %
    fit = [x for x in lines if x.startswith("    --max-model-len ") and x.endswith("(the longest sequence that fits)")]
    if room <= 0:  # at 0.85 not even the weights and the reserve fit: no length helps
        assert fit == [] and r.kv_budget_gb < 0
    else:
        assert int(fit[0].split()[1]) == pytest.approx(room / (kv * GB / 1048576), rel=1e-3)


def test_shipped_profiles_fit_and_the_draft_is_what_tips_pro_tp4_over():
    tp8 = _check(AMD_PRO, tp=8)
    assert tp8.fits and tp8.left_gb > 50
    flash = _check(AMD_FLASH, tp=4)
    assert flash.fits and flash.left_gb > 100
    # without the MTP layer Pro TP4 fits at 0.90: the BF16 draft (13.11 GB per GPU) is what does not
    no_mtp = _check(AMD_PRO, tp=4, util=0.90, mtp=False)
    assert no_mtp.fits and "MTP layer (" not in no_mtp.text and "draft:  none" in no_mtp.text


def _drafts_per_gpu(c, tp) -> dict[str, float]:
    """Both plugin drafts' bytes per GPU at TP, from the release's MTP tensor list. ``bf16``: every tensor upcast
    to 2 bytes (float32 ones stay 4); ``stored``: AMD's export, routed experts MXFP4, every linear (attention,
    shared expert, e_proj/h_proj) FP8 e4m3 with one E8M0 scale byte per 128x128 block, norms and router bf16."""
    H, E, I = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    heads, hd, qr, og, olr = (
        c[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank")
    )
    split = [(heads * hd, qr), (og * olr, heads // og * hd), (H, og * olr), (I, H), (I, H), (H, I)]  # wq_b..., w1-3
    replicated = [(qr, H), (hd, H), (H, H), (H, H)]  # wq_a, wkv, e_proj, h_proj
    routed = E * 3 * H * I
    bf16_small = qr + hd + 2 * H + 3 * H + E * H  # q/kv norms, attn/ffn norms, enorm/hnorm/norm, router weight
    fp32 = _mtp_fp32_params(c)
    linear_params = sum(o * i for o, i in split + replicated)
    assert routed + linear_params + bf16_small + fp32 == _mtp_params(c)  # every MTP tensor counted once

    def fp8(o, i):
        return o * i + math.ceil(o / 128) * math.ceil(i / 128)

    small = 2 * bf16_small + 4 * fp32
    return {
        "bf16": (2 * routed + sum(2 * o * i for o, i in split)) / tp + sum(2 * o * i for o, i in replicated) + small,
        "stored": (routed * MXFP4_BYTES + sum(fp8(o, i) for o, i in split)) / tp
        + sum(fp8(o, i) for o, i in replicated)
        + small,
    }


def _kv_bytes_per_token(c) -> float:
    """The measured Pro figure scaled by fp8 compressed-row bytes per token (584 B rows, 132 B indexer rows)."""

    def rows(ratios):
        return sum((584 + 132) / 4 if r == 4 else 584 / 128 if r == 128 else 0 for r in ratios)

    return KV_1M / 1048576 * rows(c["compress_ratios"]) / rows(PRO_CONFIG["compress_ratios"])


@pytest.mark.parametrize(
    "profile, config, tp", [("mi355x-pro-tp8", PRO_CONFIG, 8), ("mi355x-flash-tp4", FLASH_CONFIG, 4)]
)
@pytest.mark.parametrize("precision", ["bf16", "stored"])
def test_dry_run_states_both_drafts_and_what_bf16_costs_in_kv_tokens(
    profile, config, tp, precision, monkeypatch, capsys
):
    """Both drafts' bytes per GPU and the BF16 draft's cost in KV tokens, against the arithmetic above; the
    environment switch selects which one the weights line counts."""
    monkeypatch.setenv("VLLM_DSV4_MTP_DRAFT_PRECISION", precision)
    assert cli.run(["--profile", profile, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = _drafts_per_gpu(config, tp)
    head = next(i for i, x in enumerate(lines) if x.startswith("  MTP draft precision ("))
    assert lines[head].startswith(f"  MTP draft precision (VLLM_DSV4_MTP_DRAFT_PRECISION={precision}), ")
    assert lines[head].endswith(f"per GPU at TP={tp}:")
    rows = {x.split()[0]: x for x in lines[head + 1 : head + 3]}
    assert set(rows) == {"bf16", "stored"} and f"{precision} (selected)" in rows[precision]
    for p, row in rows.items():
        assert float(row.split()[-2]) == pytest.approx(want[p] / GB, abs=0.005), p
    cost = want["bf16"] - want["stored"]
    kv_tok = _kv_bytes_per_token(config)
    trade = lines[head + 3]
    assert trade.startswith(f"  bf16 draft costs {cost / GB:.2f} GB per GPU = ")
    assert int(trade.split(" = ")[1].split()[0].replace(",", "")) == pytest.approx(cost / kv_tok, abs=1)
    assert trade.endswith(f"({cost / GB:.2f} GB / {kv_tok:,.0f} B per token per GPU, fp8 KV)")
    # the selected draft is the one the MTP row and the weights line count
    mtp_row = next(x for x in lines if x.strip().startswith("MTP layer ("))
    assert ("plugin's BF16 draft" if precision == "bf16" else "plugin's, stored") in mtp_row
    assert float(mtp_row.split()[-2]) == pytest.approx(want[precision] / GB, abs=0.005)
    report = _check(AMD_PRO if tp == 8 else AMD_FLASH, tp=tp, draft=capacity.PRECISION_DRAFTS[precision])
    assert report.draft_gb == pytest.approx({p: v / GB for p, v in want.items()}, abs=1e-6)
    assert report.bf16_kv_tokens == pytest.approx(cost / kv_tok, rel=1e-9)


def test_startup_free_memory_is_reported_and_bounds_the_suggested_utilisation():
    """vLLM refuses to start above ~256 GiB of budget on InferenceX's MI355X nodes: 0.888 of 287.98 GiB."""
    assert "measured free at start-up" not in _check(AMD_PRO, tp=8, util=0.85).text
    note = next(x for x in _check(AMD_PRO, tp=8, util=0.90).text.splitlines() if x.startswith("  note: "))
    assert note.endswith(f"above gpu-memory-utilization {math.floor(256 / 287.98 * 1000) / 1000:.3f}")
    # Pro TP4 without the draft needs 0.89 for 1,048,576 tokens: more than vLLM gets there, so not suggested
    r = _check(AMD_PRO, tp=4, util=0.88, mtp=False)
    lines = r.text.splitlines()
    assert not any(x.startswith("    --gpu-memory-utilization") for x in lines)
    longest = int(r.kv_budget_gb * GB / (KV_1M / 1048576))
    assert any(x.startswith(f"    --max-model-len {longest} ") for x in lines)


# ------------------------------------------------------------------------------------------------- inputs
def test_local_checkpoint_uses_its_headers(tmp_path):
    """Stored bytes from the headers; the BF16 draft decodes the MTP layer's FP8 linears and packed FP4 experts
    (the official layout) to 2 bytes per value, the F32 tensors stay 4."""
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny", experts="fp4-official", linears="fp8", tokenizer=False)
    reader = CheckpointReader(ckpt)
    table = load_weight_table(str(ckpt))
    assert "safetensors headers" in table.source
    for mtp, parts in ((False, table.target), (True, table.mtp)):
        stored = sum(reader.info(n).nbytes for n in reader.names() if n.startswith("mtp.") == mtp)
        assert sum(p.stored_bytes for p in parts.values()) == stored
    assert table.target["routed experts"].precision == {"fp4"}
    values = {"BF16": 1, "F32": 1, "F8_E4M3": 1, "I8": 2}  # logical values per stored element
    widths = {"BF16": 2, "F32": 4, "F8_E4M3": 2, "I8": 2}  # bytes per value in the BF16 draft
    mtp = [n for n in reader.names() if n.startswith("mtp.") and not n.endswith(".scale")]
    assert {reader.info(n).dtype for n in mtp} == set(values)
    dense = sum(
        math.prod(reader.info(n).shape) * values[reader.info(n).dtype] * widths[reader.info(n).dtype] for n in mtp
    )
    assert sum(p.nbytes(False) for p in table.mtp.values()) == dense


def test_config_only_directory_uses_expected_tensors(tmp_path):
    """Without shards, the bytes come from expected_tensors() for the config's quantization_config; they equal
    what the headers of the real files say. The published configs carry no expert_dtype: FP4 experts."""
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    for experts, linears in (("mxfp4", "bf16"), ("fp4-official", "fp8")):
        full = build_tiny_checkpoint(tmp_path / experts, experts=experts, linears=linears, tokenizer=False)
        bare = tmp_path / f"bare-{experts}"
        bare.mkdir()
        cfg = json.loads((full / "config.json").read_text())
        cfg.pop("expert_dtype", None)
        (bare / "config.json").write_text(json.dumps(cfg))
        from_files, from_config = load_weight_table(str(full)), load_weight_table(str(bare))
        assert "no weights: layout from its quantization_config" in from_config.source
        for label, part in from_files.target.items():
            assert from_config.target[label].stored_bytes == part.stored_bytes, (experts, label)
            assert from_config.target[label].params == part.params, (experts, label)


def test_serve_refuses_and_dry_run_reports_for_a_local_checkpoint(tmp_path, capsys):
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny", experts="bf16", tokenizer=False)
    assert cli.run(["--profile", "mi355x-flash-tp4", str(ckpt), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"weights: {ckpt}: safetensors headers + config.json" in out and "  fits: " in out
    # a GPU too small for even the tiny model: refused with exit status 2, before anything starts
    rc = cli.run(["--profile", "mi355x-flash-tp4", str(ckpt), "--gpu-memory-gb", "0.001", "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 2 and "does not fit" in cap.out and "refused: the capacity check above" in cap.err
    assert (
        cli.run(
            ["--profile", "mi355x-flash-tp4", str(ckpt), "--gpu-memory-gb", "0.001", "--dry-run", "--no-capacity-check"]
        )
        == 0
    )


def test_profile_refusal_through_the_cli(capsys):
    for util in ("0.85", "0.9"):
        rc = cli.run(["--profile", "mi355x-pro-tp8", "-tp", "4", "--gpu-memory-utilization", util, "--dry-run"])
        cap = capsys.readouterr()
        assert rc == 2, util
        assert (
            "capacity check: amd/DeepSeek-V4-Pro-MXFP4 on MI355X (287.98 GiB = 309.22 GB per GPU), TP=4, MTP draft on"
        ) in cap.out
        assert "  does not fit: " in cap.out
    assert cli.run(["--profile", "mi355x-pro-tp8", "--dry-run"]) == 0
    assert cli.run(["--profile", "mi355x-flash-tp4", "--dry-run"]) == 0
    # at TP4 no sequence length helps (weights and reserve alone exceed the budget); dropping the draft does
    assert cli.run(["--profile", "mi355x-pro-tp8", "-tp", "4", "--max-model-len", "256k", "--dry-run"]) == 2
    assert (
        cli.run(
            [
                "--profile",
                "mi355x-pro-tp8",
                "-tp",
                "4",
                "--max-model-len",
                "256k",
                "--speculative-config",
                "null",
                "--dry-run",
            ]
        )
        == 0
    )


def test_unknown_remote_model_skips_the_check_visibly(capsys):
    assert cli.run(["--profile", "mi355x-pro-tp8", "someone/other-model", "--dry-run"]) == 0
    assert (
        "# capacity check skipped: someone/other-model is neither a local checkpoint directory nor a known "
        "checkpoint" in capsys.readouterr().out
    )


def test_malformed_local_config_names_the_field(tmp_path, capsys):
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    cfg = tiny_config()
    del cfg["hc_mult"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli.run(["--profile", "mi355x-flash-tp4", str(tmp_path), "--dry-run"]) == 2
    assert "missing required field 'hc_mult'" in capsys.readouterr().err


def test_kv_scale_reproduces_the_measurement():
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    pro = DeepseekV4Spec.from_dict(PRO_CONFIG)
    assert capacity.kv_bytes_per_token(pro, "fp8") * 1048576 == pytest.approx(14.88 * GIB)
    # rows per token from the layer schedule: 30 C4 layers (row + indexer row) / 4, 31 C128 layers / 128
    assert capacity.kv_row_bytes_per_token(pro, "fp8") == pytest.approx(30 * (584 + 132) / 4 + 31 * 584 / 128)


def test_official_expert_storage_follows_the_spec_default():
    """The published configs have no expert_dtype: the routed experts are FP4, as vLLM assumes; an explicit
    expert_dtype still decides."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.serve.weight_bytes import storage_from_spec

    assert all("expert_dtype" not in c for c in (PRO_CONFIG, FLASH_CONFIG))
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    for extra, experts in (({}, "fp4-official"), ({"expert_dtype": "fp8"}, "fp8-block")):
        spec = DeepseekV4Spec.from_dict({**FLASH_CONFIG, "quantization_config": fp8, **extra})
        assert storage_from_spec(spec) == {"experts": experts, "linears": "fp8"}
