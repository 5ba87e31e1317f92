"""Every profile's generated server arguments are accepted by vLLM 0.32's own OpenAI-server parser.

The parser is built in-process exactly as vLLM's server entry builds it (``make_arg_parser`` on a
``FlexibleArgumentParser``), the arguments are validated with ``validate_parsed_serve_args`` and turned into
``AsyncEngineArgs`` with ``from_cli_args``. No engine is started.
"""

from __future__ import annotations

import pytest

from vllm_dsv4_mtp.serve.command import SHORT_OPTIONS, build_command
from vllm_dsv4_mtp.serve.profiles import PROFILES, get_profile


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


def _engine_args(parser, cmd):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    ns = parser.parse_args(cmd.vllm_args())
    validate_parsed_serve_args(ns)
    return ns, AsyncEngineArgs.from_cli_args(ns)


@pytest.mark.parametrize("name", list(PROFILES))
def test_profile_args_accepted_by_vllm_parser(vllm_parser, name, tmp_path):
    profile = get_profile(name)
    # A local directory as MODEL: with HF_HUB_OFFLINE, EngineArgs resolves hub ids through the local cache,
    # and nothing here is loaded anyway.
    cmd = build_command(profile, str(tmp_path), [], environ={})
    ns, ea = _engine_args(vllm_parser, cmd)
    want = dict(profile.args)
    assert ea.model == cmd.model
    assert ea.speculative_config == want["--speculative-config"]
    assert ea.max_num_seqs == want["--max-num-seqs"]
    assert ns.port == want["--port"] and ns.host == want["--host"]
    if profile.hardware is not None:
        assert ea.tensor_parallel_size == want["--tensor-parallel-size"]
        assert ea.gpu_memory_utilization == want["--gpu-memory-utilization"]
        assert ea.kv_cache_dtype == "fp8" and ea.block_size == 256
        assert ea.max_num_batched_tokens == 8192
        assert ea.moe_backend == "aiter"
        assert ea.tokenizer_mode == "deepseek_v4" and ns.reasoning_parser == "deepseek_v4"
        assert ea.trust_remote_code is True
        cc = ea.compilation_config
        assert int(cc.mode) == 3 and str(cc.cudagraph_mode).endswith("FULL_AND_PIECEWISE")
    else:
        assert ea.enforce_eager is True and ea.dtype == "bfloat16" and ea.max_model_len == 1024
        assert ea.served_model_name == ["dsv4-tiny"]


def test_overrides_reach_vllm_exactly(vllm_parser, tmp_path):
    cmd = build_command(
        get_profile("mi355x-pro-tp8"),
        str(tmp_path),
        [
            "--max-num-seqs",
            "64",
            "-tp",
            "4",
            "--speculative-config.num_speculative_tokens",
            "3",
            "--no-trust-remote-code",
            "--gpu-memory-utilization",
            "0.9",
        ],
        environ={},
    )
    ns, ea = _engine_args(vllm_parser, cmd)
    assert ea.max_num_seqs == 64 and ea.tensor_parallel_size == 4
    assert ea.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert ea.trust_remote_code is False and ea.gpu_memory_utilization == 0.9


def test_disabling_speculation_reaches_vllm(vllm_parser, tmp_path):
    cmd = build_command(get_profile("cpu-tiny"), str(tmp_path), ["--speculative-config", "null"], environ={})
    _, ea = _engine_args(vllm_parser, cmd)
    assert ea.speculative_config is None


def test_every_generated_option_appears_once(vllm_parser):
    cmd = build_command(get_profile("mi355x-flash-tp4"), None, ["-tp", "8", "--max-num-seqs", "8"], environ={})
    opts = [a for a in cmd.vllm_args() if a.startswith("-") and not a.lstrip("-").replace(".", "").isdigit()]
    dests = [vllm_parser._option_string_actions[o].dest for o in opts]
    assert len(dests) == len(set(dests)), dests


def test_short_option_table_matches_vllm(vllm_parser):
    """SHORT_OPTIONS (used to merge -tp with --tensor-parallel-size) is exactly vLLM's set of one-dash options."""
    actions = vllm_parser._option_string_actions
    vllm_short = {s for s in actions if s.startswith("-") and not s.startswith("--") and s != "-h"}
    ours = set(SHORT_OPTIONS) - {"-O"}  # -O3 is rewritten to --optimization-level by FlexibleArgumentParser
    assert ours == vllm_short
    for short, long in SHORT_OPTIONS.items():
        if short == "-O":
            assert "--optimization-level" in actions
            continue
        assert actions[short] is actions["--" + long], (short, long)


def test_negated_flags_are_vllm_boolean_pairs(vllm_parser):
    """``--no-x`` is merged with ``--x``: that is only right if every vLLM ``--no-`` option is x's negation."""
    actions = vllm_parser._option_string_actions
    for opt, action in actions.items():
        if opt.startswith("--no-"):
            assert actions.get("--" + opt[5:]) is action, opt


#: What `dsv4-mtp serve --profile mi355x-pro-tp8 amd/DeepSeek-V4-Pro-MXFP4 --dry-run` must print as its command,
#: exactly, in a clean environment: only the switches vLLM's in-tree ROCm target reads (no VLLM_DSV4_MTP_*:
#: quantized MTP tensors are decoded to BF16 by default), then vLLM's own server module.
PRO_TP8_COMMAND = """\
VLLM_ROCM_USE_AITER=1 \\
VLLM_ROCM_USE_AITER_MOE=1 \\
VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1 \\
{python} -m vllm.entrypoints.launchers.api_server.entry \\
  --model amd/DeepSeek-V4-Pro-MXFP4 \\
  --tensor-parallel-size 8 \\
  --gpu-memory-utilization 0.85 \\
  --max-num-seqs 256 \\
  --max-num-batched-tokens 8192 \\
  --kv-cache-dtype fp8 \\
  --block-size 256 \\
  --speculative-config '{{"method":"mtp","num_speculative_tokens":2,"num_speculative_tokens_per_batch_size":[[1,16,2],[17,1024,0]]}}' \\
  --moe-backend aiter \\
  --compilation-config '{{"mode":3,"cudagraph_mode":"FULL_AND_PIECEWISE"}}' \\
  --tokenizer-mode deepseek_v4 \\
  --config-format dsv4_mtp \\
  --reasoning-parser deepseek_v4 \\
  --trust-remote-code \\
  --shutdown-timeout 60 \\
  --middleware vllm_dsv4_mtp.serve.shutdown.EndStreamsOnShutdown \\
  --host 0.0.0.0 \\
  --port 8000"""  # noqa: E501 (the command as printed)


def _printed_command(out: str) -> str:
    """The shell command of a dry run's output: from the first line that is not a comment to the first line
    that does not continue."""
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if not x.startswith("#"))
    j = next(k for k in range(i, len(lines)) if not lines[k].endswith("\\"))
    return "\n".join(lines[i : j + 1])


def test_printed_pro_tp8_command_passes_vllms_parser(vllm_parser, monkeypatch, capsys, tmp_path):
    """The command `dsv4-mtp serve --profile mi355x-pro-tp8 amd/DeepSeek-V4-Pro-MXFP4 --dry-run` prints is exactly
    the one above; split as a shell splits it, its assignments are vLLM environment variables and nothing else,
    and its arguments pass vLLM's own server parser with the values the profile means."""
    import shlex
    import sys

    import vllm.envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    from vllm_dsv4_mtp.serve import cli

    for key in list(cli.os.environ):
        if key.startswith(("VLLM_", "HF_")):
            monkeypatch.delenv(key)
    assert cli.run(["--profile", "mi355x-pro-tp8", "amd/DeepSeek-V4-Pro-MXFP4", "--dry-run"]) == 0
    line = _printed_command(capsys.readouterr().out)
    assert line == PRO_TP8_COMMAND.format(python=sys.executable)
    words = shlex.split(line.replace("\\\n", " "))  # a backslash-newline continues the line, as in a shell
    env = dict(w.split("=", 1) for w in words[:3])
    assert env == {
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_MOE": "1",
        "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1",
    }
    assert set(env) <= set(vllm.envs.environment_variables)
    assert words[3:6] == [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    ns = vllm_parser.parse_args(words[6:])
    validate_parsed_serve_args(ns)
    assert ns.model == "amd/DeepSeek-V4-Pro-MXFP4"
    ns.model = str(tmp_path)  # EngineArgs would resolve the hub id (offline here); nothing is loaded anyway
    ea = AsyncEngineArgs.from_cli_args(ns)
    assert ea.tensor_parallel_size == 8
    assert ea.gpu_memory_utilization == 0.85 and ea.max_num_seqs == 256 and ea.max_num_batched_tokens == 8192
    assert ea.kv_cache_dtype == "fp8" and ea.block_size == 256 and ea.moe_backend == "aiter"
    assert ea.speculative_config == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": [[1, 16, 2], [17, 1024, 0]],
    }
    assert ea.tokenizer_mode == "deepseek_v4" and ns.reasoning_parser == "deepseek_v4" and ea.trust_remote_code
    assert int(ea.compilation_config.mode) == 3
    assert str(ea.compilation_config.cudagraph_mode).endswith("FULL_AND_PIECEWISE")
    assert ns.host == "0.0.0.0" and ns.port == 8000


def test_data_parallel_drops_the_profiles_fused_shared_experts_and_refuses_the_callers(capsys):
    """Issue 49: vLLM refuses fused shared experts under data parallelism (vllm#57919). ``--data-parallel-size 2``
    on the TP8 profile drops the profile's switch with one printed note; set by the caller (``--env``, or an
    environment the profile does not match) it is refused, naming the variable; at DP 1 the profile keeps it; the
    Flash TP4 profile never sets it."""
    from vllm_dsv4_mtp.serve import cli
    from vllm_dsv4_mtp.serve.command import ServeArgsError
    from vllm_dsv4_mtp.serve.profiles import FUSED_SHARED_EXPERTS

    pro = get_profile("mi355x-pro-tp8")
    assert build_command(pro, None, [], environ={}).env[FUSED_SHARED_EXPERTS] == "1"
    dp = build_command(pro, None, ["--data-parallel-size", "2", "--enable-expert-parallel"], environ={})
    assert FUSED_SHARED_EXPERTS not in dp.env and FUSED_SHARED_EXPERTS not in dp.shell()
    (fse,) = [n for n in dp.notes if FUSED_SHARED_EXPERTS in n]
    assert "57919" in fse
    flash = get_profile("mi355x-flash-tp4")
    assert FUSED_SHARED_EXPERTS not in flash.env
    for profile, environ, env in ((flash, {FUSED_SHARED_EXPERTS: "1"}, None), (pro, {}, {FUSED_SHARED_EXPERTS: "1"})):
        with pytest.raises(ServeArgsError, match=FUSED_SHARED_EXPERTS):
            build_command(profile, None, ["--data-parallel-size", "2"], env_overrides=env, environ=environ)
    assert cli.run(["--profile", "mi355x-pro-tp8", "--data-parallel-size", "2", "--dry-run"]) in (0, 2)
    out = capsys.readouterr().out
    assert f"# note: {FUSED_SHARED_EXPERTS}=1 dropped" in out and f"{FUSED_SHARED_EXPERTS}=1 \\" not in out


def _data_parallel(name: str) -> bool:
    return dict(PROFILES[name].args).get("--data-parallel-size", 1) > 1


@pytest.mark.parametrize(
    "name", sorted(p for p in PROFILES if PROFILES[p].hardware == "mi355x" and not _data_parallel(p))
)
def test_every_mi355x_profile_carries_a_k_schedule_the_dry_run_prints_and_vllm_takes(name, capsys):
    """Issue 48: each MI355X profile's speculative config has vLLM's ``num_speculative_tokens_per_batch_size``,
    printed in one dry-run line; vLLM's own validation and lookup accept it; a dotted ``num_speculative_tokens`` on
    the command line asks for a static K and drops it (one note); under DP the note says vLLM runs static K.
    ``cpu-tiny`` carries none: on this CPU no schedule beat serving without MTP (docs/benchmarks.md)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from vllm_dsv4_mtp.serve import cli
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

    cmd = build_command(get_profile(name), None, [], environ={})
    spec = cmd.flag("speculative-config")
    lookup = build_dynamic_sd_schedule_lookup(spec[SCHEDULE_KEY], cmd.flag("max-num-seqs"), 2)
    assert lookup[1] == 2 and lookup[-1] == 0  # drafts at one request, none at the profile's full batch
    assert cli.run(["--profile", name, "--dry-run", "--no-capacity-check"]) in (0, 2)
    out = capsys.readouterr().out
    assert sum(f"MTP K schedule ({SCHEDULE_KEY}): K=2 at 1-" in line for line in out.splitlines()) == 1
    static = build_command(get_profile(name), None, ["--speculative-config.num_speculative_tokens", "3"], environ={})
    assert static.flag("speculative-config") == {"method": "mtp", "num_speculative_tokens": 3}
    assert any("K schedule dropped" in n for n in static.notes)
    dp = build_command(get_profile(name), None, ["--data-parallel-size", "2"], environ={})
    assert any("vllm#45963" in n and "static K=2" in n for n in dp.notes)


def test_the_dp8_ep_profile_spans_nodes_with_commands_vllm_turns_into_one_dp_group(capsys, tmp_path):
    """Issue 49: ``mi355x-pro-dp8-ep`` is DP8 attention with EP8 experts on one node: no fused shared experts (vLLM
    turns them off under EP), a static K (vLLM drops a schedule under DP, vllm#45963), the capacity check in its DP
    topology. ``--nodes 2 --dry-run`` prints one command per node; vLLM's own parser and ``EngineArgs`` turn them
    into one DP16 group with EP, eight local ranks per node starting at 0 and 8, hybrid load balancing, node 0's
    address and one RPC port. A TP profile is refused ``--nodes`` (it grows by replicas behind a router)."""
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR
    from vllm_dsv4_mtp.serve import cli
    from vllm_dsv4_mtp.serve.profiles import FUSED_SHARED_EXPERTS, SCHEDULE_KEY

    cmd = build_command(get_profile("mi355x-pro-dp8-ep"), None, [], environ={})
    assert cmd.flag("data-parallel-size") == 8 and cmd.flag("enable-expert-parallel") is True
    assert cmd.flag("tensor-parallel-size") == 1 and FUSED_SHARED_EXPERTS not in cmd.env
    assert cmd.flag("speculative-config") == {"method": "mtp", "num_speculative_tokens": 2}
    assert SCHEDULE_KEY not in cmd.shell()

    assert cli.run(["--profile", "mi355x-pro-dp8-ep", "--nodes", "2", "--head-address", "10.0.0.1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "capacity check: amd/DeepSeek-V4-Pro-MXFP4 on MI355X" in out and "TP=1 DP=16 EP" in out and "fits" in out
    nodes = out.split("\n# node ")[1:]
    assert len(nodes) == 2
    configs = []
    for rank, text in enumerate(nodes):
        assert text.startswith(f"{rank} of 2: DP ranks {8 * rank}-{8 * rank + 7} of 16")
        body = "\n".join(ln for ln in text.splitlines()[1:] if not ln.startswith("#")).split("capacity check:")[0]
        words = shlex.split(body.replace("\\\n", " "))
        argv = words[words.index("-m") + 2 :]
        argv[argv.index("--model") + 1] = str(MXFP4_CHECKPOINT_DIR)  # the tiny checkpoint stands in for Pro
        i = argv.index("--reasoning-parser")  # it builds the tokenizer's vocabulary; the stand-in is read without
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[:i] + argv[i + 2 :])
        args = EngineArgs.from_cli_args(ns)
        args.skip_tokenizer_init = True
        pc = args.create_engine_config().parallel_config
        configs.append(
            (pc.data_parallel_size, pc.data_parallel_size_local, pc.data_parallel_rank, pc.data_parallel_hybrid_lb)
        )
        assert (pc.data_parallel_master_ip, pc.data_parallel_rpc_port) == ("10.0.0.1", 13345)
        assert pc.enable_expert_parallel and pc.tensor_parallel_size == 1
    assert configs == [(16, 8, 0, True), (16, 8, 8, True)]

    assert cli.run(["--profile", "mi355x-pro-tp8", "--nodes", "2", "--dry-run"]) == 2
    assert "a TP deployment grows by replicas behind a router" in capsys.readouterr().err
    assert cli.run(["--profile", "mi355x-pro-dp8-ep", "--nodes", "2"]) == 2  # which node is this?
    assert "give this node's --node-rank (0 to 1) and --head-address" in capsys.readouterr().err
