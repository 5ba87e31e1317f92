"""`dsv4-mtp serve`: profile expansion, command-line override precedence, environment, argument splitting.

Pure Python (no vLLM import): what ends up on the vLLM command line and in the server's environment.
Whether vLLM's own parser accepts the result is tests/test_profiles.py.
"""

from __future__ import annotations

import json

import pytest

from vllm_dsv4_mtp.serve import cli
from vllm_dsv4_mtp.serve.command import ServeArgsError, build_command, merge_flags
from vllm_dsv4_mtp.serve.profiles import PROFILES, get_profile


def _argv_map(cmd) -> dict[str, list[str]]:
    """option -> every value it has on the final command line (bare flags map to [''])."""
    args = cmd.vllm_args()
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        opt = args[i]
        assert opt.startswith("--"), args
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.setdefault(opt, []).append(args[i + 1])
            i += 2
        else:
            out.setdefault(opt, []).append("")
            i += 1
    return out


def test_profile_expands_to_its_flags_and_model():
    cmd = build_command(get_profile("mi355x-pro-tp8"), None, [], environ={})
    m = _argv_map(cmd)
    assert m["--model"] == ["amd/DeepSeek-V4-Pro-MXFP4"]
    assert m["--tensor-parallel-size"] == ["8"]
    assert m["--kv-cache-dtype"] == ["fp8"]
    assert m["--gpu-memory-utilization"] == ["0.85"]
    assert m["--max-num-seqs"] == ["256"]
    assert json.loads(m["--speculative-config"][0]) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": [[1, 16, 2], [17, 1024, 0]],
    }
    assert m["--trust-remote-code"] == [""]
    assert cmd.argv[1:3] == ["-m", cmd.module]
    assert cmd.env["VLLM_ROCM_USE_AITER"] == "1"
    assert cmd.env["VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"] == "1"


def test_command_line_flag_replaces_the_profiles_in_place_once():
    cmd = build_command(get_profile("mi355x-pro-tp8"), "/ckpt", ["--max-num-seqs", "64"], environ={})
    m = _argv_map(cmd)
    assert m["--max-num-seqs"] == ["64"]  # once: no duplicate for vLLM to warn about
    assert m["--model"] == ["/ckpt"]
    # the position of the replaced flag is kept (the printed command reads like the profile)
    opts = [a for a in cmd.vllm_args() if a.startswith("--")]
    prof_opts = [o for o, _ in get_profile("mi355x-pro-tp8").args]
    assert opts[1:] == prof_opts


@pytest.mark.parametrize("tokens", [["-tp", "4"], ["--tensor_parallel_size", "4"], ["--tensor-parallel-size=4"]])
def test_short_and_underscore_spellings_override_the_same_option(tokens):
    cmd = build_command(get_profile("mi355x-pro-tp8"), None, tokens, environ={})
    m = _argv_map(cmd)
    assert m["--tensor-parallel-size"] == ["4"]
    assert "-tp" not in cmd.vllm_args() and "--tensor_parallel_size" not in cmd.vllm_args()
    assert cmd.flag("tensor-parallel-size") == "4"


def test_negated_boolean_replaces_the_bare_flag():
    cmd = build_command(get_profile("mi355x-pro-tp8"), None, ["--no-trust-remote-code"], environ={})
    args = cmd.vllm_args()
    assert "--no-trust-remote-code" in args and "--trust-remote-code" not in args
    assert cmd.flag("trust-remote-code") is False
    cmd = build_command(get_profile("cpu-tiny"), "/m", ["--no-enforce-eager"], environ={})
    assert cmd.flag("enforce-eager") is False and "--enforce-eager" not in cmd.vllm_args()


def test_dotted_flag_edits_one_key_of_the_profiles_json():
    cmd = build_command(
        get_profile("mi355x-pro-tp8"),
        None,
        ["--speculative-config.num_speculative_tokens", "3", "--compilation-config.cudagraph_mode=FULL_DECODE_ONLY"],
        environ={},
    )
    m = _argv_map(cmd)
    assert json.loads(m["--speculative-config"][0]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert json.loads(m["--compilation-config"][0]) == {"mode": 3, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert not any("." in a for a in cmd.vllm_args() if a.startswith("--"))
    # the profile table itself is untouched
    assert dict(get_profile("mi355x-pro-tp8").args)["--speculative-config"]["num_speculative_tokens"] == 2


def test_dotted_flag_without_a_profile_json_is_passed_through():
    cmd = build_command(get_profile("cpu-tiny"), "/m", ["--attention-config.backend", "X"], environ={})
    assert cmd.vllm_args()[-2:] == ["--attention-config.backend", "X"]


def test_whole_json_and_null_replace_the_profiles_value():
    cmd = build_command(
        get_profile("cpu-tiny"),
        "/m",
        ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
        environ={},
    )
    assert cmd.flag("speculative-config") == {"method": "mtp", "num_speculative_tokens": 1}
    cmd = build_command(get_profile("cpu-tiny"), "/m", ["--speculative-config", "null"], environ={})
    assert cmd.flag("speculative-config") is None
    assert _argv_map(cmd)["--speculative-config"] == ["null"]


def test_new_flags_are_appended():
    cmd = build_command(get_profile("cpu-tiny"), "/m", ["--seed", "7", "--disable-log-stats"], environ={})
    assert cmd.vllm_args()[-3:] == ["--seed", "7", "--disable-log-stats"]


def test_environment_precedence_profile_then_caller_then_env_option():
    prof = get_profile("mi355x-pro-tp8")  # the profile that sets the fused shared expert
    cmd = build_command(
        prof,
        None,
        [],
        env_overrides={"VLLM_ROCM_USE_AITER_MOE": "0", "EXTRA": "x"},
        environ={"VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "0", "PATH": "/bin"},
    )
    assert cmd.env["VLLM_ROCM_USE_AITER"] == "1"  # profile default
    assert cmd.env["VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"] == "0"  # the caller's environment wins
    assert cmd.env["VLLM_ROCM_USE_AITER_MOE"] == "0"  # --env wins over both
    assert cmd.env["EXTRA"] == "x" and cmd.env["PATH"] == "/bin"
    origins = {k: o for k, _, o in cmd.env_report}
    assert origins == {
        "VLLM_ROCM_USE_AITER": "profile",
        "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "environment",
        "VLLM_ROCM_USE_AITER_MOE": "--env",
        "EXTRA": "--env",
    }
    shell = cmd.shell()
    assert "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0 \\" in shell and "VLLM_ROCM_USE_AITER_MOE=0 \\" in shell


def test_model_given_twice_is_an_error():
    with pytest.raises(ServeArgsError, match="given twice"):
        build_command(get_profile("cpu-tiny"), "/a", ["--model", "/b"], environ={})


def test_serve_argv_split_own_options_model_and_vllm_flags():
    o = cli.parse_serve_argv(
        [
            "--profile",
            "mi355x-pro-tp8",
            "/ckpt",
            "--max-num-seqs",
            "64",
            "--enforce-eager",
            "--dry-run",
            "--env",
            "A=b=c",
            "--",
            "--profile",
            "x",
        ]
    )
    assert o.profile == "mi355x-pro-tp8" and o.model == "/ckpt" and o.dry_run
    assert o.env == {"A": "b=c"}
    # after "--" everything is vLLM's, even a name this command also uses
    assert o.vllm == ["--max-num-seqs", "64", "--enforce-eager", "--profile", "x"]


def test_serve_argv_negative_number_is_a_value():
    o = cli.parse_serve_argv(["--profile=cpu-tiny", "--seed", "-1"])
    assert o.profile == "cpu-tiny" and o.vllm == ["--seed", "-1"] and o.model is None


def test_serve_argv_model_after_a_vllm_flag_is_rejected():
    with pytest.raises(ServeArgsError, match="give MODEL before any vLLM flag"):
        cli.parse_serve_argv(["--profile", "cpu-tiny", "--enforce-eager", "--max-num-seqs", "4", "/ckpt", "x"])


def test_unknown_short_option_is_rejected():
    with pytest.raises(ServeArgsError, match="unknown short option '-zz'"):
        merge_flags([], ["-zz", "1"])


def test_dry_run_prints_env_and_command_and_exits_zero(capsys, tmp_path):
    rc = cli.run(["--profile", "cpu-tiny", str(tmp_path), "--max-num-seqs", "2", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "#   VLLM_CPU_KVCACHE_SPACE=1  [" in out
    assert f"  --model {tmp_path} \\\n" in out
    assert "  --max-num-seqs 2 \\\n" in out
    assert "-m vllm.entrypoints.launchers.api_server.entry \\\n" in out
    assert "capacity check" not in out  # CPU profile: no GPU arithmetic


def test_missing_model_directory_is_refused(capsys, tmp_path):
    rc = cli.run(["--profile", "cpu-tiny", str(tmp_path / "nope"), "--dry-run"])
    assert rc == 2
    assert f"model directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_unknown_profile_and_missing_profile(capsys):
    assert cli.run(["--profile", "h100", "--dry-run"]) == 2
    known = "mi355x-pro-tp8, mi355x-pro-dp8-ep, mi355x-flash-tp4, cpu-tiny"
    assert f"unknown profile 'h100'; known profiles: {known}" in capsys.readouterr().err
    assert cli.run(["--dry-run"]) == 2
    assert "--profile is required" in capsys.readouterr().err


def test_list_profiles(capsys):
    assert cli.run(["--list-profiles"]) == 0
    out = capsys.readouterr().out
    for name in PROFILES:
        assert out.count(name) == 1


def test_unsupported_vllm_is_refused_before_starting(monkeypatch, capsys, tmp_path):
    from vllm_dsv4_mtp import versions

    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm", "0.31.2"))
    monkeypatch.setattr(cli.os, "execve", lambda *a: pytest.fail("must not start an unsupported vLLM"))
    rc = cli.run(["--profile", "cpu-tiny", str(tmp_path)])
    assert rc == 2
    assert "vllm 0.31.2 is installed, but vllm-dsv4-mtp supports vLLM >=0.32,<0.35" in capsys.readouterr().err


PRO_TP8_HEADER = [
    "# dsv4-mtp serve --profile mi355x-pro-tp8: DeepSeek-V4-Pro MXFP4 on 8x MI355X (TP8): vLLM's in-tree target "
    "with AITER, fp8 KV, the plugin's BF16 MTP draft K=2",
    "# runs on MI355X (gfx950): target = vLLM's in-tree DeepseekV4ForCausalLM with AITER, at the checkpoint's own "
    "quantization; draft = the plugin's BF16 MTP (DeepSeekV4MTPModel)",
]


def test_pro_tp8_dry_run_prints_a_command_that_needs_no_extra_environment(monkeypatch, capsys):
    for key in list(cli.os.environ):
        if key.startswith(("VLLM_", "HF_")):
            monkeypatch.delenv(key)
    assert cli.run(["--profile", "mi355x-pro-tp8", "amd/DeepSeek-V4-Pro-MXFP4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == PRO_TP8_HEADER  # what runs where (the exact command: tests/test_profiles.py)
    # quantized MTP tensors are decoded to BF16 by default: no plugin switch to set (the capacity check names
    # VLLM_DSV4_MTP_DRAFT_PRECISION only to say which draft it counts)
    assert not any(line.lstrip("# ").startswith("VLLM_DSV4_MTP") for line in out.splitlines())
    # and the environment the server would get is the caller's plus exactly those three switches
    cmd = build_command(get_profile("mi355x-pro-tp8"), "amd/DeepSeek-V4-Pro-MXFP4", [], environ={"PATH": "/bin"})
    assert cmd.env == {
        "PATH": "/bin",
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_MOE": "1",
        "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
    }


def test_what_runs_follows_the_profile_and_the_speculative_config():
    flash = build_command(get_profile("mi355x-flash-tp4"), None, ["--speculative-config", "null"], environ={})
    assert flash.what_runs() == (
        "on MI355X (gfx950): target = vLLM's in-tree DeepseekV4ForCausalLM with AITER, at "
        "the checkpoint's own quantization; draft = none (no MTP speculative config)"
    )
    tiny = build_command(get_profile("cpu-tiny"), "/m", [], environ={})
    assert tiny.what_runs() == (
        "on CPU: target = the plugin's portable DeepseekV4ForCausalLM (weights decoded to "
        "the model dtype at load); draft = the plugin's BF16 MTP (DeepSeekV4MTPModel)"
    )
