"""vLLM 0.33's form of a DeepSeek-V4 config (transformers' ``DeepseekV4Config``) back to the ``config.json`` fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_dsv4_mtp.config.spec import LAYER_TYPE_NAMES, ConfigError, DeepseekV4Spec


def spec_from_hf_config(hf_config: Any) -> DeepseekV4Spec:
    """The validated spec of the config object vLLM hands a model (vLLM 0.32's or transformers')."""
    d, source = spec_dict_from_hf_config(hf_config)
    return DeepseekV4Spec.from_dict(d, source=source)


def spec_dict_from_hf_config(hf_config: Any) -> tuple[dict[str, Any], str]:
    """The ``config.json`` fields of the config object vLLM hands a model, and the file to name in errors.

    vLLM 0.32 passes its own ``DeepseekV4Config`` (the ``config.json`` fields as they are); vLLM 0.33
    passes transformers' ``DeepseekV4Config``, which rewrites the native schedule into ``layer_types`` +
    ``compress_rates`` (MTP layers dropped), ``num_hash_layers`` into ``mlp_layer_types``, YaRN into
    ``rope_parameters["compress"]``, and drops ``expert_dtype``. Both give the same spec.
    """
    d = dict(hf_config.to_dict())
    source = f"{getattr(hf_config, 'name_or_path', '') or 'hf_config'}/config.json"
    if "compress_ratios" in d:
        d.pop("layer_types", None)  # vLLM's copy may carry HF's names next to the native list
    else:
        d.update(_native_schedule(d, source))
    rp = d.get("rope_parameters")
    if d.get("rope_scaling") is None and isinstance(rp, Mapping):
        nested = rp.get("compress") if isinstance(rp.get("compress"), Mapping) else rp
        if nested.get("rope_type", nested.get("type")) == "yarn":
            d["rope_scaling"] = dict(nested)
        main = rp.get("main")
        if isinstance(main, Mapping) and "rope_theta" in main:
            d["rope_theta"] = main["rope_theta"]
    return d, source


def _native_schedule(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``compress_ratios`` and ``num_hash_layers`` from transformers' ``layer_types`` / ``compress_rates`` /
    ``mlp_layer_types`` (MTP layers, which transformers drops, are sliding-window only)."""
    lt, rates = d.get("layer_types"), d.get("compress_rates")
    if not isinstance(lt, list) or not isinstance(rates, Mapping):
        raise ConfigError(
            f"{source}: missing required field 'compress_ratios' (nor HF's 'layer_types' + "
            f"'compress_rates' to derive it from)"
        )
    ratios = []
    for i, name in enumerate(lt):
        if name == LAYER_TYPE_NAMES["swa"]:
            ratios.append(0)
        elif name in rates:
            ratios.append(rates[name])
        else:
            raise ConfigError(f"{source}: field 'layer_types[{i}]' = {name!r} has no entry in 'compress_rates'")
    out: dict[str, Any] = {"compress_ratios": ratios + [0] * int(d.get("num_nextn_predict_layers") or 0)}
    mlp = d.get("mlp_layer_types")
    if "num_hash_layers" not in d and isinstance(mlp, list):
        n_hash = 0
        while n_hash < len(mlp) and mlp[n_hash] == "hash_moe":
            n_hash += 1
        if "hash_moe" in mlp[n_hash:]:
            raise ConfigError(f"{source}: field 'mlp_layer_types': hash-routed layers must come first, got {mlp}")
        out["num_hash_layers"] = n_hash
    return out
