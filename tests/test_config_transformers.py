"""vLLM 0.33 hands models transformers' ``DeepseekV4Config`` instead of the ``config.json`` fields: it rewrites
``compress_ratios`` into ``layer_types`` + ``compress_rates`` (MTP layers dropped), ``num_hash_layers`` into
``mlp_layer_types``, YaRN into ``rope_parameters["compress"]``, and drops ``expert_dtype``. The spec read from
that object, built with transformers' own class, must equal the spec of the raw JSON, for the embedded model
and for Pro / Flash-shaped configs (the published ones, without ``expert_dtype``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_dsv4_mtp.config import ConfigError, DeepseekV4Spec, spec_from_hf_config
from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR, MXFP4_CHECKPOINT_DIR
from vllm_dsv4_mtp.serve.profiles import FLASH_CONFIG, PRO_CONFIG
from vllm_dsv4_mtp.testing.published_layouts import OFFICIAL_QUANTIZATION_CONFIG

YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _raw(name: str) -> dict:
    if name == "embedded-bf16":
        return json.loads((BF16_CHECKPOINT_DIR / "config.json").read_text())
    if name == "embedded-mxfp4":
        return json.loads((MXFP4_CHECKPOINT_DIR / "config.json").read_text())
    base = dict(PRO_CONFIG if name == "pro" else FLASH_CONFIG)
    return {**base, "quantization_config": dict(OFFICIAL_QUANTIZATION_CONFIG)}


def _comparable(spec: DeepseekV4Spec) -> dict:
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.compare}
    d["rope_scaling"] = {k: d["rope_scaling"][k] for k in YARN} if d["rope_scaling"] else None
    d["quantization_config"] = spec.quantization_config
    return d


@pytest.mark.parametrize("name", ["embedded-bf16", "embedded-mxfp4", "pro", "flash"])
def test_transformers_config_gives_the_raw_json_spec(name):
    from transformers import DeepseekV4Config

    raw = _raw(name)
    hf = DeepseekV4Config(**raw)
    assert not hasattr(hf, "compress_ratios") and hasattr(hf, "layer_types")  # really the 0.33 form
    assert not hasattr(hf, "num_hash_layers") and not hasattr(hf, "expert_dtype")
    assert _comparable(spec_from_hf_config(hf)) == _comparable(DeepseekV4Spec.from_dict(raw))


def test_pro_spec_from_transformers_keeps_the_schedule_and_the_fp4_default():
    from transformers import DeepseekV4Config

    spec = spec_from_hf_config(DeepseekV4Config(**_raw("pro")))
    assert spec.compress_ratios == tuple(PRO_CONFIG["compress_ratios"])  # 61 main layers + the MTP layer's 0
    assert spec.num_hash_layers == 3 and spec.official_expert_dtype == "fp4"


def test_a_config_with_neither_schedule_names_the_field():
    cfg = dict(PRO_CONFIG)
    cfg.pop("compress_ratios")
    hf = type("Cfg", (), {"to_dict": lambda self: dict(cfg), "name_or_path": "ckpt"})()
    with pytest.raises(
        ConfigError,
        match=r"ckpt/config\.json: missing required field 'compress_ratios' \(nor HF's "
        r"'layer_types' \+ 'compress_rates' to derive it from\)",
    ):
        spec_from_hf_config(hf)
