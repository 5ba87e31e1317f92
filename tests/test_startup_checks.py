"""Engine start-up on bad checkpoints, through vLLM's own EngineArgs / LLM: with ``config_format="dsv4_mtp"`` (the
plugin's config parser, vllm_dsv4_mtp/startup_checks.py) the config errors name config.json and the field before
vLLM's SpeculativeConfig runs; without it, vLLM's own messages (asserted here, and quoted in docs/bad-inputs.md).
A truncated shard is named by the target model's header check (formats/shards.py) whatever the config format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engines import vllm_engine

from vllm_dsv4_mtp.formats.checkpoint import CheckpointError
from vllm_dsv4_mtp.startup_checks import StartupCheckError
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    w = tmp_path_factory.mktemp("startup")
    out = {
        "good": build_tiny_checkpoint(w / "good", seed=7),
        "zero": build_tiny_checkpoint(w / "zero", tiny_config(num_nextn_predict_layers=0), mtp=False),
    }
    for name, edit in (("neg", {"hidden_size": -128}), ("ratios", {"compress_ratios": [0, 4, 128, 4]})):
        d = build_tiny_checkpoint(w / name, seed=7, tokenizer=False)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(edit)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    trunc = build_tiny_checkpoint(w / "trunc", seed=7)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    out["trunc"] = trunc
    return out


def _engine_config(model: Path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, skip_tokenizer_init=True, **kw).create_engine_config()


def test_the_plugin_registers_the_config_format(ckpts):
    """No call from the test: vLLM's EngineArgs loads the plugin (vllm.general_plugins), which registers it."""
    from vllm.transformers_utils.config import get_config_parser

    _engine_config(ckpts["good"], config_format="dsv4_mtp")
    assert type(get_config_parser("dsv4_mtp")).__name__ == "Dsv4MtpConfigParser"


def test_no_mtp_layer_with_an_mtp_config(ckpts):
    with pytest.raises(StartupCheckError) as e:
        _engine_config(ckpts["zero"], config_format="dsv4_mtp", speculative_config=MTP)
    assert str(e.value) == (
        f"{ckpts['zero'] / 'config.json'}: num_nextn_predict_layers = 0: the checkpoint has no "
        f"MTP layer, so it cannot be served with speculative_config method 'mtp'; serve it "
        f"without a speculative config"
    )
    # vLLM's own config code, without the plugin's parser
    with pytest.raises(ZeroDivisionError, match="^integer modulo by zero$"):
        _engine_config(ckpts["zero"], speculative_config=MTP)
    # the same checkpoint without a speculative config is fine either way
    _engine_config(ckpts["zero"], config_format="dsv4_mtp")


def test_negative_hidden_size(ckpts):
    for spec in ({}, {"speculative_config": MTP}):
        with pytest.raises(StartupCheckError) as e:
            _engine_config(ckpts["neg"], config_format="dsv4_mtp", **spec)
        assert str(e.value) == f"{ckpts['neg'] / 'config.json'}: field 'hidden_size' must be > 0, got -128"


def test_missing_config_json_is_vllms_own_message(ckpts, tmp_path):
    import shutil

    d = tmp_path / "noconf"
    shutil.copytree(ckpts["good"], d)
    (d / "config.json").unlink()
    with pytest.raises(Exception) as e:
        _engine_config(d)
    assert f"Invalid repository ID or local directory specified: '{d}'." in str(e.value)
    assert "ensure the presence of a 'config.json'" in str(e.value)
    with pytest.raises(StartupCheckError) as e:  # where vLLM's HF parser would ask for a `model_type` key
        _engine_config(d, config_format="dsv4_mtp")
    assert str(e.value) == f"{d / 'config.json'}: not found: a checkpoint directory needs its config.json"


def _llm(model: Path, **kw):
    """``with _llm(...) as llm:`` an in-process engine (so the worker's exception reaches the caller unchanged)."""
    return vllm_engine(model, in_process=True, dtype="bfloat16", enforce_eager=True, max_model_len=256, **kw)


@pytest.mark.engine
def test_negative_hidden_size_without_the_config_format_dies_in_vllm(ckpts):
    """What vLLM says by itself: its model runner allocates [tokens, hidden_size] buffers before any plugin code
    runs (GPUModelRunner.__init__, torch.zeros)."""
    with pytest.raises(RuntimeError, match=r"^zeros: Dimension size must be non-negative\.$"):
        with _llm(ckpts["neg"], skip_tokenizer_init=True):
            pass  # not reached: the engine must not start


RATIOS = (
    "field 'compress_ratios' has 4 entries, expected num_hidden_layers + num_nextn_predict_layers = 4 + 1 = 5 "
    "(one per main layer, then one per MTP layer)"
)


def test_malformed_field_with_the_config_format(ckpts):
    with pytest.raises(StartupCheckError) as e:
        _engine_config(ckpts["ratios"], config_format="dsv4_mtp")
    assert str(e.value) == f"{ckpts['ratios'] / 'config.json'}: {RATIOS}"


@pytest.mark.engine
def test_malformed_field_without_it_is_named_by_the_model(ckpts):
    """Without the config format, the plugin's model constructor validates the same fields (after vLLM's config
    code, which this field does not trip)."""
    from vllm_dsv4_mtp.config import ConfigError

    with pytest.raises(ConfigError) as e:
        with _llm(ckpts["ratios"], skip_tokenizer_init=True):
            pass  # not reached: the engine must not start
    assert str(e.value) == f"{ckpts['ratios'] / 'config.json'}: {RATIOS}"


@pytest.mark.engine
def test_truncated_shard_is_named_at_engine_start(ckpts):
    """The target model's constructor checks every shard header before vLLM's safetensors reader opens them (which
    would say 'incomplete metadata, file not fully covered', naming no file)."""
    with pytest.raises(CheckpointError) as e:
        with _llm(ckpts["trunc"], skip_tokenizer_init=True):
            pass  # not reached: the engine must not start
    f = ckpts["trunc"] / "model.safetensors"
    size = f.stat().st_size
    assert str(e.value).startswith(f"{f}: truncated safetensors file: its header describes ")
    assert str(e.value).endswith(
        f" data bytes (through tensor 'norm.weight') but the file holds only {size - 8 - _header_len(f)}"
    )


def _header_len(f: Path) -> int:
    import struct

    return struct.unpack("<Q", f.read_bytes()[:8])[0]


@pytest.mark.engine
def test_a_good_checkpoint_serves_with_the_config_format_and_mtp(ckpts):
    """The parser is vLLM's HF parser plus checks: a good checkpoint starts with the MTP draft and generates."""
    from vllm import SamplingParams

    with _llm(
        ckpts["good"], config_format="dsv4_mtp", speculative_config={"method": "mtp", "num_speculative_tokens": 2}
    ) as llm:
        out = llm.generate([{"prompt_token_ids": [0, 17, 42, 99, 5]}], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("mla_disable", [False, True])
def test_a_flag_vllms_cpu_platform_drops_is_named_with_its_fix(ckpts, monkeypatch, amx, mla_disable):
    """Issue 47 item 5: vLLM's real ``EngineArgs`` / ``CpuPlatform`` build the final config of a server started with
    ``--enable-prefix-caching --enable-chunked-prefill``. On a CPU without AMX (forced here: vLLM asks
    ``torch.cpu._is_amx_tile_supported``) it turns both off under MLA, and the plugin's start-up line names both
    flags and ``VLLM_MLA_DISABLE=1``; with AMX, or with that fix set, both stay on and there is no line."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_mtp.startup_checks import dropped_flags_line

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if mla_disable:
        monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    else:
        monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    argv = ["--model", str(ckpts["good"]), "--enable-prefix-caching", "--enable-chunked-prefill"]
    vc = EngineArgs(
        model=str(ckpts["good"]), enable_prefix_caching=True, enable_chunked_prefill=True, max_model_len=1024
    ).create_engine_config()
    kept = amx or mla_disable
    assert (vc.cache_config.enable_prefix_caching, vc.scheduler_config.enable_chunked_prefill) == (kept, kept)
    line = dropped_flags_line(vc, argv)
    if kept:
        assert line is None
    else:
        assert "--enable-prefix-caching and --enable-chunked-prefill dropped" in line and "VLLM_MLA_DISABLE=1" in line
        assert dropped_flags_line(vc, argv[:3]).count("--") == 1  # only the flag that was passed is named
        assert dropped_flags_line(vc, argv[:2]) is None  # nothing passed, nothing named


def test_serve_sets_the_fix_when_the_command_asks_for_a_dropped_feature():
    """``dsv4-mtp serve`` on the CPU profile with ``--enable-prefix-caching``: ``VLLM_MLA_DISABLE=1`` in the
    server's environment, its origin printed; not without the flag, not over the caller's own value, and never on
    the MI355 profiles (vLLM's in-tree target is not the CPU platform's concern)."""
    from vllm_dsv4_mtp.serve.command import build_command
    from vllm_dsv4_mtp.serve.profiles import get_profile

    cpu = get_profile("cpu-tiny")
    cmd = build_command(cpu, None, ["--enable-prefix-caching"], environ={})
    assert cmd.env["VLLM_MLA_DISABLE"] == "1"
    assert any(k == "VLLM_MLA_DISABLE" and "--enable-prefix-caching" in origin for k, _, origin in cmd.env_report)
    assert "VLLM_MLA_DISABLE" not in build_command(cpu, None, [], environ={}).env
    assert (
        build_command(cpu, None, ["--enable-chunked-prefill"], environ={"VLLM_MLA_DISABLE": "0"}).env[
            "VLLM_MLA_DISABLE"
        ]
        == "0"
    )
    mi355 = build_command(get_profile("mi355x-pro-tp8"), None, ["--enable-prefix-caching"], environ={})
    assert "VLLM_MLA_DISABLE" not in mi355.env
