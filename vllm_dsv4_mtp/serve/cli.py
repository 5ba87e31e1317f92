"""``dsv4-mtp serve``: a named profile, expanded to vLLM's OpenAI server command, checked, printed, then run.

The server process *is* vLLM's: after printing the command this process replaces itself with it
(``os.execve``), so signals (Ctrl-C, ``docker stop``'s SIGTERM) reach vLLM's own handlers directly, the PID
stays the one the caller started, and no wrapper process is left to forward signals or to linger.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP = """\
usage: dsv4-mtp serve --profile NAME [options] [MODEL] [vLLM flags...] [-- vLLM flags...]
       dsv4-mtp serve --list-profiles

Serve DeepSeek-V4 with MTP speculative decoding through vLLM's OpenAI-compatible server. On MI355X the
target is vLLM's in-tree DeepSeek-V4 with AITER and the draft is the plugin's BF16 MTP; on CPU both are the
plugin's portable models.

MODEL defaults to the profile's model. vLLM flags (after MODEL, or after --) replace the profile's flags of
the same name; a dotted flag edits one key of a JSON flag, e.g.
  --speculative-config.num_speculative_tokens 3     (K = 3, method kept)
  --speculative-config null                         (no speculative decoding)

options:
  --profile NAME        profile to expand (--list-profiles shows them)
  --list-profiles       print the profiles and exit
  --dry-run             print the environment, the command and the capacity check, then exit
  --env KEY=VALUE       set an environment variable for the server (wins over the profile and the caller)
  --gpu-memory-gb GB    memory per GPU for the capacity check (default: the profile's hardware)
  --no-capacity-check   start even if the capacity arithmetic says it cannot fit
  --nodes N             span N nodes (a DP+EP profile): --dry-run prints every node's command; to start one,
                        give --node-rank R and --head-address IP (node 0's address) on each node
  --ignore-vllm-version start even if the installed vLLM is outside the supported range
  -h, --help            show this help and exit
"""

_VALUED = ("--profile", "--env", "--gpu-memory-gb", "--nodes", "--node-rank", "--head-address")
_SWITCHES = ("--list-profiles", "--dry-run", "--no-capacity-check", "--ignore-vllm-version", "-h", "--help")


def add_parser(subparsers) -> None:
    # All arguments go to run() verbatim: most of them are vLLM's, which only vLLM's parser knows, and their
    # values must keep their order. prefix_chars="\0" makes argparse treat every token as a value.
    p = subparsers.add_parser(
        "serve", help="serve a model with a named profile (vLLM OpenAI server)", add_help=False, prefix_chars="\0"
    )
    p.add_argument("serve_argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: run(args.serve_argv))


class _Options:
    def __init__(self) -> None:
        self.profile: str | None = None
        self.env: dict[str, str] = {}
        self.gpu_memory_gb: float | None = None
        self.list_profiles = self.dry_run = self.no_capacity_check = self.ignore_vllm_version = False
        self.help = False
        self.model: str | None = None
        self.vllm: list[str] = []
        self.nodes = 1
        self.node_rank: int | None = None
        self.head_address: str | None = None


def parse_serve_argv(argv: list[str]) -> _Options:
    """Separate this command's options and MODEL from the vLLM flags (kept in order)."""
    from vllm_dsv4_mtp.serve.command import _NUMBER, ServeArgsError

    o = _Options()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            o.vllm += argv[i + 1 :]
            break
        name, eq, val = tok.partition("=")
        if name in _VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise ServeArgsError(f"{name} needs a value")
                val = argv[i + 1]
                i += 1
            if name == "--profile":
                o.profile = val
            elif name in ("--nodes", "--node-rank"):
                if not val.isdigit():
                    raise ServeArgsError(f"{name} needs a whole number, got {val!r}")
                setattr(o, name[2:].replace("-", "_"), int(val))
            elif name == "--head-address":
                o.head_address = val
            elif name == "--gpu-memory-gb":
                try:
                    o.gpu_memory_gb = float(val)
                except ValueError:
                    raise ServeArgsError(f"--gpu-memory-gb needs a number, got {val!r}") from None
            else:
                k, sep, v = val.partition("=")
                if not sep or not k:
                    raise ServeArgsError(f"--env needs KEY=VALUE, got {val!r}")
                o.env[k] = v
        elif tok in _SWITCHES:
            attr = {"-h": "help", "--help": "help"}.get(tok, tok[2:].replace("-", "_"))
            setattr(o, attr, True)
        elif tok.startswith("-") and not _NUMBER.match(tok):
            o.vllm.append(tok)
            if (
                "=" not in tok
                and i + 1 < len(argv)
                and argv[i + 1] not in _VALUED + _SWITCHES + ("--",)
                and (not argv[i + 1].startswith("-") or _NUMBER.match(argv[i + 1]))
            ):
                o.vllm.append(argv[i + 1])
                i += 1
        elif o.model is None and not o.vllm:
            o.model = tok
        else:
            raise ServeArgsError(f"unexpected argument {tok!r}: give MODEL before any vLLM flag (or as --model)")
        i += 1
    return o


def _int_tokens(value) -> int | None:
    """vLLM's human-readable integers (``32k`` = 32000, ``32K`` = 32768); -1 / auto -> None."""
    if value is None:
        return None
    s = str(value).strip()
    if s in ("-1", "auto"):
        return None
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def capacity_report(cmd, gpu_memory_gb: float | None = None):
    """The capacity arithmetic for a built command (None when the profile has no GPU or no config is known).

    The draft counted is the one the server's environment selects (``VLLM_DSV4_MTP_DRAFT_PRECISION``, read from
    the environment the server will get, so ``--env`` and the caller's environment both count)."""
    from vllm_dsv4_mtp.draft_policy import draft_precision
    from vllm_dsv4_mtp.serve.capacity import PRECISION_DRAFTS, Parallelism, check_capacity

    if cmd.profile.hardware is None:
        return None
    par = Parallelism(
        tp=int(cmd.flag("tensor-parallel-size", 1)),
        pp=int(cmd.flag("pipeline-parallel-size", 1)),
        dp=int(cmd.flag("data-parallel-size", 1)),
        expert_parallel=bool(cmd.flag("enable-expert-parallel", False)),
    )
    return check_capacity(
        cmd.model,
        hardware=cmd.profile.hardware,
        par=par,
        gpu_memory_utilization=float(cmd.flag("gpu-memory-utilization", 0.92)),
        max_model_len=_int_tokens(cmd.flag("max-model-len")),
        kv_cache_dtype=str(cmd.flag("kv-cache-dtype", "auto")),
        mtp=cmd.mtp,
        gpu_memory_gb=gpu_memory_gb,
        draft=PRECISION_DRAFTS[draft_precision(cmd.env)],
    )


def _missing_model_dir(cmd, o: _Options) -> str | None:
    """A MODEL that is a path (absolute or ./relative) must be a directory; hub ids are vLLM's to resolve."""
    path = Path(cmd.model).expanduser()
    if not (path.is_absolute() or cmd.model.startswith(".")) or path.is_dir():
        return None
    hint = (
        " (the embedded tiny checkpoints ship with the repository, not with the wheel: run `make demo` in a "
        "clone, or pass MODEL)"
        if cmd.profile.model is None and o.model is None
        else ""
    )
    return f"error: model directory {cmd.model} does not exist{hint}"


def _capacity_refusal(cmd, o: _Options) -> str | None:
    """Print the capacity arithmetic; the refusal message when it cannot fit (unless --no-capacity-check)."""
    try:
        report = capacity_report(cmd, o.gpu_memory_gb)
    except (ValueError, KeyError) as e:  # a malformed config.json: ConfigError names file and field
        return f"error: capacity check: {e}"
    if report is None:
        print(
            f"# capacity check skipped: {cmd.model} is neither a local checkpoint directory nor a known "
            "checkpoint, so there is no config.json to compute from"
        )
        return None
    print(report.text, flush=True)
    if not report.fits and not o.no_capacity_check:
        return (
            "refused: the capacity check above says this cannot fit (change one of the listed flags, or pass "
            "--no-capacity-check to start anyway)"
        )
    return None


def _node_commands(cmd, o: _Options) -> list[tuple[str, object]]:
    """``--nodes N``: ``(header, command)`` of every node for a dry run, or of ``--node-rank`` only to start it."""
    from vllm_dsv4_mtp.serve.command import HEAD_PLACEHOLDER, ServeArgsError, build_command, node_flags

    if o.nodes <= 1:
        if o.node_rank is not None or o.head_address is not None:
            raise ServeArgsError("--node-rank and --head-address go with --nodes N (N > 1)")
        return []
    if not o.dry_run and (o.node_rank is None or o.head_address is None):
        raise ServeArgsError(
            f"--nodes {o.nodes}: give this node's --node-rank (0 to {o.nodes - 1}) and --head-address (node 0's "
            "address, reachable from every node), or --dry-run to print every node's command"
        )
    head = o.head_address or HEAD_PLACEHOLDER
    ranks = [o.node_rank] if o.node_rank is not None else range(o.nodes)
    out = []
    for rank in ranks:
        node = build_command(cmd.profile, o.model, o.vllm + node_flags(cmd, o.nodes, rank, head), env_overrides=o.env)
        local = int(cmd.flag("data-parallel-size"))
        out.append(
            (
                f"node {rank} of {o.nodes}: DP ranks {rank * local}-{(rank + 1) * local - 1} of {local * o.nodes}, EP "
                f"over all of them; an API server on this node{' (coordinates the DP group)' if rank == 0 else ''}"
                + (f"; {HEAD_PLACEHOLDER} = node 0's address (--head-address)" if head == HEAD_PLACEHOLDER else ""),
                node,
            )
        )
    return out


def run(argv: list[str]) -> int:
    from vllm_dsv4_mtp.serve.command import ServeArgsError, build_command, server_module
    from vllm_dsv4_mtp.serve.profiles import PROFILES, default_model, get_profile
    from vllm_dsv4_mtp.versions import UnsupportedVllmError, check_vllm_version

    try:
        o = parse_serve_argv(argv)
        if o.help:
            print(HELP, end="")
            return 0
        if o.list_profiles:
            for p in PROFILES.values():
                print(f"{p.name:<18} {p.description}\n{'':<18} model: {default_model(p)}")
            return 0
        if o.profile is None:
            raise ServeArgsError(f"--profile is required (one of: {', '.join(PROFILES)})")
        profile = get_profile(o.profile)
        cmd = build_command(profile, o.model, o.vllm, env_overrides=o.env)
        nodes = _node_commands(cmd, o)
        if nodes:
            cmd = nodes[0][1]
    except (ServeArgsError, KeyError) as e:
        print(f"dsv4-mtp serve: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2

    try:
        vllm_version = check_vllm_version()
        version_problem = None
    except UnsupportedVllmError as e:
        vllm_version, version_problem = None, str(e)
    try:
        module = server_module()
        for c in [cmd] + [c for _, c in nodes]:
            c.module = module
    except ServeArgsError:
        pass  # no vLLM here: the printed command keeps the 0.32 module name

    print(f"# dsv4-mtp serve --profile {profile.name}: {profile.description}")
    print(f"# runs {cmd.what_runs()}")
    if vllm_version:
        print(f"# vLLM {vllm_version}")
    print("# environment: profile defaults; the caller's environment and --env win (origin in brackets)")
    for k, v, origin in cmd.env_report:
        print(f"#   {k}={v}  [{origin}]")
    for note in cmd.notes:
        print(f"# note: {note}")
    for header, node in nodes:
        print(f"# {header}")
        print(node.shell())
    if not nodes:
        print(cmd.shell(), flush=True)

    problem = _missing_model_dir(cmd, o) or (_capacity_refusal(cmd, o) if profile.hardware is not None else None)
    if problem:
        print(f"dsv4-mtp serve: {problem}", file=sys.stderr)
        return 2

    if version_problem and not o.ignore_vllm_version:
        stream = sys.stdout if o.dry_run else sys.stderr
        print(f"{'# note' if o.dry_run else 'dsv4-mtp serve: error'}: {version_problem}", file=stream)
        if not o.dry_run:
            return 2
    if o.dry_run:
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd.python, cmd.argv, cmd.env)  # does not return
    return 0  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_dsv4_mtp.serve.cli ...`` (the same as ``dsv4-mtp serve ...``)."""
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
