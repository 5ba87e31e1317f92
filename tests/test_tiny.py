"""The tiny DeepSeek-V4 builder (vllm_dsv4_mtp.tools.tiny): structure, determinism, HF oracle, tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec, expected_tensors, parameter_count, weight_slots
from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
from vllm_dsv4_mtp.tools.tiny import TINY_CONFIG, build_tiny_checkpoint, hf_config, tiny_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


def _check_against_table(path, table):
    r = CheckpointReader(path)
    assert set(r.names()) == set(table), set(r.names()) ^ set(table)
    for name, exp in table.items():
        info = r.info(name)
        assert info.shape == exp.shape, name
        assert info.dtype in exp.dtypes, (name, info.dtype)
    return r


def test_default_config_covers_every_feature():
    spec = DeepseekV4Spec.from_dict(tiny_config())
    kinds = {spec.hf_layer_type(i) for i in range(spec.num_hidden_layers)}
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert [spec.compress_ratio(i) for i in range(5)] == [0, 4, 128, 4, 0]
    assert spec.is_hash_layer(0) and not spec.is_hash_layer(1)
    assert spec.num_mtp_layers == 1 and spec.compress_ratio(4) == 0
    assert spec.hc_mult == 4 and spec.qk_rope_head_dim == 64 and spec.o_groups > 1
    assert spec.index_topk < 16  # the indexer really selects in a few dozen tokens
    # overriding the ratios sets the layer count; an MTP-count override rebuilds the ratio list
    assert tiny_config(compress_ratios=[0, 4, 8, 0])["num_hidden_layers"] == 3
    assert tiny_config(num_nextn_predict_layers=0)["compress_ratios"] == [0, 4, 128, 4]
    assert TINY_CONFIG["compress_ratios"] == [0, 4, 128, 4, 0]  # overrides never leak into the default


def test_bf16_checkpoint_is_the_native_layout(bf16_dir):
    spec = DeepseekV4Spec.from_dir(bf16_dir)
    r = _check_against_table(bf16_dir, expected_tensors(spec))
    assert "quantization_config" not in r.config
    assert r.info("layers.0.ffn.gate.tid2eid").dtype == "I64"
    assert r.info("layers.1.ffn.gate.bias").dtype == "F32" and r.info("layers.1.hc_attn_fn").dtype == "F32"
    tid2eid = r.get("layers.0.ffn.gate.tid2eid")
    assert tid2eid.min() >= 0 and tid2eid.max() < spec.n_routed_experts
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
    assert len(set(tid2eid[:, 0].tolist())) == spec.n_routed_experts  # every expert is used
    assert sum(n.startswith("mtp.0.") for n in r) > 0 and not [n for n in r if n.startswith("mtp.0.attn.compressor")]
    n = parameter_count(s.shape for s in weight_slots(spec).values())
    assert n == sum(math.prod(i.shape) for i in r.tensors.values())


def test_same_seed_same_bytes_other_seed_differs(tmp_path, bf16_dir):
    again = CheckpointReader(build_tiny_checkpoint(tmp_path / "a", seed=0, tokenizer=False))
    other = CheckpointReader(build_tiny_checkpoint(tmp_path / "b", seed=1, tokenizer=False))
    ref = CheckpointReader(bf16_dir)
    for name in ("embed.weight", "layers.2.attn.compressor.ape", "mtp.0.e_proj.weight"):
        assert again.raw_bytes(name) == ref.raw_bytes(name)
        assert other.raw_bytes(name) != ref.raw_bytes(name)


def test_without_mtp_same_main_weights(tmp_path, bf16_dir):
    r = CheckpointReader(build_tiny_checkpoint(tmp_path, mtp=False, tokenizer=False))
    assert not [n for n in r if n.startswith("mtp.")]
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ref = CheckpointReader(bf16_dir)
    assert r.raw_bytes("head.weight") == ref.raw_bytes("head.weight")


def _hf_forward(path, n_tokens):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        path, config=hf_config(path), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0]


@pytest.mark.parametrize(
    "overrides, n_tokens",
    [
        ({}, 300),  # C128 emits 2 entries, the window wraps, C4 has 75 > index_topk candidates
        ({"compress_ratios": [0, 4, 8, 0], "sliding_window": 16, "index_topk": 4}, 64),
    ],
)
def test_loads_and_runs_in_transformers(tmp_path, bf16_dir, overrides, n_tokens):
    """The HF oracle loads every non-MTP tensor (renaming the native names itself) and gives sane logits:
    finite, O(1) spread, and not tied (many different argmax tokens)."""
    path = bf16_dir if not overrides else build_tiny_checkpoint(tmp_path, tiny_config(**overrides), tokenizer=False)
    logits = _hf_forward(path, n_tokens)
    assert logits.shape == (n_tokens, 512)
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 10
    assert logits.argmax(-1).unique().numel() > n_tokens // 4
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-3).float().mean() > 0.9  # no ties at the top


def test_tokenizer_files(bf16_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bf16_dir)
    assert len(tok) == 512 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    ids = tok("Ada has 12 apples.")["input_ids"]
    assert ids[0] == 0 and tok.decode(ids[1:]) == "Ada has 12 apples."
    assert max(ids) < 512


def test_tokenizer_loads_in_vllm_deepseek_v4_mode(bf16_dir):
    """vLLM 0.32 forces tokenizer_mode='deepseek_v4' for DeepseekV4ForCausalLM; its chat encoder's special
    strings must be single tokens of the tiny vocabulary."""
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(bf16_dir), tokenizer_mode="deepseek_v4")
    assert len(tok) == 512
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, thinking=False
    )
    specials = tok.convert_tokens_to_ids(["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"])
    assert specials == [0, 3, 4, 6]
    assert ids[0] == 0 and ids[-2:] == [4, 6]  # chat mode ends with <｜Assistant｜></think>
    assert 3 in ids
    assert tok.decode(tok.encode("12 + 7 = 19", add_special_tokens=False)) == "12 + 7 = 19"


def test_mxfp4_variant(tmp_path, bf16_dir):
    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

    path = build_tiny_checkpoint(tmp_path, experts="mxfp4", tokenizer=False)
    spec = DeepseekV4Spec.from_dir(path)
    r = _check_against_table(path, expected_tensors(spec, "mxfp4", mtp_experts="bf16"))
    ref = CheckpointReader(bf16_dir)
    # the packed experts are exactly the MXFP4 encoding of the BF16 build's weights (same seed)
    for name in ("layers.0.ffn.experts.0.w1.weight", "layers.3.ffn.experts.7.w2.weight"):
        packed, scales = mxfp4.quantize(ref.get(name).float())
        assert torch.equal(r.get(name), packed)
        assert torch.equal(r.get(name.replace(".weight", ".weight_scale")), scales)
    # every non-expert tensor is the BF16 build's, byte for byte; MTP experts stay BF16
    for name in r:
        if ".ffn.experts." not in name or name.startswith("mtp."):
            assert r.raw_bytes(name) == ref.raw_bytes(name), name
    q = QuarkQuantConfig.from_dict(r.config["quantization_config"])
    assert q.spec_for("layers.1.ffn.experts.3.w1") == "mxfp4"
    assert q.is_excluded("mtp.0.ffn.experts.3.w1") and q.is_excluded("layers.1.attn.wq_a")
    assert q.is_excluded("layers.1.ffn.shared_experts.w2")


def test_official_fp8_fp4_variant(tmp_path, bf16_dir):
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

    path = build_tiny_checkpoint(tmp_path, experts="fp4-official", linears="fp8", tokenizer=False)
    spec = DeepseekV4Spec.from_dir(path)
    r = _check_against_table(path, expected_tensors(spec, "fp4-official", linears="fp8"))
    assert r.config["quantization_config"]["quant_method"] == "fp8" and r.config["expert_dtype"] == "fp4"
    ref = CheckpointReader(bf16_dir)
    w = dequantize_block_fp8(r.get("layers.1.attn.wq_b.weight"), r.get("layers.1.attn.wq_b.scale"), dtype=torch.float32)
    ref_w = ref.get("layers.1.attn.wq_b.weight").float()
    assert (w - ref_w).abs().max() <= ref_w.abs().max() / 8  # e4m3 has 3 mantissa bits
    assert r.info("mtp.0.e_proj.weight").dtype == "F8_E4M3"  # the official release quantizes MTP too


def test_build_tiny_cli(tmp_path, capsys):
    from vllm_dsv4_mtp.cli import main

    rc = main(["build-tiny", str(tmp_path / "t"), "--seed", "3", "--config", '{"compress_ratios": [0, 4, 8, 0]}'])
    assert rc == 0
    out = capsys.readouterr().out
    spec = DeepseekV4Spec.from_dir(tmp_path / "t")
    assert spec.compress_ratios == (0, 4, 8, 0)
    n = parameter_count(s.shape for s in weight_slots(spec).values())
    assert out.startswith(f"wrote {tmp_path / 't'}: ") and f"{n:,} parameters" in out


def test_build_tiny_refuses_a_vocabulary_too_large_before_writing(tmp_path, capsys):
    """The tiny tokenizer's built-in text yields at most 1214 BPE tokens: a larger vocab_size is refused before any
    weight is written (it used to write the weights, then fail, leaving a directory without a tokenizer)."""
    from vllm_dsv4_mtp.cli import main

    rc = main(["build-tiny", str(tmp_path / "t"), "--config", '{"vocab_size": 129280, "hidden_size": 1024}'])
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        "dsv4-mtp build-tiny: error: vocab_size 129280 is too large for the tiny tokenizer: its built-in text yields "
        "only 1214 BPE tokens (choose vocab_size <= 1214)"
    ]
    assert not (tmp_path / "t").exists()
    assert main(["build-tiny", str(tmp_path / "t"), "--config", '{"vocab_size": 1214}']) == 0
    assert (tmp_path / "t" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"hidden_size": -128}', "tiny_config(): field 'hidden_size' must be > 0, got -128"),
        ('{"hidden_size": ', "Expecting value: line 1 column 17 (char 16)"),
        ("[1]", "--config must be a JSON object of config.json fields, got '[1]'"),
    ],
)
def test_build_tiny_bad_config_is_one_line(tmp_path, capsys, config, message):
    from vllm_dsv4_mtp.cli import main

    assert main(["build-tiny", str(tmp_path / "t"), "--config", config]) == 2
    assert capsys.readouterr().err.splitlines() == [f"dsv4-mtp build-tiny: error: {message}"]
    assert not (tmp_path / "t").exists()
