"""DeepseekV4Spec parsing/validation and the native tensor table (vllm_dsv4_mtp.config)."""

from __future__ import annotations

import copy
import json

import pytest

from vllm_dsv4_mtp.config import (
    ConfigError,
    DeepseekV4Spec,
    expected_tensors,
    parameter_count,
    weight_slots,
)
from vllm_dsv4_mtp.tools.tiny import tiny_config

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# deepseek-ai/DeepSeek-V4-Flash config.json (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json)
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": YARN,
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_hash_layers": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "expert_dtype": "fp4",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
}
# deepseek-ai/DeepSeek-V4-Pro: the Flash keys with the Pro values
PRO = {
    **FLASH,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    "index_topk": 1024,
    "n_routed_experts": 384,
    "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5,
}


def _schedule(spec: DeepseekV4Spec) -> dict[int, int]:
    counts: dict[int, int] = {}
    for i in range(spec.num_hidden_layers):
        counts[spec.compress_ratio(i)] = counts.get(spec.compress_ratio(i), 0) + 1
    return counts


def test_flash_config_parses_with_the_documented_schedule():
    s = DeepseekV4Spec.from_dict(FLASH)
    assert len(s.compress_ratios) == 44
    assert _schedule(s) == {0: 2, 4: 21, 128: 20}
    assert s.compress_ratio(43) == 0 and s.is_mtp_layer(43) and s.layer_prefix(43) == "mtp.0."
    assert [s.is_hash_layer(i) for i in range(5)] == [True, True, True, False, False]
    assert not s.is_hash_layer(43)
    assert s.hc_mix == 24 and s.hc_dim == 16384 and s.o_group_in_dim == 4096
    assert (
        s.has_indexer(2)
        and s.compressor_blocks_per_entry(2) == 2
        and not s.has_indexer(3)
        and s.compressor_blocks_per_entry(3) == 1
    )
    assert s.quantization_config["quant_method"] == "fp8"


def test_pro_config_parses_with_the_documented_schedule():
    s = DeepseekV4Spec.from_dict(PRO)
    assert len(s.compress_ratios) == 62
    assert _schedule(s) == {4: 30, 128: 31}  # no SWA-only main layer in Pro
    assert s.compress_ratio(61) == 0  # the MTP layer is SWA
    assert s.routed_scaling_factor == 2.5 and s.index_topk == 1024


def test_flash_tensor_table_matches_the_release():
    """69,187 tensors in the Flash release (46 shards), 1,575 of them mtp.*; shapes of the release's safetensors
    index."""
    s = DeepseekV4Spec.from_dict(FLASH)
    t = expected_tensors(s, "fp4-official", linears="fp8")
    assert len(t) == 69187
    assert sum(k.startswith("mtp.") for k in t) == 1575
    shapes = {
        "embed.weight": ((129280, 4096), "BF16"),
        "hc_head_fn": ((4, 16384), "F32"),
        "layers.3.hc_attn_fn": ((24, 16384), "F32"),
        "layers.3.hc_ffn_scale": ((3,), "F32"),
        "layers.3.attn.wq_a.weight": ((1024, 4096), "F8_E4M3"),
        "layers.3.attn.wq_a.scale": ((8, 32), "F8_E8M0"),
        "layers.3.attn.wq_b.scale": ((256, 8), "F8_E8M0"),
        "layers.3.attn.wo_a.weight": ((8192, 4096), "F8_E4M3"),
        "layers.3.attn.wo_b.scale": ((32, 64), "F8_E8M0"),
        "layers.3.attn.attn_sink": ((64,), "F32"),
        "layers.2.attn.compressor.wkv.weight": ((1024, 4096), "BF16"),
        "layers.2.attn.compressor.ape": ((4, 1024), "F32"),
        "layers.3.attn.compressor.wgate.weight": ((512, 4096), "BF16"),
        "layers.3.attn.compressor.ape": ((128, 512), "F32"),
        "layers.2.attn.indexer.wq_b.weight": ((8192, 1024), "F8_E4M3"),
        "layers.2.attn.indexer.wq_b.scale": ((64, 8), "F8_E8M0"),
        "layers.2.attn.indexer.weights_proj.weight": ((64, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.wkv.weight": ((256, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), "F32"),
        "layers.2.attn.indexer.compressor.norm.weight": ((128,), "BF16"),
        "layers.0.ffn.gate.tid2eid": ((129280, 6), "I64"),
        "layers.3.ffn.gate.bias": ((256,), "F32"),
        "layers.3.ffn.experts.7.w1.weight": ((2048, 2048), "I8"),
        "layers.3.ffn.experts.7.w1.scale": ((2048, 128), "F8_E8M0"),
        "layers.3.ffn.experts.7.w2.weight": ((4096, 1024), "I8"),
        "layers.3.ffn.experts.7.w2.scale": ((4096, 64), "F8_E8M0"),
        "layers.3.ffn.shared_experts.w1.scale": ((16, 32), "F8_E8M0"),
        "layers.3.ffn.shared_experts.w2.scale": ((32, 16), "F8_E8M0"),
        "mtp.0.e_proj.weight": ((4096, 4096), "F8_E4M3"),
        "mtp.0.e_proj.scale": ((32, 32), "F8_E8M0"),
        "mtp.0.hc_head_fn": ((4, 16384), "F32"),
        "mtp.0.ffn.gate.bias": ((256,), "F32"),
    }
    for name, (shape, dtype) in shapes.items():
        assert t[name].shape == shape, name
        assert dtype in t[name].dtypes, name
    # the MTP block is SWA and bias-routed: no compressor, indexer or tid2eid
    assert not [k for k in t if k.startswith("mtp.0.attn.compressor") or k.startswith("mtp.0.attn.indexer")]
    assert "mtp.0.ffn.gate.tid2eid" not in t
    # no `.weight_scale` in the official layout, and every FP8/FP4 weight has its scale
    assert not [k for k in t if k.endswith(".weight_scale")]
    assert sum(k.endswith(".scale") and not k.endswith("hc_head_scale") and "hc_" not in k for k in t) == sum(
        v.dtypes in (("F8_E4M3",), ("I8",)) for v in t.values()
    )


def test_parameter_counts_match_the_derived_sizes():
    """The model cards: Flash 284.3B main + 6.6B MTP; Pro 1573B main + 25.8B MTP."""
    for cfg, main, mtp in ((FLASH, 284.3, 6.6), (PRO, 1573, 25.8)):
        slots = weight_slots(DeepseekV4Spec.from_dict(cfg)).values()
        n_main = parameter_count(s.shape for s in slots if not s.is_mtp) / 1e9
        n_mtp = parameter_count(s.shape for s in slots if s.is_mtp) / 1e9
        assert abs(n_main - main) / main < 0.002, n_main
        assert abs(n_mtp - mtp) / mtp < 0.01, n_mtp


def test_quark_mxfp4_table_names_and_shapes():
    s = DeepseekV4Spec.from_dict(tiny_config())
    t = expected_tensors(s, "mxfp4", linears="fp8", mtp_experts="bf16", mtp_linears="bf16")
    w = t["layers.1.ffn.experts.3.w1.weight"]
    assert (w.shape, w.dtypes, w.precision) == ((64, 64), ("U8",), "mxfp4")  # [I, D/2]
    sc = t["layers.1.ffn.experts.3.w2.weight_scale"]
    assert (sc.shape, sc.role) == ((128, 2), "scale")  # [D, I/32]
    assert t["layers.1.attn.wq_b.weight_scale"].shape == (4, 1)  # ceil(512/128), ceil(64/128)
    assert "layers.1.attn.wq_b.scale" not in t
    assert t["mtp.0.ffn.experts.0.w1.weight"].dtypes == ("BF16",) and "mtp.0.ffn.experts.0.w1.weight_scale" not in t
    assert t["mtp.0.e_proj.weight"].dtypes == ("BF16",)
    assert not [k for k in expected_tensors(s, mtp=False) if k.startswith("mtp.")]


def test_general_ratios_are_accepted():
    """Any ratio >= 2 is valid maths: only 4 overlaps and carries the indexer."""
    s = DeepseekV4Spec.from_dict(tiny_config(compress_ratios=[0, 4, 8, 0]))
    assert s.num_hidden_layers == 3
    assert [s.compress_ratio(i) for i in range(4)] == [0, 4, 8, 0]
    assert s.has_compressor(2) and not s.is_overlapping(2) and s.compressor_blocks_per_entry(2) == 1
    t = expected_tensors(s)
    assert t["layers.2.attn.compressor.ape"].shape == (8, 128)
    assert "layers.2.attn.indexer.wq_b.weight" not in t
    assert s.hf_layer_schedule() == {
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    }


def _bad(**changes):
    d = copy.deepcopy(tiny_config())
    for k, v in changes.items():
        if v is _DEL:
            del d[k]
        else:
            d[k] = v
    return d


_DEL = object()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": _DEL}, "x.json: missing required field 'hidden_size'"),
        (
            {"compress_ratios": _DEL, "layer_types": ["sliding_attention"] * 4},
            "x.json: missing required field 'compress_ratios' (HF's 'layer_types' is not enough: the native "
            "per-layer 'compress_ratios' is required)",
        ),
        ({"hidden_size": "128"}, "x.json: field 'hidden_size' must be an integer, got '128'"),
        ({"num_hidden_layers": True}, "x.json: field 'num_hidden_layers' must be an integer, got True"),
        ({"routed_scaling_factor": None}, "x.json: field 'routed_scaling_factor' must be a number, got None"),
        (
            {"compress_ratios": [0, 4, 128, 4]},
            "x.json: field 'compress_ratios' has 4 entries, expected num_hidden_layers + num_nextn_predict_layers = "
            "4 + 1 = 5 (one per main layer, then one per MTP layer)",
        ),
        (
            {"compress_ratios": [0, 4, 1, 4, 0]},
            "x.json: field 'compress_ratios[2]' = 1: must be 0 (sliding window only) or a compression ratio >= 2",
        ),
        ({"compress_ratios": [0, 4, 2.5, 4, 0]}, "x.json: field 'compress_ratios[2]' must be an integer, got 2.5"),
        (
            {"compress_ratios": [0, 4, 128, 4, 4]},
            "x.json: field 'compress_ratios[4]' = 4 belongs to MTP layer 0, which is sliding-window only: it must be 0",
        ),
        (
            {"n_shared_experts": 2},
            "x.json: field 'n_shared_experts' must be 1 (DeepSeek-V4 has exactly one shared expert), got 2",
        ),
        ({"num_key_value_heads": 4}, "x.json: field 'num_key_value_heads' must be 1 (one shared latent KV), got 4"),
        ({"o_groups": 3}, "x.json: field 'num_attention_heads' (4) must be divisible by 'o_groups' (3)"),
        (
            {"qk_rope_head_dim": 128},
            "x.json: field 'qk_rope_head_dim' (128) must be even and smaller than 'head_dim' (128): the rope part is "
            "the last qk_rope_head_dim dims of a head",
        ),
        ({"num_experts_per_tok": 9}, "x.json: field 'num_experts_per_tok' (9) must be <= 'n_routed_experts' (8)"),
        ({"num_hash_layers": 5}, "x.json: field 'num_hash_layers' (5) must be <= 'num_hidden_layers' (4)"),
        (
            {"topk_method": "greedy"},
            "x.json: field 'topk_method' must be 'noaux_tc' (score-routed layers carry ffn.gate.bias, used for "
            "selection only), got 'greedy'",
        ),
        (
            {"tie_word_embeddings": True},
            "x.json: field 'tie_word_embeddings' must be false: DeepSeek-V4 stores embed.weight and head.weight "
            "separately",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 16}},
            "x.json: missing required field 'rope_scaling.original_max_position_embeddings'",
        ),
        (
            {"rope_scaling": {**YARN, "type": "linear"}},
            "x.json: field 'rope_scaling.type' must be 'yarn' (YaRN on compressed layers), got 'linear'",
        ),
        (
            {"rope_scaling": {**YARN, "attention_factor": 0.5}},
            "x.json: field 'rope_scaling.attention_factor' must be 1.0 for DeepSeek-V4, got 0.5",
        ),
        ({"vocab_size": 0}, "x.json: field 'vocab_size' must be > 0, got 0"),
        (
            {
                "layer_types": [
                    "sliding_attention",
                    "compressed_sparse_attention",
                    "sliding_attention",
                    "compressed_sparse_attention",
                ]
            },
            "x.json: field 'layer_types[2]' = 'sliding_attention' (rate None) disagrees with "
            "'compress_ratios[2]' = 128",
        ),
        (
            {
                "layer_types": [
                    "sliding_attention",
                    "compressed_sparse_attention",
                    "heavily_compressed_attention",
                    "compressed_sparse_attention",
                ],
                "compress_rates": [4, 128],
            },
            "x.json: field 'compress_rates' must be an object (layer type -> rate), got [4, 128]",
        ),
    ],
)
def test_malformed_config_names_file_and_field(changes, message):
    with pytest.raises(ConfigError) as e:
        DeepseekV4Spec.from_dict(_bad(**changes), source="x.json")
    assert str(e.value) == message


def test_from_dir_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: config.json not found$"):
        DeepseekV4Spec.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: not valid JSON"):
        DeepseekV4Spec.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_bad(index_topk=_DEL)))
    with pytest.raises(ConfigError) as e:
        DeepseekV4Spec.from_dir(tmp_path)
    assert str(e.value) == f"{tmp_path}/config.json: missing required field 'index_topk'"
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    assert DeepseekV4Spec.from_dir(tmp_path).hidden_size == 128


def test_mtp_layers_are_swa_and_not_hash():
    s = DeepseekV4Spec.from_dict(tiny_config(num_hash_layers=4))
    assert all(s.is_hash_layer(i) for i in range(4))
    assert not s.is_hash_layer(4) and s.compress_ratio(4) == 0
    with pytest.raises(IndexError):
        s.compress_ratio(5)


def test_to_dict_round_trips():
    s = DeepseekV4Spec.from_dict(FLASH)
    assert DeepseekV4Spec.from_dict(s.to_dict()) == s


# ----------------------------------------------------------------------------------------------------------
# The table against HF transformers 5.19's own DeepSeek-V4 conversion (native names renamed at load).
# ----------------------------------------------------------------------------------------------------------
def _zeros_checkpoint(tmp_path, cfg, drop=()):
    import torch
    from safetensors.torch import save_file

    from vllm_dsv4_mtp.config import expected_tensors

    spec = DeepseekV4Spec.from_dict(cfg)
    dt = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}
    tensors = {
        n: torch.zeros(e.shape, dtype=dt[e.dtypes[0]]) for n, e in expected_tensors(spec).items() if n not in drop
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return spec


def _hf_load_info(path, spec):
    import torch
    from transformers import DeepseekV4ForCausalLM

    from vllm_dsv4_mtp.tools.tiny import hf_config

    torch.set_num_threads(1)
    hf_cfg = hf_config(path)
    assert list(hf_cfg.layer_types) == spec.hf_layer_schedule()["layer_types"]
    _, info = DeepseekV4ForCausalLM.from_pretrained(path, config=hf_cfg, dtype=torch.float32, output_loading_info=True)
    return info


@pytest.mark.parametrize("ratios", [[0, 4, 128, 4, 0], [0, 4, 8, 0]])
def test_table_matches_transformers_conversion(tmp_path, ratios):
    """Every non-MTP tensor of the table is what HF's DeepseekV4ForCausalLM loads: nothing missing,
    nothing unexpected, no shape mismatch (HF drops mtp.* by design)."""
    spec = _zeros_checkpoint(tmp_path, tiny_config(compress_ratios=ratios))
    info = _hf_load_info(tmp_path, spec)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_transformers_check_has_teeth(tmp_path):
    """The comparison above can fail: leaving out one table entry makes HF report it missing."""
    spec = _zeros_checkpoint(tmp_path, tiny_config(), drop={"layers.1.attn.indexer.compressor.ape"})
    info = _hf_load_info(tmp_path, spec)
    assert info["missing_keys"]
