"""The plugin's imports against vLLM 0.33's and 0.34's Python source (``make setup`` unpacks them).

What a user moving from 0.32 to a later release would hit first is an import that no longer resolves. Checked
here, statically: every ``from vllm... import X`` in the plugin resolves in each fetched release's source (and, as
a control that the check works, in the installed 0.32; a made-up name is reported).

What the gfx950 draft uses of vLLM's in-tree classes (the constructor's arguments, ``vllm_config.quant_config``,
``align_mtp_quant_config``, the MoE's fused-shared-expert and mega-MoE switches, the routed experts' and the
attention sink's weight loaders) is exercised on the real classes of 0.32, 0.33 and 0.34 by
tests/test_in_tree_mtp_real.py; what vLLM 0.33+ hands models as ``hf_config`` (transformers' ``DeepseekV4Config``)
by tests/test_config_transformers.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from vllm_dsv4_mtp.testing.vllm_source import (
    FETCHED_RELEASES,
    VllmImport,
    missing_in,
    plugin_vllm_imports,
    release_source,
)

#: imports known not to resolve, per release, each with why it is not a failure (none today: the CPU expand-kernel
#: workaround's import of 0.32's ``vllm.v1.sample.rejection_sampler``, gone in 0.34, sits under ``except ImportError``)
KNOWN_MISSING = {"0.33.0": [], "0.34.0": []}


@pytest.mark.parametrize("version", FETCHED_RELEASES)
def test_every_vllm_import_of_the_plugin_resolves_in_the_release(version):
    src = release_source(version)
    assert (src / "vllm" / "__init__.py").is_file(), (
        f"{src}: vLLM {version}'s source is missing; `make setup` (scripts/setup_env.sh) downloads it"
    )
    imports = plugin_vllm_imports()
    assert len(imports) > 50  # the plugin really uses vLLM
    assert missing_in(src, imports) == KNOWN_MISSING[version]


def test_the_check_itself_sees_0_32_and_a_missing_name():
    import vllm

    installed = Path(inspect.getfile(vllm)).parents[1]
    assert missing_in(installed, plugin_vllm_imports()) == []
    bogus = [
        VllmImport("x.py", 1, "vllm.model_executor.layers.linear", "NoSuchLinear"),
        VllmImport("x.py", 2, "vllm.no_such_module", "X"),
        VllmImport("x.py", 3, "vllm.no_such_module", "Y", optional=True),
    ]
    assert missing_in(installed, bogus) == [
        "x.py:1: vllm.model_executor.layers.linear defines no NoSuchLinear",
        "x.py:2: module vllm.no_such_module does not exist",
    ]
    # the plugin's own guarded imports are seen as guarded (cpu_requests probes V1's and V2's interfaces)
    guarded = {(i.file, i.module) for i in plugin_vllm_imports() if i.optional}
    assert ("vllm_dsv4_mtp/workarounds/cpu_requests.py", "vllm.v1.sample.logits_processor") in guarded
