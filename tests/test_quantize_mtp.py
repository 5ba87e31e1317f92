"""``dsv4-mtp quantize --mtp amd``: the MTP layer written as AMD's Quark export stores it.

Oracles: the published ``amd`` layout (``testing/published_layouts.py``: the facts of AMD's export, with the MTP
layer's declarations as AMD's config and vLLM's Quark fixture key them), the source bytes, the FP8 / MXFP4 codecs,
and ``dsv4-mtp inspect`` (which must accept the output). The default (``--mtp bf16``) is covered by
``tests/test_quantize.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.formats import fp8, mxfp4
from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig
from vllm_dsv4_mtp.quant.quantize import QuantizeError, quantize_checkpoint
from vllm_dsv4_mtp.testing.published_layouts import amd_quark_config, config_of
from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

MTP_ROUTED = re.compile(r"^mtp\.0\.ffn\.experts\.\d+\.w[123]\.weight$")
MTP_SHARED = re.compile(r"^mtp\.0\.ffn\.shared_experts\.w[123]\.weight$")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize-mtp")
    bf16 = build_tiny_checkpoint(root / "bf16", seed=1, max_shard_bytes=2**20)
    official = build_tiny_checkpoint(root / "official", seed=1, experts="fp4-official", linears="fp8")
    report = quantize_checkpoint(bf16, root / "bf16-amd", mtp="amd", progress=False)
    quantize_checkpoint(bf16, root / "bf16-default", progress=False)
    quantize_checkpoint(official, root / "official-amd", mtp="amd", progress=False)
    return {
        "bf16": bf16,
        "official": official,
        "bf16-amd": root / "bf16-amd",
        "bf16-default": root / "bf16-default",
        "official-amd": root / "official-amd",
        "report": report,
    }


def test_mtp_experts_mxfp4_shared_fp8_rest_as_source(built):
    src, out = CheckpointReader(built["bf16"]), CheckpointReader(built["bf16-amd"])
    mtp = [n for n in src.names() if n.startswith("mtp.")]
    routed = [n for n in mtp if MTP_ROUTED.match(n)]
    shared = [n for n in mtp if MTP_SHARED.match(n)]
    assert len(routed) == 24 and len(shared) == 3
    for n in routed:  # as the main layers' experts: uint8 packed E2M1 + uint8 E8M0 .weight_scale, Quark's rounding
        packed, scales = mxfp4.quantize(src.get(n).float())
        assert torch.equal(out.get(n), packed)
        assert torch.equal(out.get(n[: -len("weight")] + "weight_scale"), scales)
    for n in shared:  # FP8 e4m3 128x128 blocks, E8M0 .weight_scale
        q, s = fp8.quantize_block_fp8(src.get(n).float(), scale_format="e8m0")
        assert out.info(n).dtype == "F8_E4M3" and torch.equal(out.get(n).view(torch.uint8), q.view(torch.uint8))
        scale = n[: -len("weight")] + "weight_scale"
        assert out.info(scale).dtype == "F8_E8M0" and torch.equal(out.get(scale).view(torch.uint8), s)
    for n in set(mtp) - set(routed) - set(shared):  # the rest byte for byte
        assert out.info(n).dtype == src.info(n).dtype and torch.equal(out.get(n), src.get(n)), n
    # the main layers exactly as the default conversion writes them
    default = CheckpointReader(built["bf16-default"])
    for n in default.names():
        if not n.startswith("mtp."):
            assert torch.equal(out.get(n), default.get(n)), n
    assert built["report"].quantized and not built["report"].mtp_dequantized


def test_quark_config_declares_the_mtp_layer_as_amds_does(built):
    qc = config_of(built["bf16-amd"])["quantization_config"]
    quark = QuarkQuantConfig.from_dict(qc)
    amd = amd_quark_config(DeepseekV4Spec.from_dict(config_of(built["bf16"])), mtp="amd")
    for key in (r"re:mtp\.\d+\.ffn\.experts\.\d+\.w[123]$", r"re:mtp\.\d+\.ffn\.shared_experts\.w[123]$"):
        assert qc["layer_quant_config"][key] == amd["layer_quant_config"][key]  # AMD's key, AMD's scheme
    assert quark.spec_for("mtp.0.ffn.experts.5.w2") == "mxfp4"
    assert quark.layer_config_for("mtp.0.ffn.experts.5.w2")["input_tensors"]["dtype"] == "fp4"  # W4A4
    assert quark.spec_for("mtp.0.ffn.shared_experts.w1") == "fp8-block"
    for m in ("mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wo_b"):  # BF16 in the source
        assert quark.spec_for(m) is None and quark.is_excluded(m), m
    # the default keeps declaring the whole MTP layer excluded
    default = QuarkQuantConfig.from_dict(config_of(built["bf16-default"])["quantization_config"])
    assert default.spec_for("mtp.0.ffn.experts.5.w2") is None
    assert default.spec_for("mtp.0.ffn.shared_experts.w1") is None


def test_inspect_accepts_the_output(built):
    for name in ("bf16-amd", "official-amd"):
        report = inspect_checkpoint(built[name])
        assert not report.errors, [p.message for p in report.errors]


def test_official_source_keeps_its_fp8_and_fp4_bytes(built):
    src, out = CheckpointReader(built["official"]), CheckpointReader(built["official-amd"])
    for n in ("mtp.0.ffn.shared_experts.w1.weight", "mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight"):
        assert out.info(n).dtype == "F8_E4M3"
        assert torch.equal(out.get(n).view(torch.uint8), src.get(n).view(torch.uint8))
        m = n[: -len(".weight")]
        assert torch.equal(out.get(m + ".weight_scale").view(torch.uint8), src.get(m + ".scale").view(torch.uint8))
    n = "mtp.0.ffn.experts.3.w3.weight"  # official FP4 re-encoded losslessly: the same bytes, Quark's containers
    assert torch.equal(out.get(n), src.get(n).view(torch.uint8))
    quark = QuarkQuantConfig.from_dict(config_of(built["official-amd"])["quantization_config"])
    assert quark.spec_for("mtp.0.e_proj") == "fp8-block" and quark.spec_for("mtp.0.ffn.experts.3.w3") == "mxfp4"


def test_unknown_mtp_mode_is_refused(built, tmp_path):
    with pytest.raises(QuantizeError, match=r"mtp must be one of \('bf16', 'amd'\), got 'fp8'"):
        quantize_checkpoint(built["bf16"], tmp_path / "x", mtp="fp8", progress=False)


def test_cli_option(built, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dsv4_mtp.cli",
            "quantize",
            str(built["bf16"]),
            str(out),
            "--mtp",
            "amd",
            "--no-progress",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert CheckpointReader(out).info("mtp.0.ffn.shared_experts.w2.weight").dtype == "F8_E4M3"


def test_an_f32_scaled_fp8_shared_expert_is_declared_with_f32_scales(built, tmp_path):
    """An FP8 source whose block scales are F32 (not the release's E8M0) keeps them as stored, so the Quark entry for
    the MTP shared expert must say ``float32``: declared E8M0 over F32 bytes, vLLM would read wrong scales."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "official-f32"
    shutil.copytree(built["official"], src)

    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        for n in [n for n in tensors if n.startswith("mtp.0.ffn.shared_experts.") and n.endswith(".scale")]:
            tensors[n] = tensors[n].float()
        save_file(tensors, str(f), metadata={"format": "pt"})
    quantize_checkpoint(src, tmp_path / "out", mtp="amd", progress=False)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    shared = [v for k, v in qc["layer_quant_config"].items() if "shared_experts" in k and k.startswith("re:mtp")]
    assert len(shared) == 1 and shared[0]["weight"]["scale_type"] == "float32", shared
    out = CheckpointReader(tmp_path / "out")
    assert out.info("mtp.0.ffn.shared_experts.w1.weight_scale").dtype == "F32"
