"""Weight loading from native DeepSeek-V4 names: the name maps, and the loader on real tiny checkpoints.

The model is built in-process (one-process gloo, TP=1) from the ``VllmConfig`` vLLM makes for the checkpoint,
so loader errors surface here with their full message. Covered: BF16, Quark MXFP4 and the official layout (FP8
e4m3 linears with 128x128 ``.scale`` + int8/F8_E8M0 FP4 experts) load completely, every quantized weight
equal to its exact decode; a missing, mis-shaped, unknown or non-finite tensor and a quantized weight without
its scale are errors naming the tensor; ``mtp.*`` is skipped on purpose.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_mtp.weights.names import IN_TREE, PORTABLE, draft_param, target_param


def test_native_name_map():
    m = lambda n: target_param(n, num_hidden_layers=4)  # noqa: E731
    assert m("embed.weight").param == "model.embed_tokens.weight"
    assert m("head.weight").param == "lm_head.weight"
    assert m("hc_head_fn").param == "model.hc_head.fn"
    t = m("layers.1.attn.wq_a.weight")
    assert (t.kind, t.param, t.shard) == ("stacked", "model.layers.1.attn.fused_wqa_wkv.weight", 0)
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
    t = m("layers.3.ffn.experts.7.w2.weight")
    assert (t.kind, t.param, t.expert, t.shard) == ("expert", "model.layers.3.ffn.experts.w2_weight", 7, "w2")
    assert m("layers.1.attn.attn_sink").kind == "sink"
    with pytest.raises(KeyError, match="layers.9.attn.wq_a.weight: layer 9 is beyond num_hidden_layers=4"):
        m("layers.9.attn.wq_a.weight")
    with pytest.raises(KeyError, match="lm_head.weight: not a DeepSeek-V4 main-model tensor name"):
        m("lm_head.weight")


def test_draft_name_maps_portable_and_in_tree():
    """The two draft layouts differ only where vLLM's in-tree layers keep native mHC names and hold routed
    experts under ``routed_experts``; a fused shared expert becomes expert ``n_routed_experts``."""

    def m(name, layout, fused=None):
        return draft_param(name, num_hidden_layers=61, num_mtp_layers=1, layout=layout, fused_shared_expert_id=fused)

    for layout in (PORTABLE, IN_TREE):
        assert m("mtp.0.e_proj.weight", layout).param == "model.layers.61.e_proj.weight"
        assert m("mtp.0.norm.weight", layout).param == "model.layers.61.shared_head.norm.weight"
        t = m("mtp.0.attn.wkv.weight", layout)
        assert (t.param, t.kind, t.shard) == ("model.layers.61.mtp_block.attn.fused_wqa_wkv.weight", "stacked", 1)
        assert m("mtp.0.ffn.gate.bias", layout).param == "model.layers.61.mtp_block.ffn.gate.e_score_correction_bias"
    assert m("mtp.0.hc_head_fn", PORTABLE).param == "model.layers.61.hc_head.fn"
    assert m("mtp.0.hc_head_fn", IN_TREE).param == "model.layers.61.hc_head_fn"
    assert m("mtp.0.hc_ffn_scale", PORTABLE).param == "model.layers.61.mtp_block.hc_ffn.scale"
    assert m("mtp.0.hc_ffn_scale", IN_TREE).param == "model.layers.61.mtp_block.hc_ffn_scale"
    assert m("mtp.0.ffn.experts.5.w3.weight", PORTABLE).param == "model.layers.61.mtp_block.ffn.experts.w13_weight"
    t = m("mtp.0.ffn.experts.5.w3.weight", IN_TREE)
    assert (t.param, t.expert, t.shard) == ("model.layers.61.mtp_block.ffn.experts.routed_experts.w13_weight", 5, "w3")
    assert m("mtp.0.ffn.shared_experts.w2.weight", IN_TREE).param == (
        "model.layers.61.mtp_block.ffn.shared_experts.down_proj.weight"
    )
    t = m("mtp.0.ffn.shared_experts.w2.weight", IN_TREE, fused=384)
    assert (t.param, t.kind, t.expert, t.shard) == (
        "model.layers.61.mtp_block.ffn.experts.routed_experts.w2_weight",
        "expert",
        384,
        "w2",
    )
    with pytest.raises(KeyError, match="mtp.1.e_proj.weight: MTP layer 1 is beyond num_nextn_predict_layers=1"):
        m("mtp.1.e_proj.weight", IN_TREE)


def _build(ckpt, dtype="float32"):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_mtp.model.deepseek_v4 import DeepseekV4ForCausalLM

    cfg = EngineArgs(
        model=str(ckpt), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=512
    ).create_engine_config()
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
    return {
        kind: build_tiny_checkpoint(root / kind, seed=0, **kw, tokenizer=False)
        for kind, kw in {
            "bf16": {},
            "mxfp4": {"experts": "mxfp4"},
            "official": {"experts": "fp4-official", "linears": "fp8"},
            "fse": {"experts": "mxfp4", "shared_experts": "mxfp4"},
        }.items()
    }


@pytest.mark.usefixtures("vllm_dist")
def test_bf16_checkpoint_loads_every_tensor(ckpts):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    loaded = model.load_weights(tensors.items())
    assert loaded == {n for n, _ in model.named_parameters()}
    p = dict(model.named_parameters())
    q_lora = 64
    assert torch.equal(
        p["model.layers.1.attn.fused_wqa_wkv.weight"][:q_lora], tensors["layers.1.attn.wq_a.weight"].float()
    )
    assert torch.equal(p["model.layers.0.ffn.gate.tid2eid"], tensors["layers.0.ffn.gate.tid2eid"].int())
    assert torch.equal(
        p["model.layers.1.ffn.experts.w13_weight"][3, 64:], tensors["layers.1.ffn.experts.3.w3.weight"].float()
    )


def _decoded(tensors, name, scale_suffix, dtype):
    from vllm_dsv4_mtp.formats import mxfp4

    return mxfp4.dequantize(
        tensors[name + ".weight"].view(torch.uint8), tensors[name + scale_suffix].view(torch.uint8), dtype=dtype
    )


@pytest.mark.usefixtures("vllm_dist")
def test_official_layout_decodes_to_the_bf16_weights(ckpts):
    """FP8 linears decode (exact block scales) to within FP8 rounding of the BF16 source; FP4 experts equal the
    exact decode of their bytes (int8 codes, F8_E8M0 scales read as raw bytes), weight-only (W4A16)."""
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

    model = _build(ckpts["official"], dtype="bfloat16")
    tensors = _tensors(ckpts["official"])
    model.load_weights(tensors.items())
    p = dict(model.named_parameters())
    wq_b = dequantize_block_fp8(tensors["layers.2.attn.wq_b.weight"], tensors["layers.2.attn.wq_b.scale"])
    assert torch.equal(p["model.layers.2.attn.wq_b.weight"], wq_b)
    src = _tensors(ckpts["bf16"])["layers.2.attn.wq_b.weight"].float()
    assert (wq_b.float() - src).abs().max() <= src.abs().max() / 8  # e4m3: 3 mantissa bits
    assert torch.equal(
        p["model.layers.3.ffn.experts.w2_weight"][5],
        _decoded(tensors, "layers.3.ffn.experts.5.w2", ".scale", torch.bfloat16),
    )
    assert model.describe()["expert_activation_quant"] == [False] * 4


@pytest.mark.usefixtures("vllm_dist")
def test_quark_mxfp4_checkpoint_loads(ckpts):
    model = _build(ckpts["mxfp4"], dtype="bfloat16")
    tensors = _tensors(ckpts["mxfp4"])
    model.load_weights(tensors.items())
    p = dict(model.named_parameters())
    assert torch.equal(
        p["model.layers.1.ffn.experts.w13_weight"][2, :64],
        _decoded(tensors, "layers.1.ffn.experts.2.w1", ".weight_scale", torch.bfloat16),
    )
    assert model.describe()["expert_activation_quant"] == [True] * 4


@pytest.mark.parametrize(
    "breakage,message",
    [
        ("drop", r"layers\.2\.attn\.compressor\.ape: tensor missing from the checkpoint"),
        ("reshape", r"layers\.1\.attn\.wo_b\.weight: expected shape \(128, 64\), got \(128, 63\)"),
        ("unknown", r"layers\.1\.attn\.bogus\.weight: unexpected tensor for this config"),
        ("nan", r"layers\.1\.attn\.wo_b\.weight: 1 non-finite value\(s\) \(NaN or Inf\); the checkpoint is corrupt"),
        ("ids", r"layers\.0\.ffn\.gate\.tid2eid: expert ids must lie in \[0, 8\)"),
        ("dtype", r"hc_head_fn: stored as torch\.bfloat16, expected F32 \(the DeepSeek-V4 layout\)"),
    ],
)
@pytest.mark.usefixtures("vllm_dist")
def test_bad_checkpoints_are_errors_naming_the_tensor(ckpts, breakage, message):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    if breakage == "drop":
        del tensors["layers.2.attn.compressor.ape"]
    elif breakage == "reshape":
        tensors["layers.1.attn.wo_b.weight"] = tensors["layers.1.attn.wo_b.weight"][:, :63]
    elif breakage == "nan":
        tensors["layers.1.attn.wo_b.weight"] = tensors["layers.1.attn.wo_b.weight"].clone()
        tensors["layers.1.attn.wo_b.weight"][3, 5] = float("nan")
    elif breakage == "dtype":
        tensors["hc_head_fn"] = tensors["hc_head_fn"].bfloat16()
    elif breakage == "ids":
        tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"] + 8
    else:
        tensors["layers.1.attn.bogus.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=message):
        model.load_weights(tensors.items())


@pytest.mark.usefixtures("vllm_dist")
def test_fp8_weight_without_scale_is_an_error(ckpts):
    model = _build(ckpts["official"], dtype="bfloat16")
    tensors = _tensors(ckpts["official"])
    del tensors["layers.0.attn.wo_a.scale"]
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.attn\.wo_a\.weight: quantized weight \(torch\.float8_e4m3fn\) "
        r"without its scale \(\.scale / \.weight_scale\) in the checkpoint",
    ):
        model.load_weights(tensors.items())


@pytest.mark.usefixtures("vllm_dist")
def test_mxfp4_expert_without_scale_is_an_error(ckpts):
    model = _build(ckpts["mxfp4"], dtype="bfloat16")
    tensors = _tensors(ckpts["mxfp4"])
    del tensors["layers.3.ffn.experts.6.w1.weight_scale"]
    with pytest.raises(
        ValueError,
        match=r"layers\.3\.ffn\.experts\.6\.w1\.weight: quantized weight \(torch\.uint8\) "
        r"without its scale",
    ):
        model.load_weights(tensors.items())


@pytest.mark.usefixtures("vllm_dist")
def test_mtp_tensors_are_skipped_on_purpose(ckpts):
    model = _build(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    assert any(n.startswith("mtp.0.") for n in tensors)
    tensors["mtp.0.bogus"] = torch.zeros(1)  # even nonsense under mtp.* belongs to the draft, not the target
    model.load_weights(tensors.items())


@pytest.mark.usefixtures("vllm_dist")
def test_mxfp4_shared_experts_fse_layout(ckpts):
    """The AMD export's main-layer shared experts are MXFP4 (packed + E8M0): decoded exactly at load and run with
    the W4A4 activation rounding of the routed experts."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.model.experts import swiglu_clamped

    model = _build(ckpts["fse"], dtype="bfloat16")
    tensors = _tensors(ckpts["fse"])
    assert tensors["layers.1.ffn.shared_experts.w2.weight"].dtype == torch.uint8
    model.load_weights(tensors.items())
    assert model.describe()["shared_activation_quant"] == [True] * 4
    shared = model.model.layers[1].ffn.shared_experts
    dq = {
        s: _decoded(tensors, f"layers.1.ffn.shared_experts.{s}", ".weight_scale", torch.bfloat16)
        for s in ("w1", "w2", "w3")
    }
    assert torch.equal(shared.down_proj.weight, dq["w2"])
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    xq = mxfp4.fake_quant(x)
    want = mxfp4.fake_quant(swiglu_clamped(xq @ dq["w1"].T, xq @ dq["w3"].T, 10.0)) @ dq["w2"].T
    # what vLLM's loader does after load_weights: per layer, then the model's hook (the GEMMs)
    process_weights_after_loading(model, model.vllm_config.model_config, torch.device("cpu"))
    torch.testing.assert_close(shared(x), want, atol=0, rtol=0)


@pytest.mark.usefixtures("vllm_dist")
@pytest.mark.parametrize("native", [False, True])
def test_every_vllm_linear_of_the_model_takes_the_cpus_gemm_route(ckpts, native, monkeypatch):
    """A bf16 model after vLLM's post-load step (its per-layer processing, then the model's hook, the stage
    ``prepare_weights``): on a CPU without a 16-bit GEMM every vLLM linear layer of the target (attention
    projections, compressors, indexers, shared experts) computes through the float32 copy of exactly its loaded
    weight; on one with it none has a copy and each computes what vLLM's own dispatch computes. Every loaded
    weight stays as loaded."""
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_dsv4_mtp.cpu.kit import KIT

    monkeypatch.setattr(KIT, "native_gemm", lambda d: native)
    model = _build(ckpts["bf16"], dtype="bfloat16")
    model.load_weights(_tensors(ckpts["bf16"]).items())
    loaded = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, LinearBase)}
    process_weights_after_loading(model, model.vllm_config.model_config, torch.device("cpu"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    kinds = {n.rsplit(".", 1)[-1] for n in linears}
    assert {"fused_wqa_wkv", "wq_b", "wo_b", "fused_wkv_wgate", "weights_proj", "gate_up_proj", "down_proj"} <= kinds
    for name, m in linears.items():
        w = loaded[name]
        assert w.dtype == torch.bfloat16 and torch.equal(m.weight, w), name
        xk = torch.randn(3, w.shape[1]).to(torch.bfloat16)
        if native:
            assert m.float32_weight is None, name
        else:
            assert torch.equal(m.float32_weight, w.float()), name
            assert torch.equal(m.gemm(xk), F.linear(xk.float(), w.float()).to(torch.bfloat16)), name


@pytest.mark.usefixtures("vllm_dist")
def test_weights_written_in_place_after_preparing_are_prepared_again_before_a_forward(ckpts, monkeypatch):
    """vLLM's ``reload_weights(is_checkpoint_format=False)`` copies new tensors straight into the parameters and
    calls nothing of the model (in vLLM 0.32 it stops at the first RMSNorm weight, which requires grad; a vLLM
    that copied under ``no_grad`` would get through). ``ensure_prepared``, at the top of the model's forward,
    sees the writes (torch counts each in-place write), prepares again with one warning, and the GEMMs and packs
    then compute with the new values; with no write it does nothing."""
    import logging

    import torch.nn.functional as F
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_dsv4_mtp.cpu.kit import KIT
    from vllm_dsv4_mtp.cpu.linear import ensure_prepared

    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)  # the float32 route: a copy that would go stale
    model = _build(ckpts["bf16"], dtype="bfloat16")
    model.load_weights(_tensors(ckpts["bf16"]).items())
    process_weights_after_loading(model, model.vllm_config.model_config, torch.device("cpu"))
    layer = model.model.layers[0].attn.wq_b
    experts = model.model.layers[0].ffn.experts
    x = torch.randn(3, layer.weight.shape[1]).to(torch.bfloat16)
    old_gemm, old_slices = layer.gemm, experts._packed
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("vllm.dsv4_mtp.cpu_kit").addHandler(handler)
    try:
        ensure_prepared(model)
        assert records == [] and layer.gemm is old_gemm and experts._packed is old_slices
        new = torch.randn(layer.weight.shape).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(new)
            experts.w13_weight.copy_(experts.w13_weight * 2)
        assert torch.equal(old_gemm(x), F.linear(x.float(), layer.float32_weight).to(torch.bfloat16))
        ensure_prepared(model)
        ensure_prepared(model)
    finally:
        logging.getLogger("vllm.dsv4_mtp.cpu_kit").removeHandler(handler)
    assert len(records) == 1 and "written in place since they were prepared" in records[0], records
    assert torch.equal(layer.gemm(x), F.linear(x.float(), new.float()).to(torch.bfloat16))
    assert experts._packed is not old_slices
    xe = torch.randn(2, experts.w13_weight.shape[2]).to(torch.bfloat16)
    assert torch.equal(experts._packed.up[0](xe), F.linear(xe.float(), experts.w13_weight[0].float()).to(xe.dtype))
