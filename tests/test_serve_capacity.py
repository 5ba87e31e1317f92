"""The capacity check: weights per GPU by part and precision, MTP in BF16, KV / activation headroom.

The byte counts are checked against an independent count written here from the DeepSeek-V4 tensor table
(dsv4-architecture.md section 6.1) and against published figures; the refusal message is checked line by line
against numbers computed here.
"""

from __future__ import annotations

import math

import pytest

from vllm_dsv4_mtp.serve import capacity, cli
from vllm_dsv4_mtp.serve.capacity import GB, GIB, Parallelism, check_capacity, load_weight_table
from vllm_dsv4_mtp.serve.profiles import FLASH_CONFIG, HARDWARE, PRO_CONFIG

MXFP4_BYTES = 0.5 + 1 / 32  # packed e2m1 + one E8M0 byte per 32 elements


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


def test_parameter_counts_match_the_published_sizes():
    pro = load_weight_table("amd/DeepSeek-V4-Pro-MXFP4")
    main = sum(p.params for p in pro.target.values())
    mtp = sum(p.params for p in pro.mtp.values())
    assert mtp == _mtp_params(PRO_CONFIG)
    # dsv4-architecture.md: "Pro 1573B main (+25.8B MTP)", "Flash 284.3B main (+6.6B MTP)"
    assert round(main / 1e9) == 1573 and round(mtp / 1e8) == 258
    flash = load_weight_table("amd/DeepSeek-V4-Flash-MXFP4")
    assert round(sum(p.params for p in flash.target.values()) / 1e8) == 2843
    assert sum(p.params for p in flash.mtp.values()) == _mtp_params(FLASH_CONFIG)
    assert round(sum(p.params for p in flash.mtp.values()) / 1e8) == 66


def test_official_flash_bytes_match_the_released_checkpoint():
    """deepseek-ai/DeepSeek-V4-Flash is 148.66 (GiB, as the Hub reports sizes) in 46 shards (verified table)."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec, expected_tensors
    from vllm_dsv4_mtp.formats.checkpoint import DTYPE_BYTES

    spec = DeepseekV4Spec.from_dict(FLASH_CONFIG)
    total = sum(math.prod(e.shape) * DTYPE_BYTES[e.dtypes[0]]
                for e in expected_tensors(spec, experts="fp4-official", linears="fp8").values())
    # the files also hold their JSON headers (69,187 entries, ~10 MB) and the figure is rounded to 0.01
    assert 0 <= 148.66 - total / GIB < 0.02
    # and the capacity table (target only, MTP excluded) is that minus the stored MTP tensors
    table = load_weight_table("deepseek-ai/DeepSeek-V4-Flash")
    mtp_stored = sum(math.prod(e.shape) * DTYPE_BYTES[e.dtypes[0]]
                     for n, e in expected_tensors(spec, experts="fp4-official", linears="fp8").items()
                     if n.startswith("mtp."))
    assert sum(p.nbytes for p in table.target.values()) == pytest.approx(total - mtp_stored, abs=1)


def test_pro_tp4_with_mtp_is_refused_with_the_arithmetic():
    c = PRO_CONFIG
    L, E, H, I = c["num_hidden_layers"], c["n_routed_experts"], c["hidden_size"], c["moe_intermediate_size"]
    routed = L * E * 3 * H * I
    hc, mix = c["hc_mult"], (2 + c["hc_mult"]) * c["hc_mult"]
    fp32 = 2 * (mix * hc * H + mix + 3) + hc * hc * H + hc + 1 + c["num_attention_heads"] + E  # hc_*, sink, bias
    mtp_bytes = 2 * (_mtp_params(c) - fp32) + 4 * fp32  # BF16 by policy, the fp32 tensors stay fp32
    r = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=4),
                       gpu_memory_utilization=0.85, max_model_len=None, kv_cache_dtype="fp8", mtp=True)
    assert not r.fits
    lines = r.text.splitlines()
    assert lines[0] == ("capacity check: amd/DeepSeek-V4-Pro-MXFP4 on MI355X (288 GB per GPU), TP=4, "
                        "MTP draft on (BF16)")
    experts_line = next(x for x in lines if x.strip().startswith("routed experts"))
    assert f"{routed / 1e9:,.2f} B   " in experts_line
    assert f"{routed * MXFP4_BYTES / GB:.2f} GB  / 4 (TP)" in experts_line
    assert experts_line.endswith(f"{routed * MXFP4_BYTES / 4 / GB:.2f} GB")
    mtp_line = next(x for x in lines if x.strip().startswith("MTP layer (BF16 by policy)"))
    assert f"{_mtp_params(c) / 1e9:,.2f} B   " in mtp_line
    assert f"{mtp_bytes / GB:.2f} GB  split as above" in mtp_line

    # the per-GPU column adds up to the weights line, and "left" is budget - weights - reserve - KV
    per_gpu = [float(x.split()[-2]) for x in lines[3:lines.index(next(x for x in lines if "= weights per GPU" in x))]]
    weights = float(next(x for x in lines if "= weights per GPU" in x).split()[-2])
    assert abs(sum(per_gpu) - weights) < 0.05
    budget = 0.85 * 288
    assert next(x for x in lines if "budget per GPU" in x).endswith(f"{budget:.2f} GB")
    reserve = HARDWARE["mi355x"].runtime_reserve_gb
    kv = 14.88 * GIB / GB  # the measured Pro figure at its measured length, 1,048,576 tokens
    assert next(x for x in lines if "KV cache for one 1,048,576-token sequence" in x).endswith(f"{kv:.2f} GB")
    left = budget - weights - reserve - kv
    assert f"  {f'left = {budget:.2f} - {weights:.2f} - {reserve:.2f} - {kv:.2f}':<96}{left:9.2f} GB" in lines
    assert left < 0
    assert f"  does not fit: {-left:.2f} GB per GPU short" in lines
    # the suggestions are the same arithmetic solved for one knob
    assert "    --tensor-parallel-size 8" in lines
    room = (budget - weights - reserve) * GB  # weights as printed (rounded to 10 MB): compare to 0.1 %
    fit = next(x for x in lines if x.startswith("    --max-model-len ") and x.endswith("(the longest sequence that fits)"))
    assert int(fit.split()[1]) == pytest.approx(room / (kv * GB / 1048576), rel=1e-3)


def test_pro_profiles_as_shipped_fit_and_tp4_fits_at_090():
    tp8 = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=8),
                         gpu_memory_utilization=0.85, max_model_len=None, kv_cache_dtype="fp8", mtp=True)
    assert tp8.fits and tp8.left_gb > 100
    # TP4 is a memory-utilisation question, not impossible: at 0.90 the same arithmetic leaves room
    tp4 = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=4),
                         gpu_memory_utilization=0.90, max_model_len=None, kv_cache_dtype="fp8", mtp=True)
    assert tp4.fits
    # without the MTP layer it fits at 0.85 too: the BF16 draft is what tips it over
    no_mtp = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=4),
                            gpu_memory_utilization=0.85, max_model_len=None, kv_cache_dtype="fp8", mtp=False)
    assert no_mtp.fits and "MTP layer" not in no_mtp.text
    flash = check_capacity("amd/DeepSeek-V4-Flash-MXFP4", hardware="mi355x", par=Parallelism(tp=4),
                           gpu_memory_utilization=0.85, max_model_len=None, kv_cache_dtype="fp8", mtp=True)
    assert flash.fits


def test_expert_parallel_and_kv_dtype_change_the_arithmetic():
    tp = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=4, dp=2),
                        gpu_memory_utilization=0.9, max_model_len=131072, kv_cache_dtype="fp8", mtp=True)
    ep = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x",
                        par=Parallelism(tp=4, dp=2, expert_parallel=True),
                        gpu_memory_utilization=0.9, max_model_len=131072, kv_cache_dtype="fp8", mtp=True)
    assert "/ 8 (TPxDP, EP)" in ep.text and ep.left_gb > tp.left_gb + 100
    bf16 = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=8),
                          gpu_memory_utilization=0.9, max_model_len=None, kv_cache_dtype="auto", mtp=True)
    fp8 = check_capacity("amd/DeepSeek-V4-Pro-MXFP4", hardware="mi355x", par=Parallelism(tp=8),
                         gpu_memory_utilization=0.9, max_model_len=None, kv_cache_dtype="fp8", mtp=True)
    # bf16 rows are 1024 B instead of 584 B (+ the same fp8 indexer rows): more KV per token
    assert bf16.left_gb < fp8.left_gb - 5


def test_local_checkpoint_uses_its_headers(tmp_path):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny", experts="bf16", tokenizer=False)
    reader = CheckpointReader(ckpt)
    table = load_weight_table(str(ckpt))
    stored_target = sum(reader.info(n).nbytes for n in reader.names() if not n.startswith("mtp."))
    assert sum(p.nbytes for p in table.target.values()) == stored_target
    assert "safetensors headers" in table.source
    # the MTP layer is counted in BF16 (fp32 tensors stay fp32): here that is exactly what is stored
    stored_mtp = sum(reader.info(n).nbytes for n in reader.names() if n.startswith("mtp."))
    assert sum(p.nbytes for p in table.mtp.values()) == stored_mtp


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
    assert cli.run(["--profile", "mi355x-flash-tp4", str(ckpt), "--gpu-memory-gb", "0.001", "--dry-run",
                    "--no-capacity-check"]) == 0


def test_profile_refusal_through_the_cli(capsys):
    rc = cli.run(["--profile", "mi355x-pro-tp8", "--tensor-parallel-size", "4", "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 2
    assert "capacity check: amd/DeepSeek-V4-Pro-MXFP4 on MI355X (288 GB per GPU), TP=4, MTP draft on (BF16)" \
        in cap.out
    assert "  does not fit: " in cap.out
    assert cli.run(["--profile", "mi355x-pro-tp8", "--dry-run"]) == 0
    assert cli.run(["--profile", "mi355x-pro-tp8", "-tp", "4", "--max-model-len", "256k", "--dry-run"]) == 0


def test_unknown_remote_model_skips_the_check_visibly(capsys):
    assert cli.run(["--profile", "mi355x-pro-tp8", "someone/other-model", "--dry-run"]) == 0
    assert "# capacity check skipped: someone/other-model is neither a local checkpoint directory nor a known " \
        "checkpoint" in capsys.readouterr().out


def test_malformed_local_config_names_the_field(tmp_path, capsys):
    import json

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


def test_config_only_directory_uses_expected_tensors(tmp_path):
    """Without shards, the bytes come from expected_tensors() for the config's quantization_config; for a
    Quark MXFP4 checkpoint they equal what the headers of the real files say."""
    import shutil

    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    full = build_tiny_checkpoint(tmp_path / "full", experts="mxfp4", tokenizer=False)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(full / "config.json", bare / "config.json")
    from_files, from_config = load_weight_table(str(full)), load_weight_table(str(bare))
    assert "no weights: layout from its quantization_config" in from_config.source
    for label, part in from_files.target.items():
        assert from_config.target[label].nbytes == part.nbytes, label
        assert from_config.target[label].params == part.params, label
    assert from_files.target["routed experts"].precision == {"mxfp4"}
