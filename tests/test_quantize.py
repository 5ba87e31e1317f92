"""``dsv4-mtp quantize``: tiny DeepSeek-V4 checkpoints in, Quark MXFP4 experts + BF16 MTP out.

Oracles: amd-quark's own fake-quant (expert values), amd-quark's own file-to-file flow (the whole output, byte
for byte), Quark's exclude-aware config builder (FP8 layers of an official source), and the source bytes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from vllm_dsv4_mtp.formats import fp8, mxfp4
from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig
from vllm_dsv4_mtp.quant.quantize import QuantizeError, quantize_checkpoint
from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

torch.set_num_threads(1)

ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def bf16_src(work):
    # 1 MiB shards: the tiny checkpoint spans several of them
    return build_tiny_checkpoint(work / "bf16", seed=3, max_shard_bytes=2**20)


@pytest.fixture(scope="module")
def bf16_out(bf16_src, work):
    quantize_checkpoint(bf16_src, work / "bf16-mxfp4", progress=False)
    return work / "bf16-mxfp4"


@pytest.fixture(scope="module")
def official_src(work):
    return build_tiny_checkpoint(
        work / "official", seed=4, experts="fp4-official", linears="fp8", max_shard_bytes=2**20
    )


@pytest.fixture(scope="module")
def official_out(official_src, work):
    quantize_checkpoint(official_src, work / "official-mxfp4", progress=False)
    return work / "official-mxfp4"


@pytest.fixture(scope="module")
def quark():
    """amd-quark, imported once for the module (``import quark.torch`` takes ~17 s).
    amd-quark (the `quant` extra, which `make setup` installs) is required: a missing oracle fails, never skips."""
    import quark.torch  # noqa: F401  (registers Quark's torch ops)
    from quark.torch import LLMTemplate
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_mx
    from quark.torch.quantization.file2file_quantization import _build_exclude_aware_quant_config

    return types.SimpleNamespace(
        LLMTemplate=LLMTemplate,
        fake_quantize_mx=fake_quantize_mx,
        build_exclude_aware_quant_config=_build_exclude_aware_quant_config,
    )


def _quark_config(path) -> QuarkQuantConfig:
    return QuarkQuantConfig.from_dict(CheckpointReader(path).config["quantization_config"])


# ----------------------------------------------------------------------------------------------------------
# BF16 source
# ----------------------------------------------------------------------------------------------------------


def test_bf16_source_layout_and_inspect(bf16_src, bf16_out):
    src, out = CheckpointReader(bf16_src), CheckpointReader(bf16_out)
    assert len(src.shards) > 1 and len(out.shards) > 1
    experts = [n for n in src if ROUTED.match(n)]
    assert experts
    for n in experts:
        i, s = out.info(n), out.info(n[: -len(".weight")] + ".weight_scale")
        rows, cols = src.info(n).shape
        assert (i.dtype, i.shape) == ("U8", (rows, cols // 2))
        assert (s.dtype, s.shape) == ("U8", (rows, cols // 32))
    report = inspect_checkpoint(bf16_out)
    assert report.ok, report.messages()
    assert report.mtp_precision == "bf16"
    assert report.kinds["routed_experts"].precision == "mxfp4"


def test_non_expert_tensors_are_byte_identical(bf16_src, bf16_out):
    src, out = CheckpointReader(bf16_src), CheckpointReader(bf16_out)
    others = [n for n in src if not ROUTED.match(n)]
    assert any(n.startswith("mtp.") for n in others) and "embed.weight" in others
    for n in others:
        assert (out.info(n).dtype, out.info(n).shape) == (src.info(n).dtype, src.info(n).shape), n
        assert out.raw_bytes(n) == src.raw_bytes(n), n
    added = set(out) - set(src)
    assert added == {n[: -len(".weight")] + ".weight_scale" for n in src if ROUTED.match(n)}
    # tokenizer and generation config travel along
    for f in ("tokenizer.json", "generation_config.json"):
        assert (bf16_out / f).read_bytes() == (bf16_src / f).read_bytes()


def test_mtp_is_bf16_and_excluded(bf16_src, bf16_out):
    out = CheckpointReader(bf16_out)
    q = _quark_config(bf16_out)
    mtp = [n for n in out if n.startswith("mtp.")]
    assert mtp and all(out.info(n).dtype in ("BF16", "F32", "I64") for n in mtp)
    mtp_linears = {
        n[: -len(".weight")]
        for n in mtp
        if n.endswith(".weight") and len(out.info(n).shape) == 2 and not n[: -len(".weight")].endswith("norm")
    }
    assert {"mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.ffn.experts.0.w1", "mtp.0.attn.wq_a"} <= mtp_linears
    assert mtp_linears <= set(q.exclude)
    for m in mtp_linears:
        assert q.spec_for(m) is None
    assert q.spec_for("layers.1.ffn.experts.0.w1") == "mxfp4"
    assert not any(ROUTED.match(e + ".weight") for e in q.exclude)  # no main-layer routed expert excluded


def test_experts_decode_to_own_fake_quant(bf16_src, bf16_out):
    src, out = CheckpointReader(bf16_src), CheckpointReader(bf16_out)
    for n in [n for n in src if ROUTED.match(n)]:
        decoded = mxfp4.dequantize(out.get(n), out.get(n[: -len(".weight")] + ".weight_scale"))
        assert torch.equal(decoded, mxfp4.fake_quant(src.get(n).float())), n


@pytest.mark.quark
def test_experts_decode_to_quark_fake_quant(quark, bf16_src, bf16_out):
    """The Must-show check: every expert decodes bit for bit to amd-quark's fake-quant of the source."""
    fake_quantize_mx = quark.fake_quantize_mx
    src, out = CheckpointReader(bf16_src), CheckpointReader(bf16_out)
    experts = [n for n in src if ROUTED.match(n)]
    for n in experts:
        decoded = mxfp4.dequantize(out.get(n), out.get(n[: -len(".weight")] + ".weight_scale"))
        oracle = fake_quantize_mx(src.get(n).float(), -1, 32, "even", mx_element_dtype="fp4")
        assert torch.equal(decoded.view(torch.int32), oracle.view(torch.int32)), n


@pytest.mark.quark
def test_identical_to_amd_quarks_own_file_to_file_flow(quark, bf16_src, bf16_out, work):
    """vllm_dsv4_mtp.quant.quark_flow runs Quark's direct_quantize_checkpoint (CPU works for BF16 sources): same
    tensors, same
    bytes, same quantization_config, same everything else in config.json."""
    from vllm_dsv4_mtp.quant.quark_flow import run_quark_flow

    quark_out = run_quark_flow(bf16_src, work / "quark-f2f", device="cpu", shared_experts="keep")
    ours, theirs = CheckpointReader(bf16_out), CheckpointReader(quark_out)
    assert set(ours) == set(theirs)
    for n in ours:
        assert (ours.info(n).dtype, ours.info(n).shape) == (theirs.info(n).dtype, theirs.info(n).shape), n
        assert ours.raw_bytes(n) == theirs.raw_bytes(n), n
    assert json.dumps(ours.config["quantization_config"]) == json.dumps(theirs.config["quantization_config"])
    assert ours.config == theirs.config


def test_shared_experts_mxfp4_option(bf16_src, work):
    dst = work / "bf16-shared-mxfp4"
    report = quantize_checkpoint(bf16_src, dst, shared_experts="mxfp4", progress=False)
    out, src = CheckpointReader(dst), CheckpointReader(bf16_src)
    q = _quark_config(dst)
    shared = [n for n in src if re.match(r"^layers\.\d+\.ffn\.shared_experts\.w[123]\.weight$", n)]
    assert shared and set(shared) <= set(report.quantized)
    for n in shared:
        m = n[: -len(".weight")]
        assert out.info(n).dtype == "U8" and out.info(m + ".weight_scale").dtype == "U8"
        assert q.spec_for(m) == "mxfp4" and m not in q.exclude
        assert torch.equal(
            mxfp4.dequantize(out.get(n), out.get(m + ".weight_scale")), mxfp4.fake_quant(src.get(n).float())
        )
    # the MTP layer's shared expert stays BF16
    assert out.info("mtp.0.ffn.shared_experts.w1.weight").dtype == "BF16"
    assert "mtp.0.ffn.shared_experts.w1" in q.exclude
    assert inspect_checkpoint(dst).ok


# ----------------------------------------------------------------------------------------------------------
# official FP8 / FP4 source
# ----------------------------------------------------------------------------------------------------------


def test_official_fp4_experts_reencoded_losslessly(official_src, official_out):
    src, out = CheckpointReader(official_src), CheckpointReader(official_out)
    experts = [n for n in src if ROUTED.match(n)]
    assert experts and all(src.info(n).dtype == "I8" for n in experts)
    for n in experts:
        m = n[: -len(".weight")]
        assert out.info(n).dtype == "U8" and out.raw_bytes(n) == src.raw_bytes(n), n
        assert out.info(m + ".weight_scale").dtype == "U8"
        assert out.raw_bytes(m + ".weight_scale") == src.raw_bytes(m + ".scale"), n
        assert m + ".scale" not in out
        assert torch.equal(
            mxfp4.dequantize(out.get(n), out.get(m + ".weight_scale")),
            mxfp4.dequantize(src.get(n), src.get(m + ".scale")),
        )
    report = inspect_checkpoint(official_out)
    assert report.ok, report.messages()
    assert report.mtp_precision == "bf16"


def test_official_fp8_layers_kept_and_mtp_decoded(official_src, official_out):
    src, out = CheckpointReader(official_src), CheckpointReader(official_out)
    q = _quark_config(official_out)
    fp8_weights = [n for n in src if src.info(n).dtype == "F8_E4M3"]
    assert fp8_weights
    for n in fp8_weights:
        m = n[: -len(".weight")]
        if n.startswith("mtp."):
            # decoded exactly to BF16, scale dropped, listed in exclude
            assert out.info(n).dtype == "BF16" and m + ".scale" not in out and m + ".weight_scale" not in out
            want = fp8.dequantize_block_fp8(src.get(n), src.get(m + ".scale"), torch.float32)
            assert torch.equal(out.get(n).float(), want), n
            assert m in q.exclude
        else:
            # bytes kept, scale renamed as Quark's own flow writes kept FP8 layers, declared as FP8 blocks
            assert out.raw_bytes(n) == src.raw_bytes(n)
            assert out.info(m + ".weight_scale").dtype == src.info(m + ".scale").dtype == "F8_E8M0"
            assert out.raw_bytes(m + ".weight_scale") == src.raw_bytes(m + ".scale")
            assert q.spec_for(m) == "fp8-block" and m not in q.exclude
    for n in [n for n in src if n.startswith("mtp.") and ROUTED.match(n.replace("mtp.0.", "layers.9.", 1))]:
        m = n[: -len(".weight")]
        assert out.info(n).dtype == "BF16"
        assert torch.equal(out.get(n).float(), mxfp4.dequantize(src.get(n), src.get(m + ".scale")))
    cfg = out.config
    assert cfg["quantization_config"]["quant_method"] == "quark" and cfg["expert_dtype"] == "fp4"
    # every other tensor is byte-identical
    for n in src:
        if src.info(n).dtype in ("BF16", "F32", "I64") and not n.endswith((".scale",)):
            assert out.raw_bytes(n) == src.raw_bytes(n), n


@pytest.mark.quark
def test_official_config_matches_quarks_exclude_aware_builder(quark, official_src, official_out):
    """For the main layers, Quark's own keep-as-in-source config builder gives the same exclude list and the same
    FP8 layer entries; the MTP layer differs by design (Quark keeps it FP8/FP4, we decode it to BF16)."""
    from vllm_dsv4_mtp.quant.quark_flow import quark_exclude

    qc = quark.LLMTemplate.get("deepseek_v4").get_config(scheme="mxfp4", exclude_layers=quark_exclude("keep"))
    hf = json.loads((official_src / "config.json").read_text())
    theirs = quark.build_exclude_aware_quant_config(str(official_src), qc, hf, True).to_dict()
    ours = CheckpointReader(official_out).config["quantization_config"]

    def main(names):
        return sorted(n for n in names if not n.startswith("mtp."))

    assert main(ours["exclude"]) == main(theirs["exclude"])
    assert main(ours["layer_quant_config"]) == main(theirs["layer_quant_config"])
    for k in main(ours["layer_quant_config"]):
        assert ours["layer_quant_config"][k] == theirs["layer_quant_config"][k], k
    assert ours["global_quant_config"] == theirs["global_quant_config"]


def test_quark_flow_refuses_fp8_source_on_cpu(official_src, work):
    from vllm_dsv4_mtp.quant.quark_flow import run_quark_flow

    with pytest.raises(QuantizeError, match=r"FP8 source on device 'cpu'.*writes nothing"):
        run_quark_flow(official_src, work / "never", device="cpu")
    assert not (work / "never").exists()


# ----------------------------------------------------------------------------------------------------------
# safety: refusal, atomicity, bad input
# ----------------------------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_refuses_to_overwrite_without_force(bf16_src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(QuantizeError, match=r"out: already exists and is not empty; pass --force"):
        quantize_checkpoint(bf16_src, dst, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
    # through the CLI: exit status 2 and the message
    from vllm_dsv4_mtp.cli import main

    assert main(["quantize", str(bf16_src), str(dst), "--no-progress"]) == 2
    assert (dst / "keep.txt").read_text() == "precious"
    # --force replaces it completely
    assert main(["quantize", str(bf16_src), str(dst), "--no-progress", "--force"]) == 0
    assert not (dst / "keep.txt").exists() and inspect_checkpoint(dst).ok
    assert _leftovers(tmp_path) == []


def test_no_partial_destination_after_a_failure(bf16_src, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = mxfp4.quantize

    def failing(x, *a, **k):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("injected failure in the middle of the conversion")
        return real(x, *a, **k)

    monkeypatch.setattr(mxfp4, "quantize", failing)
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(bf16_src, dst, progress=False)
    assert not dst.exists() and _leftovers(tmp_path) == []
    # an existing DST replaced with --force survives a failed run untouched
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"old checkpoint")
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(bf16_src, dst, progress=False, force=True)
    assert (dst / "model.safetensors").read_bytes() == b"old checkpoint"
    assert _leftovers(tmp_path) == []


def test_bad_sources_are_clear_errors(bf16_src, official_src, bf16_out, tmp_path):
    with pytest.raises(QuantizeError, match=r"already Quark-quantized"):
        quantize_checkpoint(bf16_out, tmp_path / "a", progress=False)
    with pytest.raises(QuantizeError, match=r"must not be the source"):
        quantize_checkpoint(bf16_src, bf16_src / "inside", progress=False)
    with pytest.raises(QuantizeError, match=r"source checkpoint directory not found"):
        quantize_checkpoint(tmp_path / "nope", tmp_path / "b", progress=False)
    # a mis-shaped FP4 scale: the pre-flight check (dsv4-mtp inspect) names the tensor; without it, our own check
    broken = tmp_path / "broken"
    build_tiny_checkpoint(broken, seed=4, experts="fp4-official", linears="fp8", tokenizer=False)
    from safetensors.torch import load_file, save_file

    f = broken / "model.safetensors"
    tensors = load_file(f)
    name = "layers.2.ffn.experts.1.w2.scale"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, f)
    with pytest.raises(QuantizeError, match=r"layers\.2\.ffn\.experts\.1\.w2"):
        quantize_checkpoint(broken, tmp_path / "c", progress=False)
    with pytest.raises(
        QuantizeError,
        match=r"layers\.2\.ffn\.experts\.1\.w2\.weight: packed FP4 weight I8 "
        r"\[128, 32\] needs an E8M0 scale \[128, 2\].*is F8_E8M0 \[128, 1\]",
    ):
        quantize_checkpoint(broken, tmp_path / "d", progress=False, check=False)
    assert _leftovers(tmp_path) == [] and not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------------------
# memory: bounded by a shard, not by the checkpoint
# ----------------------------------------------------------------------------------------------------------

# Peak RSS is read from /proc/self/status VmHWM, which belongs to this process image; getrusage's ru_maxrss
# would not do: Linux carries it over fork + exec, so it starts at the (large) pytest parent's RSS.
_MEASURE = r"""
import json, re, sys
import psutil, torch
torch.set_num_threads(1)
import vllm_dsv4_mtp.quant.quantize, safetensors.torch, tqdm, vllm_dsv4_mtp.tools.inspect_checkpoint
base = psutil.Process().memory_info().rss
r = vllm_dsv4_mtp.quant.quantize.quantize_checkpoint(sys.argv[1], sys.argv[2], progress=False)
hwm = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
print(json.dumps({"base": base, "peak": int(hwm.group(1)) * 1024, "bytes_in": r.bytes_in,
                  "shards_in": r.shards_in}))
"""


def test_peak_memory_is_bounded_by_a_shard(tmp_path):
    """A 256 MiB checkpoint in 16 MiB shards: the run's memory above its imports stays near a couple of shards,
    far below the checkpoint (numbers for quant/README.md; a memory bound, not a timing)."""
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    src = build_tiny_checkpoint(
        tmp_path / "src",
        tiny_config(hidden_size=512, n_routed_experts=32, moe_intermediate_size=512),
        max_shard_bytes=16 * 2**20,
        tokenizer=False,
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "dst")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(res.stdout.strip().splitlines()[-1])
    shard = max(p.stat().st_size for p in src.glob("*.safetensors"))
    delta = m["peak"] - m["base"]
    print(
        f"\npeak RSS {m['peak'] / 2**20:.0f} MiB, {delta / 2**20:.0f} MiB above the imports; checkpoint "
        f"{m['bytes_in'] / 2**20:.0f} MiB in {m['shards_in']} shards of <= {shard / 2**20:.0f} MiB"
    )
    assert m["shards_in"] >= 10
    assert delta < m["bytes_in"] / 2
    assert delta < 4 * shard + 64 * 2**20


def test_cli_module_imports_no_torch():
    """`dsv4-mtp --help` must stay instant: the quantize sub-command's parser module does not import torch."""
    code = "import sys, vllm_dsv4_mtp.quant.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO))).returncode == 0
    from vllm_dsv4_mtp.quant.cli import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
