"""The gfx950 draft's quantization, checked on CPU through vLLM's own ``QuarkConfig`` and layer classes.

vLLM's in-tree AMD MTP layers ask ``vllm_config.quant_config`` for a method with the prefixes the real class's
layers carry (read from vLLM 0.32's real ``DeepSeekV4MTP`` built on CPU by tests/in_tree_real_worker.py; the
block's layers are named ``model.layers.{L}.attn.*`` / ``.ffn.*``, not under ``mtp_block``). For Quark
configs with the structure AMD publishes and its variants, this asks vLLM's ``QuarkConfig`` for each of those
prefixes, with the layer classes vLLM builds there:

* what vLLM's own draft gets (the control): on 0.32 quantized methods for MTP modules (no per-layer entry
  matches ``model.layers.{L}``, so the global MXFP4 W4A4 scheme applies: vllm-project/vllm#56054); with
  0.33's re-keying (``align_mtp_quant_config``: the same ``apply_vllm_mapper`` call, reproduced here with
  0.32's own ``WeightsMapper``) the checkpoint's stored precisions;
* what the plugin's draft gets (``bf16_draft_config``): an unquantized method for every prefix, on both;
* what the target gets: exactly what vLLM's target gets without the plugin, because on gfx950 the plugin
  registers no target and leaves the shared ``QuarkConfig`` object untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.formats.quark_config import fp8_block_layer_config, mxfp4_experts_config, mxfp4_layer_config
from vllm_dsv4_mtp.testing.published_layouts import amd_quark_config
from vllm_dsv4_mtp.tools.tiny import tiny_config

pytestmark = pytest.mark.engine  # vLLM's real classes, in subprocesses

L = 4  # the tiny config's MTP layer id (num_hidden_layers)


def _variants() -> dict[str, dict]:
    spec = DeepseekV4Spec.from_dict(tiny_config())
    fp8 = fp8_block_layer_config()
    return {
        # AMD's structure: MTP routed experts MXFP4 and shared expert FP8 per layer_quant_config
        "amd": amd_quark_config(spec, "amd"),
        # the MTP layer excluded by a pattern / by exact native names (kept in its original format)
        "mtp-excluded-pattern": amd_quark_config(spec, "original", "pattern"),
        "mtp-excluded-exact": amd_quark_config(spec, "original", "exact"),
        # vLLM's own test fixture for the AMD config: per-layer re: keys for the MTP w1's only
        "vllm-fixture": mxfp4_experts_config(
            [],
            layer_quant_config={
                r"re:mtp\.0\.ffn\.experts\.\d+\.w1": mxfp4_layer_config(),
                r"re:mtp\.0\.ffn\.shared_experts\.w1": fp8,
            },
        ),
        # per-layer entries under vLLM's own names (as a mapper-aware exporter could write them)
        "vllm-names": mxfp4_experts_config(
            ["head"],
            layer_quant_config={
                f"model.layers.{L}.e_proj": fp8,
                f"model.layers.{L}.ffn.shared_experts.gate_up_proj": fp8,
            },
        ),
        # nothing but the global scheme
        "global-only": mxfp4_experts_config([]),
    }


VARIANTS = list(_variants())


def _quark(raw: dict, *, target_mapper: bool = True, align_033: bool = False):
    """vLLM's QuarkConfig as the engine holds it after the target class is initialised (its mapper applied),
    optionally with vLLM 0.33's MTP re-keying."""
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM as InTreeTarget

    qc = QuarkConfig.from_config(copy.deepcopy(raw))
    if target_mapper:
        qc.apply_vllm_mapper(InTreeTarget.hf_to_vllm_mapper)
        qc.packed_modules_mapping = dict(InTreeTarget.packed_modules_mapping)
    if align_033:
        qc.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"model.mtp.0.": f"model.layers.{L}."}))
    return qc


def _layers(vllm_dist_cfg):
    """One vLLM layer object per kind, built unquantized (only their types matter to the quantization method)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.models.deepseek_v4.cpu.model import DeepseekV4MoE

    with set_current_vllm_config(vllm_dist_cfg), torch.device("meta"):
        linear = ReplicatedLinear(64, 64, bias=False, quant_config=None, prefix="probe")
        moe = DeepseekV4MoE(vllm_dist_cfg, prefix=f"model.layers.{L}.ffn").experts.routed_experts
    return {"linear": linear, "moe": moe}


def _method(engine_config, qc, layer, prefix: str) -> str:
    """The method class ``qc`` gives ``layer`` at ``prefix`` with its weight quantization key, e.g.
    ``"QuarkLinearMethod(QuantKey(...))"`` ("unquantized" for vLLM's unquantized methods or None), as
    ``QuarkConfig.get_quant_method`` decides it inside the engine config.

    This asks ``get_quant_method_target``, the function ``get_quant_method`` calls for that decision (the
    method class and its weight / activation keys), and stops short of instantiating the method: building an
    MXFP4 MoE method also picks its kernel, and vLLM 0.32's only CPU one needs AMX
    (``CPUExpertsMxfp4._supports_current_device``), so on a CPU without AMX the constructor raises
    "No MXFP4 MoE backend supports the deployment configuration" for a method the config did choose."""
    from vllm.config import set_current_vllm_config

    if qc is None:
        return "unquantized"
    with set_current_vllm_config(engine_config):
        if hasattr(qc, "get_quant_method_target"):  # QuarkConfig
            weight_key, _, method_cls = qc.get_quant_method_target(prefix, type(layer))
        else:  # the plugin's own config: builds nothing quantized, so ask it for the method itself
            weight_key, method = None, qc.get_quant_method(layer, prefix)
            method_cls = type(method) if method is not None else None
    name = method_cls.__name__ if method_cls is not None else "None"
    if name in ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "None"):
        return "unquantized"
    return f"{name}({weight_key})"


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    import json

    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text(
        json.dumps({**tiny_config(), "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"})
    )
    return EngineArgs(model=str(d), skip_tokenizer_init=True, max_model_len=256).create_engine_config()


@pytest.fixture(scope="module")
def QUANT_PREFIXES(tmp_path_factory):  # noqa: N802  (the table the tests iterate)
    """(prefix relative to ``model.layers.{L}``, kind) of every layer of vLLM 0.32's real in-tree MTP class that
    asks the quantization config for a method, from the class built on CPU."""
    import json

    from test_in_tree_mtp_real import run_worker

    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    out = tmp_path_factory.mktemp("real-prefixes")
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("real-ckpt") / "bf16", tiny_config(), seed=0)
    run_worker("0.32.0", out, [dict(name="prefixes", ckpt=str(ckpt), tp=1)])
    res = json.loads((out / "prefixes-rank0.json").read_text())
    assert res["error"] is None, res["error"]
    table = [(p.removeprefix(f"model.layers.{L}."), kind) for p, kind in res["quant_prefixes"]]
    assert ("ffn.experts", "moe") in table and ("e_proj", "linear") in table and len(table) == 10, table
    return table


@pytest.fixture(scope="module")
def layers(vllm_dist, engine_config):  # vllm_dist: vLLM's parallel layers are built inside it
    return _layers(engine_config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_plugin_draft_is_unquantized_for_every_in_tree_prefix(layers, engine_config, variant, QUANT_PREFIXES):
    from vllm_dsv4_mtp.gfx950.plan import bf16_draft_config

    raw = _variants()[variant]
    for align in (False, True):  # vLLM 0.32 / 0.33
        shared = _quark(raw, align_033=align)
        engine_config.quant_config = shared
        view = bf16_draft_config(engine_config)
        assert type(view.quant_config).__name__ == "Bf16DraftQuantConfig"
        assert engine_config.quant_config is shared  # the target's config object is not touched
        for rel, kind in QUANT_PREFIXES:
            prefix = f"model.layers.{L}.{rel}"
            got = _method(engine_config, view.quant_config, layers[kind], prefix)
            assert got == "unquantized", (variant, align, prefix)


def test_vllm_own_draft_is_quantized_where_the_plugin_is_not(layers, engine_config, QUANT_PREFIXES):
    """The control: the same QuarkConfigs give vLLM's in-tree draft quantized methods, so the test above can
    fail (and did, on the plugin's previous draft, whose in-tree attention took the target's config)."""
    v = _variants()
    got_032 = {
        rel: _method(engine_config, _quark(v["amd"]), layers[kind], f"model.layers.{L}.{rel}")
        for rel, kind in QUANT_PREFIXES
    }
    assert set(got_032.values()) != {"unquantized"}, got_032  # 0.32: the global MXFP4 scheme falls through
    assert got_032["e_proj"] != "unquantized" and got_032["ffn.experts"] != "unquantized"
    got_033 = {
        rel: _method(engine_config, _quark(v["amd"], align_033=True), layers[kind], f"model.layers.{L}.{rel}")
        for rel, kind in QUANT_PREFIXES
    }
    assert got_033["ffn.experts"] != "unquantized", got_033  # 0.33: the stored precision (MXFP4)


TARGET_PREFIXES = [
    ("model.layers.1.attn.wq_b", "linear"),
    ("model.layers.1.attn.fused_wqa_wkv", "linear"),
    ("model.layers.2.ffn.shared_experts.gate_up_proj", "linear"),
    ("model.layers.2.ffn.experts", "moe"),
    ("model.layers.0.ffn.shared_experts.down_proj", "linear"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_target_gets_what_vllm_gives_it_without_the_plugin(layers, engine_config, variant):
    """On gfx950 the plugin registers no target class and claims no quantization method, so the target is
    vLLM's own and its QuarkConfig is built and mapped exactly as without the plugin."""
    from vllm_dsv4_mtp import platform, registration
    from vllm_dsv4_mtp.portable_quant_config import claims

    raw = _variants()[variant]
    assert "DeepseekV4ForCausalLM" not in registration.models_for(platform.IN_TREE)
    hf = type("Cfg", (), {"model_type": "deepseek_v4", "compress_ratios": [0, 4], "hc_mult": 4})()
    assert not claims(raw, hf, gfx950=True)
    served = registration.models_for(platform.IN_TREE).get("DeepseekV4ForCausalLM")
    plugin_mapped = _quark(raw, target_mapper=served is None)
    vllm_alone = _quark(raw)
    for prefix, kind in TARGET_PREFIXES:
        assert _method(engine_config, plugin_mapped, layers[kind], prefix) == _method(
            engine_config, vllm_alone, layers[kind], prefix
        ), prefix
