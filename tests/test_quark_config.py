"""Quark ``quantization_config``: the writer (as the AMD export writes it), matching, validation, and the two
consumers that are not ours: amd-quark's own config classes and vLLM's ``QuarkConfig``."""

from __future__ import annotations

import copy
import json

import pytest

from vllm_dsv4_mtp.formats.quark_config import (
    QuarkConfigError,
    QuarkQuantConfig,
    fp8_block_layer_config,
    module_name,
    mxfp4_experts_config,
    pattern_matches,
)

# A DeepSeek-V4-shaped exclude list as the quantizer writes it: every linear not stored MXFP4, MTP included.
EXCLUDE = [
    "head",
    "layers.0.attn.wq_a",
    "layers.0.attn.wkv",
    "layers.0.ffn.gate",
    "layers.0.ffn.shared_experts.w1",
    "mtp.0.e_proj",
    "mtp.0.h_proj",
    "mtp.0.attn.wq_a",
    "mtp.0.ffn.gate",
    "mtp.0.ffn.experts.0.w1",
    "mtp.0.ffn.experts.0.w2",
    "mtp.0.ffn.experts.0.w3",
    "mtp.0.ffn.experts.1.w1",
    "mtp.0.ffn.experts.1.w2",
    "mtp.0.ffn.experts.1.w3",
    "mtp.0.ffn.shared_experts.w1",
]


def test_writer_is_the_amd_export_layout():
    d = mxfp4_experts_config(list(reversed(EXCLUDE)))
    assert list(d) == [
        "global_quant_config",
        "exclude",
        "algo_config",
        "softmax_quant_spec",
        "quant_method",
        "layer_type_quant_config",
        "layer_quant_config",
        "kv_cache_quant_config",
        "kv_cache_post_rope",
        "quant_mode",
        "version",
        "export",
    ]
    assert d["exclude"] == sorted(EXCLUDE)
    assert d["quant_method"] == "quark" and d["quant_mode"] == "eager_mode" and d["version"] == "0.13"
    assert d["export"] == {
        "kv_cache_group": [],
        "min_kv_scale": 0.0,
        "pack_method": "reorder",
        "weight_format": "real_quantized",
        "weight_merge_groups": None,
    }
    g = d["global_quant_config"]
    assert g["output_tensors"] is None and g["bias"] is None and g["target_device"] is None
    for key, dynamic in (("weight", False), ("input_tensors", True)):
        spec = g[key]
        assert spec["dtype"] == "fp4" and spec["qscheme"] == "per_group" and spec["group_size"] == 32
        assert spec["ch_axis"] == -1 and spec["scale_format"] == "e8m0" and spec["scale_type"] == "float"
        assert spec["scale_calculation_mode"] == "even" and spec["round_method"] == "half_even"
        assert spec["observer_cls"] == "PerBlockMXObserver" and spec["is_dynamic"] is dynamic
    # JSON-serialisable and stable through a round trip
    assert json.loads(json.dumps(d)) == d
    assert QuarkQuantConfig.from_dict(json.loads(json.dumps(d))).to_dict() == d


def test_spec_for_and_exclude_on_native_names():
    q = QuarkQuantConfig.from_dict(mxfp4_experts_config(EXCLUDE))
    assert q.spec_for("layers.3.ffn.experts.7.w1") == "mxfp4"
    assert q.spec_for("layers.3.ffn.experts.7.w2.weight") == "mxfp4"  # tensor names work too
    assert q.spec_for("layers.3.ffn.experts.7.w3.weight_scale") == "mxfp4"
    assert q.spec_for("mtp.0.ffn.experts.1.w3.weight") is None  # the MTP layer stays BF16
    assert q.is_excluded("mtp.0.e_proj") and q.is_excluded("mtp.0.e_proj.weight")
    assert q.is_excluded("head.weight") and q.spec_for("head") is None
    assert q.is_excluded("layers.0.ffn.gate.bias")
    assert not q.is_excluded("layers.0.ffn.experts.0.w1")
    assert not q.is_excluded("layers.0.attn.wq_b")  # not listed -> the global scheme applies
    assert q.spec_for("layers.0.attn.wq_b") == "mxfp4"


def test_pattern_kinds():
    assert module_name("layers.1.attn.wq_a.scale") == "layers.1.attn.wq_a"
    assert module_name("hc_head_fn") == "hc_head_fn"
    assert pattern_matches("mtp.0.e_proj", "mtp.0.e_proj")
    assert not pattern_matches("mtp.0.e_proj", "mtp.0.e_proj2")
    assert not pattern_matches("mtp.0", "mtp.0.e_proj")  # exact names are exact, not prefixes
    assert pattern_matches("mtp.*", "mtp.0.ffn.experts.3.w1")
    assert pattern_matches("*shared_experts*", "layers.2.ffn.shared_experts.w2")
    assert not pattern_matches("*attn*", "layers.2.ffn.gate")
    assert pattern_matches(r"re:mtp\.0\.ffn\.experts\.\d+\.w1", "mtp.0.ffn.experts.17.w1")
    assert not pattern_matches(r"re:mtp\.0\.ffn\.experts\.\d+\.w1", "layers.0.ffn.experts.17.w1")
    q = QuarkQuantConfig.from_dict(mxfp4_experts_config(["mtp.*", r"re:layers\.\d+\.attn\.", "head"]))
    assert q.is_excluded("mtp.0.hnorm.weight") and q.is_excluded("layers.12.attn.wo_b.weight")
    assert not q.is_excluded("layers.12.ffn.experts.0.w1.weight")


def test_layer_quant_config_patterns_and_fp8_entries():
    layers = {
        "layers.0.attn.wq_a": fp8_block_layer_config(),
        r"re:mtp\.0\.ffn\.experts\.\d+\.w[123]": mxfp4_experts_config([])["global_quant_config"],
        "*shared_experts*": fp8_block_layer_config("float32"),
    }
    q = QuarkQuantConfig.from_dict(mxfp4_experts_config(["head"], layer_quant_config=layers))
    assert q.spec_for("layers.0.attn.wq_a.weight") == "fp8-block"
    assert q.spec_for("layers.0.attn.wkv") == "mxfp4"  # falls back to the global config
    assert q.spec_for("mtp.0.ffn.experts.5.w2") == "mxfp4"
    assert q.spec_for("layers.4.ffn.shared_experts.w1") == "fp8-block"
    assert q.layer_config_for("layers.4.ffn.shared_experts.w1")["weight"]["scale_type"] == "float32"
    # a scheme the project cannot serve is an error naming where it comes from
    bad = copy.deepcopy(layers)
    bad["layers.0.attn.wq_a"]["weight"]["block_size"] = [64, 64]
    q2 = QuarkQuantConfig.from_dict(mxfp4_experts_config([], layer_quant_config=bad), source="ck/config.json")
    with pytest.raises(
        QuarkConfigError,
        match=r"ck/config\.json: quantization_config\.layer_quant_config\["
        r"'layers\.0\.attn\.wq_a'\]\.weight \(for layers\.0\.attn\.wq_a"
        r"\.weight\): fp8_e4m3 per_block weights need block_size",
    ):
        q2.spec_for("layers.0.attn.wq_a.weight")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(quant_method="fp8"), r"quantization_config\.quant_method: expected 'quark', got 'fp8'"),
        (lambda d: d.pop("export"), r"quantization_config\.export: missing"),
        (lambda d: d["export"].update(pack_method=None), r"quantization_config\.export\.pack_method"),
        (lambda d: d.update(exclude="head"), r"quantization_config\.exclude: expected a list"),
        (lambda d: d["exclude"].append(3), r"quantization_config\.exclude\[\d+\]: expected a string"),
        (lambda d: d["exclude"].append("re:mtp(["), r"quantization_config\.exclude\[\d+\]: invalid regular"),
        (
            lambda d: d["global_quant_config"]["weight"].update(group_size=16),
            r"quantization_config\.global_quant_config\.weight\.group_size: OCP MXFP4 .* groups of 32",
        ),
        (
            lambda d: d["global_quant_config"]["input_tensors"].update(dtype="fp5"),
            r"quantization_config\.global_quant_config\.input_tensors\.dtype: unknown dtype 'fp5'",
        ),
        (
            lambda d: d["global_quant_config"]["weight"].update(qscheme="per_row"),
            r"quantization_config\.global_quant_config\.weight\.qscheme",
        ),
        (
            lambda d: d["global_quant_config"]["weight"].update(is_dynamic="no"),
            r"quantization_config\.global_quant_config\.weight\.is_dynamic",
        ),
        (
            lambda d: d.update(layer_quant_config={"layers.0.attn.wq_a": "fp8"}),
            r"quantization_config\.layer_quant_config\['layers\.0\.attn\.wq_a'\]: expected an object",
        ),
        (
            lambda d: d.update(
                layer_quant_config={"x": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": None}}}
            ),
            r"quantization_config\.layer_quant_config\['x'\]\.weight\.block_size",
        ),
        (lambda d: d.update(layer_type_quant_config=[]), r"quantization_config\.layer_type_quant_config"),
    ],
)
def test_validation_errors_name_the_field(mutate, field):
    d = mxfp4_experts_config(EXCLUDE)
    mutate(d)
    with pytest.raises(QuarkConfigError, match=r"^ckpt/config\.json: " + field):
        QuarkQuantConfig.from_dict(d, source="ckpt/config.json")


def test_not_an_object():
    with pytest.raises(QuarkConfigError, match=r"^c\.json: quantization_config: expected an object, got list"):
        QuarkQuantConfig.from_dict([], source="c.json")


# ----------------------------------------------------------------------------------------------------------
# amd-quark's own config classes
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quark_config_api():
    """amd-quark's config classes (the `quant` extra, which `make setup` installs; missing = failure, not a skip)."""
    import quark.torch  # noqa: F401
    from quark.torch import LLMTemplate
    from quark.torch.quantization.config.config import QConfig, QLayerConfig

    return LLMTemplate, QConfig, QLayerConfig


@pytest.mark.quark
def test_writer_equals_quarks_own_deepseek_v4_mxfp4_config(quark_config_api):
    LLMTemplate, QConfig, QLayerConfig = quark_config_api
    qc = LLMTemplate.get("deepseek_v4").get_config(scheme="mxfp4", exclude_layers=list(EXCLUDE))
    quark_dict = qc.to_dict()
    # what Quark's exporters add / resolve (file2file_quantization._export_quant_config)
    quark_dict["export"] = {
        "kv_cache_group": [],
        "min_kv_scale": 0.0,
        "pack_method": "reorder",
        "weight_format": "real_quantized",
        "weight_merge_groups": None,
    }
    quark_dict["exclude"] = sorted(qc.exclude)
    ours = mxfp4_experts_config(EXCLUDE)
    assert json.dumps(ours) == json.dumps(quark_dict)  # same content, same key order
    # and Quark parses ours back into the same configuration
    assert QConfig.from_dict({k: v for k, v in ours.items() if k != "export"}).to_dict() == qc.to_dict() | {
        "exclude": sorted(EXCLUDE)
    }


@pytest.mark.quark
def test_fp8_layer_entry_equals_quarks(quark_config_api):
    _, _, QLayerConfig = quark_config_api
    ours = fp8_block_layer_config()
    assert QLayerConfig.from_dict(ours).to_dict() == ours


# ----------------------------------------------------------------------------------------------------------
# vLLM's QuarkConfig accepts the written config
# ----------------------------------------------------------------------------------------------------------


def test_vllm_quark_config_accepts_it():
    from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig, QuarkLinearMethod
    from vllm.model_executor.layers.quantization.quark.quark_moe import QuarkOCP_MX_MoEMethod
    from vllm.model_executor.layers.quantization.quark.schemes import QuarkW8A8Fp8PerBlock

    d = mxfp4_experts_config(EXCLUDE, layer_quant_config={"layers.1.attn.wq_a": fp8_block_layer_config()})
    cfg = QuarkConfig.from_config(json.loads(json.dumps(d)))
    assert cfg.get_name() == "quark"

    # routed experts of a main layer: OCP MX W4A4 (weights static MXFP4, activations dynamic MXFP4)
    wkey, akey, method = cfg.get_quant_method_target("layers.1.ffn.experts", RoutedExperts)
    assert method is QuarkOCP_MX_MoEMethod
    assert "u8" in str(wkey) and "GroupShape(row=1, col=32)" in str(wkey) and "static" in str(wkey)
    assert akey is not None and "dynamic" in str(akey) and "col=32" in str(akey)
    assert cfg._is_w_ocp_mx_a_x(d["global_quant_config"]["weight"], d["global_quant_config"]["input_tensors"])

    # the MTP layer: its experts and linears are excluded -> unquantized (BF16)
    assert cfg.get_quant_method_target("mtp.0.ffn.experts", RoutedExperts)[2] is UnquantizedFusedMoEMethod
    for name in ("mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.ffn.shared_experts.w1"):
        assert cfg.get_quant_method_target(name, LinearBase)[2] is UnquantizedLinearMethod, name
    assert cfg.get_quant_method_target("head", LinearBase)[2] is UnquantizedLinearMethod

    # an FP8 layer kept from an FP8 source: vLLM's 128x128 block FP8 scheme with E8M0 scales
    assert cfg.get_quant_method_target("layers.1.attn.wq_a", LinearBase)[2] is QuarkLinearMethod
    wkey, akey, scheme = cfg.get_scheme_cls(LinearBase, "layers.1.attn.wq_a")
    assert scheme is QuarkW8A8Fp8PerBlock
    assert "e8m0" in str(wkey).lower() or "E8M0" in repr(wkey)
