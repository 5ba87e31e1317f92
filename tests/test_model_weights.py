"""Weight loading from native DeepSeek-V4 names: the name map, and the loader on real tiny checkpoints.

The model is built in-process (one-process gloo, TP=1) from the ``VllmConfig`` vLLM makes for the checkpoint,
so loader errors surface here with their full message. Covered: BF16, Quark MXFP4 and the official layout (FP8
e4m3 linears with 128x128 ``.scale`` + int8/F8_E8M0 FP4 experts) load completely and agree with the BF16
weights they were made from; a missing, mis-shaped or unknown tensor and an FP8 weight without its scale are
errors naming the tensor; ``mtp.*`` is skipped on purpose.
"""

from __future__ import annotations


import pytest
import torch

from vllm_dsv4_mtp.model.weights import map_native_name


def test_native_name_map():
    m = lambda n: map_native_name(n, num_hidden_layers=4)  # noqa: E731
    assert m("embed.weight").param == "model.embed_tokens.weight"
    assert m("head.weight").param == "lm_head.weight"
    assert m("hc_head_fn").param == "model.hc_head.fn"
    t = m("layers.1.attn.wq_a.weight")
    assert (t.kind, t.param, t.shard) == ("param", "model.layers.1.attn.fused_wqa_wkv.weight", 0)
    assert m("layers.1.attn.wkv.weight").shard == 1
    t = m("layers.1.attn.indexer.compressor.wgate.weight")
    assert (t.param, t.shard) == ("model.layers.1.attn.indexer.compressor.fused_wkv_wgate.weight", 1)
    assert m("layers.2.attn.compressor.wkv.weight").param == "model.layers.2.attn.compressor.fused_wkv_wgate.weight"
    assert m("layers.2.attn.compressor.ape").param == "model.layers.2.attn.compressor.ape"
    assert m("layers.0.hc_attn_fn").param == "model.layers.0.hc_attn.fn"
    assert m("layers.3.ffn.gate.bias").param == "model.layers.3.ffn.gate.e_score_correction_bias"
    assert m("layers.0.ffn.gate.tid2eid").param == "model.layers.0.ffn.gate.tid2eid"
    assert m("layers.3.ffn.shared_experts.w2.weight").param == "model.layers.3.ffn.shared_experts.down_proj.weight"
    t = m("layers.3.ffn.shared_experts.w3.weight")
    assert (t.param, t.shard) == ("model.layers.3.ffn.shared_experts.gate_up_proj.weight", 1)
    t = m("layers.3.ffn.experts.7.w2.weight_scale")
    assert (t.kind, t.param, t.expert, t.shard, t.part) == ("expert", "model.layers.3.ffn.experts", 7, "w2",
                                                             "weight_scale")
    t = m("layers.1.attn.wq_b.scale")
    assert (t.kind, t.param) == ("scale", "model.layers.1.attn.wq_b.weight")
    assert m("mtp.0.e_proj.weight").kind == "skip"
    with pytest.raises(KeyError, match="layers.9.attn.wq_a.weight: layer 9 is beyond num_hidden_layers=4"):
        m("layers.9.attn.wq_a.weight")
    with pytest.raises(KeyError, match="lm_head.weight: not a DeepSeek-V4 tensor name"):
        m("lm_head.weight")


def _build(ckpt, dtype="float32"):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_mtp.model.deepseek_v4 import DeepseekV4ForCausalLM

    cfg = EngineArgs(model=str(ckpt), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
                     max_model_len=512).create_engine_config()
    with set_current_vllm_config(cfg), torch.device("cpu"):
        torch.set_default_dtype(cfg.model_config.dtype)
        try:
            return DeepseekV4ForCausalLM(vllm_config=cfg)
        finally:
            torch.set_default_dtype(torch.float32)


def _tensors(ckpt):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    return dict(CheckpointReader(ckpt).iter_tensors())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("w")
    return {kind: build_tiny_checkpoint(root / kind, seed=0, **kw, tokenizer=False) for kind, kw in {
        "bf16": {},
        "mxfp4": {"experts": "mxfp4"},
        "official": {"experts": "fp4-official", "linears": "fp8"},
        "fse": {"experts": "mxfp4", "shared_experts": "mxfp4"},
    }.items()}


def test_bf16_checkpoint_loads_every_tensor(vllm_dist, ckpts):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    loaded = model.load_weights(tensors.items())
    assert loaded == {n for n, _ in model.named_parameters()}
    p = dict(model.named_parameters())
    q_lora = 64
    assert torch.equal(p["model.layers.1.attn.fused_wqa_wkv.weight"][:q_lora], tensors["layers.1.attn.wq_a.weight"].float())
    assert torch.equal(p["model.layers.0.ffn.gate.tid2eid"], tensors["layers.0.ffn.gate.tid2eid"].int())
    assert torch.equal(p["model.layers.1.ffn.experts.w13_weight"][3, 64:], tensors["layers.1.ffn.experts.3.w3.weight"].float())


def test_official_layout_decodes_to_the_bf16_weights(vllm_dist, ckpts):
    """FP8 linears decode (exact block scales) to within FP8 rounding of the BF16 source; FP4 experts keep
    their bytes (int8 -> uint8 view, F8_E8M0 -> raw bytes)."""
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

    model = _build(ckpts["official"], dtype="bfloat16")
    tensors = _tensors(ckpts["official"])
    model.load_weights(tensors.items())
    p = dict(model.named_parameters())
    wq_b = dequantize_block_fp8(tensors["layers.2.attn.wq_b.weight"], tensors["layers.2.attn.wq_b.scale"])
    assert torch.equal(p["model.layers.2.attn.wq_b.weight"], wq_b)
    src = _tensors(ckpts["bf16"])["layers.2.attn.wq_b.weight"].float()
    assert (wq_b.float() - src).abs().max() <= src.abs().max() / 8  # e4m3: 3 mantissa bits
    assert torch.equal(p["model.layers.3.ffn.experts.w2_weight"][5],
                       tensors["layers.3.ffn.experts.5.w2.weight"].view(torch.uint8))
    assert torch.equal(p["model.layers.3.ffn.experts.w2_weight_scale"][5],
                       tensors["layers.3.ffn.experts.5.w2.scale"].view(torch.uint8))
    info = model.describe()
    assert info["experts"] == ["portable_mxfp4"] * 4 and info["expert_activation_quant"] == [False] * 4


def test_quark_mxfp4_checkpoint_loads(vllm_dist, ckpts):
    model = _build(ckpts["mxfp4"], dtype="bfloat16")
    tensors = _tensors(ckpts["mxfp4"])
    model.load_weights(tensors.items())
    p = dict(model.named_parameters())
    assert torch.equal(p["model.layers.1.ffn.experts.w13_weight_scale"][2, :64],
                       tensors["layers.1.ffn.experts.2.w1.weight_scale"])
    assert model.describe()["expert_activation_quant"] == [True] * 4


@pytest.mark.parametrize("breakage,message", [
    ("drop", r"layers\.2\.attn\.compressor\.ape: tensor missing from the checkpoint"),
    ("reshape", r"layers\.1\.attn\.wo_b\.weight: expected shape \(128, 64\), got \(128, 63\)"),
    ("unknown", r"layers\.1\.attn\.bogus\.weight: unexpected tensor for this config"),
])
def test_bad_checkpoints_are_errors_naming_the_tensor(vllm_dist, ckpts, breakage, message):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    if breakage == "drop":
        del tensors["layers.2.attn.compressor.ape"]
    elif breakage == "reshape":
        tensors["layers.1.attn.wo_b.weight"] = tensors["layers.1.attn.wo_b.weight"][:, :63]
    else:
        tensors["layers.1.attn.bogus.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=message):
        model.load_weights(tensors.items())


def test_fp8_weight_without_scale_is_an_error(vllm_dist, ckpts):
    model = _build(ckpts["official"], dtype="bfloat16")
    tensors = _tensors(ckpts["official"])
    del tensors["layers.0.attn.wo_a.scale"]
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wo_a\.weight: its block scale \(\.scale / "
                                         r"\.weight_scale\) is missing from the checkpoint"):
        model.load_weights(tensors.items())


def test_mxfp4_expert_without_scale_is_an_error(vllm_dist, ckpts):
    model = _build(ckpts["mxfp4"], dtype="bfloat16")
    tensors = _tensors(ckpts["mxfp4"])
    del tensors["layers.3.ffn.experts.6.w1.weight_scale"]
    with pytest.raises(ValueError, match=r"layers\.3\.ffn\.experts\.6\.w1\.weight: MXFP4 expert weight without "
                                         r"its E8M0 scale"):
        model.load_weights(tensors.items())


def test_mtp_tensors_are_skipped_on_purpose(vllm_dist, ckpts):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    assert any(n.startswith("mtp.0.") for n in tensors)
    tensors["mtp.0.bogus"] = torch.zeros(1)  # even nonsense under mtp.* belongs to the draft, not the target
    model.load_weights(tensors.items())


def test_mxfp4_shared_experts_fse_layout(vllm_dist, ckpts):
    """The AMD export's main-layer shared experts are MXFP4 (packed + E8M0): loaded as raw bytes and computed by
    the same emulation as the routed experts (weight-only here: exact decode, then the SwiGLU expert)."""
    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.kernels.experts import swiglu_clamped

    model = _build(ckpts["fse"], dtype="bfloat16")
    tensors = _tensors(ckpts["fse"])
    assert tensors["layers.1.ffn.shared_experts.w2.weight"].dtype == torch.uint8
    model.load_weights(tensors.items())
    assert model.describe()["shared_experts"] == ["mxfp4"] * 4
    shared = model.model.layers[1].ffn.shared_experts
    assert torch.equal(shared.experts.w2_weight_scale[0], tensors["layers.1.ffn.shared_experts.w2.weight_scale"])
    shared.experts.activation_quant = False
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    dq = {s: mxfp4.dequantize(tensors[f"layers.1.ffn.shared_experts.{s}.weight"],
                              tensors[f"layers.1.ffn.shared_experts.{s}.weight_scale"]).bfloat16()
          for s in ("w1", "w2", "w3")}
    want = swiglu_clamped(x @ dq["w1"].T, x @ dq["w3"].T, 10.0) @ dq["w2"].T
    torch.testing.assert_close(shared(x), want, atol=0, rtol=0)
