"""The plugin against vLLM 0.33's Python source (no CPU build of 0.33 exists; ``make setup`` unpacks its sources).

What a user moving from 0.32 to 0.33 on MI355 would hit first is an import that no longer resolves, or an
in-tree member the gfx950 draft relies on that changed. Checked here, statically:

* every ``from vllm... import X`` in the plugin resolves in 0.33's source (and, as a control that the check
  works, in the installed 0.32; a made-up name is reported);
* vLLM 0.33's in-tree AMD MTP draft still takes its quantization from ``vllm_config.quant_config`` (so the
  plugin's BF16 view reaches it) and runs ``align_mtp_quant_config`` on that object (a no-op on None), its MoE
  still exposes the fused-shared-expert and mega-MoE switches the loader reads, the routed experts' loader still
  takes ``return_success``, and the attention sink now has its own tensor-parallel loader;
* what vLLM 0.33 hands models as ``hf_config`` is transformers' ``DeepseekV4Config``: tests/test_config_transformers.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from vllm_dsv4_mtp.testing.vllm_source import (
    VLLM_033_CACHE,
    VllmImport,
    class_members,
    missing_in,
    plugin_vllm_imports,
    source_of,
)

SRC_033 = VLLM_033_CACHE


@pytest.fixture(scope="module")
def src_033() -> Path:
    assert (SRC_033 / "vllm" / "__init__.py").is_file(), (
        f"{SRC_033}: vLLM 0.33's source is missing; `make setup` (scripts/setup_env.sh) downloads it")
    return SRC_033


def test_every_vllm_import_of_the_plugin_resolves_in_0_33(src_033):
    imports = plugin_vllm_imports()
    assert len(imports) > 50  # the plugin really uses vLLM
    assert missing_in(src_033, imports) == []


def test_the_check_itself_sees_0_32_and_a_missing_name():
    import vllm

    installed = Path(inspect.getfile(vllm)).parents[1]
    assert missing_in(installed, plugin_vllm_imports()) == []
    bogus = [VllmImport("x.py", 1, "vllm.model_executor.layers.linear", "NoSuchLinear"),
             VllmImport("x.py", 2, "vllm.no_such_module", "X")]
    assert missing_in(installed, bogus) == ["x.py:1: vllm.model_executor.layers.linear defines no NoSuchLinear",
                                            "x.py:2: module vllm.no_such_module does not exist"]


def test_the_in_tree_members_the_gfx950_draft_uses_are_there_in_0_33(src_033):
    mtp = class_members(src_033, "vllm.models.deepseek_v4.amd.mtp", "DeepSeekV4MTP")
    init = mtp["__init__"]
    assert [a.arg for a in init.args.kwonlyargs] == ["vllm_config", "prefix"]
    body = source_of(src_033, "vllm.models.deepseek_v4.amd.mtp")
    assert "self.quant_config = vllm_config.quant_config" in body
    assert "align_mtp_quant_config(self.quant_config, self.config)" in body
    align = source_of(src_033, "vllm.models.deepseek_v4.quant_config")
    assert "if quant_config is None:\n        return" in align
    moe = source_of(src_033, "vllm.models.deepseek_v4.amd.model")
    assert "self.is_fused_shared_expert_enabled =" in moe and "self.use_mega_moe =" in moe
    assert "quant_config = vllm_config.quant_config" in moe  # the MoE and its shared expert read the view too
    loader = class_members(src_033, "vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts")
    assert "return_success" in [a.arg for a in loader["weight_loader"].args.args]
    attn = source_of(src_033, "vllm.models.deepseek_v4.attention")
    assert "self.attn_sink = make_attention_sink(" in attn
    assert "sink.weight_loader = load_attention_sink" in source_of(
        src_033, "vllm.model_executor.model_loader.weight_utils")
