"""``dsv4-mtp tune``: measure MTP off, K = 0 in a schedule and static K = 1..Kmax on this machine's own server, pick
K per batch size, write the schedule, serve it once more and compare it with every static choice and with off.

::

    plan      = the profile (or the command) with the caller's vLLM flags, its own speculative config removed
    refuse if --data-parallel-size > 1          # vLLM drops the schedule under DP (vllm#45963): nothing to tune
    for config in off, k0 (K=0 in a schedule), k1 .. kKmax:          # one server each, one at a time
        serve plan + config (--max-num-seqs >= the largest level)
        warm up, then per concurrency C: vLLM's bench serve (the prompts asked for), tok/s and acceptance
    picks     = per C, the lowest K within --tie of the best of k0..kKmax      (evaluate/tune_pick.py)
    schedule  = the picks as batch-size ranges (each level's K up to the geometric midpoint to the next)
    tuned     = static K if every pick is the same K > 0, else that schedule
    serve tuned once more at every C and at each threshold +-1 (vllm#49548's collapse)
    recommend = tuned, the best static K, or no speculative config (at the --load levels)
    write tune.json, tune.md, tune.png and speculative-config.json (the tuned config); print the commands

K = 0 inside a schedule is not MTP off (vLLM still runs the draft's forward at every step, to keep its cache), so
it is measured as a candidate of its own; off only competes as the whole server's alternative.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dsv4_mtp.evaluate import tune_pick as tp
from vllm_dsv4_mtp.evaluate.server import LOOPBACK, ServerSpec
from vllm_dsv4_mtp.serve.profiles import Profile

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)

DP_REFUSAL = (
    "dsv4-mtp tune: --data-parallel-size {dp}: vLLM drops num_speculative_tokens_per_batch_size under data "
    "parallelism > 1 (vllm#45963: its ranks could pick different K) and runs the static maximum K instead, so a "
    "tuned schedule would never run there. Tune with --data-parallel-size 1 (one replica; a schedule tuned there "
    "does not apply to a DP server), or compare static K on the DP server with `dsv4-mtp bench`"
)


class TuneError(ValueError):
    """A tune command line that cannot be run; the message says which argument."""


@dataclass
class Plan:
    """What every candidate server shares: the profile (None: a plain vLLM command), model and vLLM flags."""

    profile: str | None
    model: str
    flags: list[str]  # the caller's vLLM flags without any --speculative-config
    base_config: dict  # the profile's / command's MTP speculative config without a schedule (the method kept)
    max_num_seqs: int
    tokenizer: str
    dp: int
    prefix: list[str] = field(default_factory=list)  # the command's words before its flags (for the printed command)
    env: dict[str, str] = field(default_factory=dict)  # the command's environment, for every server it starts

    def server_flags(self, config: dict | None) -> list[str]:
        return [
            *self.flags,
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--speculative-config",
            "null" if config is None else json.dumps(config, separators=(",", ":")),
        ]

    def server_spec(self, config: dict | None) -> ServerSpec:
        if self.profile is not None:
            return ServerSpec(model=self.model, profile=self.profile, extra_args=self.server_flags(config))
        return CommandSpec(model=self.model, extra_args=self.server_flags(config))

    def command(self, config: dict | None) -> str:
        """The serving command with ``config`` (None: without a speculative config)."""
        spec = [] if config is None else ["--speculative-config", json.dumps(config, separators=(",", ":"))]
        if self.profile is not None:
            if config is None:
                spec = ["--speculative-config", "null"]  # the profile carries one: null removes it
            return shlex.join(["dsv4-mtp", "serve", "--profile", self.profile, self.model, *self.flags, *spec])
        model = [] if self.model in self.prefix else ["--model", self.model]  # `python -m ...`: it was a flag
        return shlex.join([*self.prefix, *model, *self.flags, *spec])


class CommandSpec(ServerSpec):
    """A server from a plain vLLM command: vLLM's server module with the command's flags, no profile."""

    def serve_argv(self, port: int) -> list[str]:
        from vllm_dsv4_mtp.serve.command import build_command

        cmd = build_command(bare_profile(), self.model, self.extra_args)
        return [*cmd.argv, "--host", LOOPBACK, "--port", str(port)]


def bare_profile() -> Profile:
    """No profile: a plain vLLM command's flags are all there is."""
    return Profile(name="command", description="a plain vLLM command", model=None, hardware=None, args=())


_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def parse_command(text: str) -> tuple[str | None, str | None, list[str], list[str], dict[str, str]]:
    """``(profile, model, vLLM flags, words before the flags, environment)`` of a ``dsv4-mtp serve ...``,
    ``vllm serve MODEL ...`` or ``python -m vllm.entrypoints.openai.api_server ...`` line."""
    from vllm_dsv4_mtp.serve.cli import parse_serve_argv

    words = shlex.split(text)
    env_words = []
    while words and _ENV_WORD.match(words[0]):
        env_words.append(words.pop(0))
    env = dict(w.partition("=")[::2] for w in env_words)
    names = [os.path.basename(w) for w in words[:2]]
    if names[:2] == ["dsv4-mtp", "serve"]:
        o = parse_serve_argv(words[2:])
        return o.profile, o.model, o.vllm, env_words + words[:2], env | o.env
    if names[:2] == ["vllm", "serve"]:
        rest = words[2:]
        model = rest.pop(0) if rest and not rest[0].startswith("-") else None
        return None, model, rest, env_words + words[:2] + ([model] if model else []), env
    if "-m" in words[:3]:
        i = words.index("-m") + 2
        return None, None, words[i:], env_words + words[:i], env
    raise TuneError(
        f"--command: expected `dsv4-mtp serve ...`, `vllm serve MODEL ...` or `python -m MODULE ...`: {text}"
    )


def resolve(args) -> Plan:
    """The :class:`Plan` from ``--profile`` / ``--command``, ``--model`` and the vLLM flags after ``--``."""
    from vllm_dsv4_mtp.serve.command import BARE, ServeArgsError, build_command, parse_vllm_args
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY, get_profile, mtp_speculative_config

    prefix: list[str] = []
    env: dict[str, str] = {}
    profile, model, flags = args.profile, args.model, list(args.vllm_flags)
    if args.command:
        profile, cmd_model, cmd_flags, prefix, env = parse_command(args.command)
        model = model or cmd_model
        flags = cmd_flags + flags
    try:
        prof = get_profile(profile) if profile else bare_profile()
        cmd = build_command(prof, model, flags)
    except (KeyError, ServeArgsError) as e:
        raise TuneError(str(e.args[0] if isinstance(e, KeyError) else e)) from None
    if profile is None and not (model or cmd.flag("model")):
        raise TuneError("--command names no model: give it there or with --model")
    spec = cmd.flag("speculative-config")
    if isinstance(spec, dict) and spec.get("method") in ("mtp", "deepseek_mtp"):
        base = {k: v for k, v in spec.items() if k != SCHEDULE_KEY}
    else:
        base = mtp_speculative_config(1)
    # the tuner owns the speculative config and --max-num-seqs; its servers listen on loopback ports of their own
    own = []
    for key, option, _path, value in parse_vllm_args(flags):
        if key in ("speculative-config", "max-num-seqs", "model", "host", "port"):
            continue
        own += [option] if value is BARE else [option, value]
    top = max(args.concurrency)
    return Plan(
        profile=profile,
        model=cmd.model,
        flags=own,
        base_config=base,
        max_num_seqs=max(int(cmd.flag("max-num-seqs") or 0), top),
        tokenizer=str(cmd.flag("tokenizer") or cmd.model),
        dp=int(cmd.flag("data-parallel-size", 1) or 1),
        prefix=prefix,
        env=env,
    )


def candidates(plan: Plan, k_max: int) -> dict[str, dict | None]:
    """``off``, ``k0`` (K = 0 at every batch size, Kmax the config's maximum), ``k1`` .. ``kKmax`` (static)."""
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

    out: dict[str, dict | None] = {tp.OFF: None}
    out[tp.K0] = tp.all_k0(plan.base_config, plan.max_num_seqs, SCHEDULE_KEY, k_max)
    for k in range(1, k_max + 1):
        out[tp.cand(k)] = plan.base_config | {"num_speculative_tokens": k}
    return out


def dataset_flags(args, out: Path) -> tuple[list[str] | None, str]:
    """vLLM bench serve's dataset flags for ``--prompts`` (None: its random set) and a description."""
    if args.prompts == "random":
        return None, f"random, {args.input_len} tokens in"
    path = out / "prompts.jsonl"
    if args.prompts == "held-out":
        from vllm_dsv4_mtp.evaluate.common import fewshot_examples, load_problems, prompt_for

        fewshot = fewshot_examples(args.num_fewshot)
        prompts = [prompt_for(p, fewshot) for p in load_problems()]
        what = f"the held-out problems, {args.num_fewshot}-shot"
    else:
        src = Path(args.prompts)
        if not src.is_file():
            raise TuneError(f"--prompts {args.prompts}: not 'random', 'held-out' or a file")
        lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
        if src.suffix == ".jsonl":
            prompts = [json.loads(ln)["prompt"] for ln in lines]  # vLLM's custom dataset layout
        else:
            prompts = lines  # one prompt a line
        what = f"{src} ({len(prompts)} prompts)"
    if not prompts:
        raise TuneError(f"--prompts {args.prompts}: no prompts")
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", str(args.output_len)]
    return flags + ["--skip-chat-template"], what  # completions: the prompts as written


def measure(plan: Plan, name: str, config: dict | None, levels: list[int], args, dataset, out: Path) -> list[dict]:
    """One server for ``config``, measured at ``levels`` (evaluate/levels.py)."""
    from vllm_dsv4_mtp.evaluate.levels import measure_levels
    from vllm_dsv4_mtp.evaluate.server import ManagedServer

    log = out / "servers" / f"{name}.log"
    print(f"# {tp.label(name)}: starting a server (log {log})", file=sys.stderr, flush=True)
    spec = plan.server_spec(config)
    with ManagedServer(spec, quiet=True, log_path=log, start_timeout_s=args.start_timeout, env=plan.env) as srv:
        rows = measure_levels(srv.base_url, name, plan.tokenizer, levels, args, dataset)
        startup = srv.startup_s
    for r in rows:
        r["startup_s"] = round(startup or 0.0, 1)
    return rows


def tune(args, plan: Plan, out: Path) -> dict:
    """The whole run (module docstring); returns the report."""
    from vllm_dsv4_mtp.evaluate.common import machine
    from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY

    t0 = time.time()
    levels = sorted(args.concurrency)
    dataset, what = dataset_flags(args, out)
    configs = candidates(plan, args.k_max)
    rows = [r for name, config in configs.items() for r in measure(plan, name, config, levels, args, dataset, out)]
    tok = tp.tok_s_table(rows)
    picks = tp.pick(tok, levels, args.k_max, args.tie)
    schedule = tp.ranges(levels, [p["k"] for p in picks], plan.max_num_seqs)
    tuned = tp.speculative_config(plan.base_config, schedule, SCHEDULE_KEY)
    served_schedule = tuned.get(SCHEDULE_KEY)
    check = tp.check_levels(served_schedule, plan.max_num_seqs)
    rows += measure(plan, tp.TUNED, tuned, sorted(set(levels) | set(check)), args, dataset, out)
    tok = tp.tok_s_table(rows)
    useful = any(r[2] > 0 for r in schedule)
    rec = tp.recommend(tok, args.load or levels, args.k_max, args.tie, useful)
    chosen = {tp.OFF: None, tp.TUNED: tuned}.get(rec["choice"], configs.get(rec["choice"]))
    return {
        "title": f"dsv4-mtp tune: {Path(plan.model).name}, K up to {args.k_max}, prompts {what}",
        "command": "dsv4-mtp tune " + shlex.join(args.argv),
        "machine": machine(),
        "model": plan.model,
        "profile": plan.profile,
        "prompts": what,
        "output_len": args.output_len,
        "k_max": args.k_max,
        "levels": levels,
        "load": args.load or levels,
        "tie": args.tie,
        "max_num_seqs": plan.max_num_seqs,
        "candidates": configs,
        "rows": rows,
        "picks": picks,
        "schedule": schedule,
        "tuned_config": tuned,
        "check_levels": check,
        "collapse": tp.collapses(tok[tp.TUNED], served_schedule, args.collapse_drop),
        "comparison": comparison(tok, levels, check, args.k_max),
        "recommendation": rec
        | {
            "speculative_config": chosen,
            "command": plan.command(chosen),
            "tuned_command": plan.command(tuned),
            "profile_entry": profile_entry(tuned, SCHEDULE_KEY),
        },
        "wall_s": round(time.time() - t0),
    }


def profile_entry(config: dict, schedule_key: str) -> str:
    """The tuned config as a profile's ``args`` entry (``vllm_dsv4_mtp/serve/profiles.py``)."""
    schedule = config.get(schedule_key)
    ranges = "None" if not schedule else repr(tuple(tuple(r) for r in schedule))
    return f'("--speculative-config", mtp_speculative_config({config["num_speculative_tokens"]}, {ranges}))'


def comparison(tok: tp.TokS, levels: list[int], check: list[int], k_max: int) -> list[dict]:
    """Per concurrency: the tuned config's tok/s and its ratio to off and to each static choice measured there."""
    out = []
    for c in sorted(set(levels) | set(check)):
        row = {"concurrency": c, "tuned": tok[tp.TUNED][c], "threshold_check": c in check and c not in levels}
        for name in [tp.OFF, tp.K0, *(tp.cand(k) for k in range(1, k_max + 1))]:
            v = tok.get(name, {}).get(c)
            row[name] = v
            row[f"tuned/{name}"] = None if not v else round(tok[tp.TUNED][c] / v, 3)
        statics = [tok[tp.cand(k)][c] for k in range(1, k_max + 1) if c in tok.get(tp.cand(k), {})]
        row["tuned/best_static"] = round(tok[tp.TUNED][c] / max(statics), 3) if statics else None
        out.append(row)
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    usage = "dsv4-mtp tune [--profile NAME | --command 'SERVE COMMAND'] [options] [-- vLLM flags...]"
    what = "measure MTP off / K per concurrency on this machine and write a K schedule"
    p = subparsers.add_parser("tune", help=what, description=__doc__.split("\n\n")[0], usage=usage)
    p.add_argument("--profile", default=None, help="dsv4-mtp serve profile (default cpu-tiny unless --command)")
    p.add_argument(
        "--command",
        help="the serving command to tune instead of a profile: 'dsv4-mtp serve --profile P MODEL ...', "
        "'vllm serve MODEL ...' or 'python -m vllm.entrypoints.openai.api_server --model M ...' (its "
        "--speculative-config gives the method; the tuner sets K, the schedule and --max-num-seqs)",
    )
    p.add_argument("--model", help="checkpoint (default: the profile's / the command's)")
    p.add_argument("--k-max", type=int, default=3, help="largest static K to measure (default 3)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_LEVELS), help="levels (1 2 4 ... 64)")
    p.add_argument("--load", type=int, nargs="+", help="the levels you serve at, for the recommendation (default all)")
    p.add_argument("--prompts", default="random", help="random (default), held-out, or a file (.jsonl with 'prompt')")
    p.add_argument("--input-len", type=int, default=64, help="random prompts' length in tokens (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, ignore_eos (default 64)")
    p.add_argument("--num-fewshot", type=int, default=2, help="held-out prompts' solved examples (default 2)")
    p.add_argument("--prompts-per-level", type=int, default=4, help="prompts per level: this x C (default 4)")
    p.add_argument("--min-prompts", type=int, default=16, help="... and at least this many (default 16)")
    p.add_argument("--warmup-prompts", type=int, default=8, help="untimed prompts per server first (default 8)")
    p.add_argument("--tie", type=float, default=0.03, help="tok/s within this fraction tie: lower K (default 0.03)")
    p.add_argument("--collapse-drop", type=float, default=0.10, help="a fall this large is a collapse (0.10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--out", type=Path, default=Path("tune_out"), help="directory for tune.json/.md/.png")
    p.add_argument("--dry-run", action="store_true", help="print each candidate server's command and exit")
    p.add_argument("vllm_flags", nargs="*", metavar="-- vLLM flags", help="vLLM flags for every server")
    p.set_defaults(func=run)
    return p


def _check(args) -> None:
    if args.k_max < 1:
        raise TuneError(f"--k-max must be >= 1, got {args.k_max}")
    if any(c < 1 for c in args.concurrency) or len(set(args.concurrency)) != len(args.concurrency):
        raise TuneError(f"--concurrency needs distinct positive integers, got {args.concurrency}")
    if args.load and not set(args.load) <= set(args.concurrency):
        raise TuneError(f"--load {args.load}: every level must be one of --concurrency {args.concurrency}")
    if args.profile and args.command:
        raise TuneError("give --profile or --command, not both (a dsv4-mtp serve command names its profile)")
    if not args.command and not args.profile:
        args.profile = "cpu-tiny"


def run(args: argparse.Namespace) -> int:
    from vllm_dsv4_mtp.evaluate.tune_report import write_outputs

    args.argv = getattr(args, "argv", None) or sys.argv[2:]
    try:
        _check(args)
        plan = resolve(args)
    except TuneError as e:
        print(f"dsv4-mtp tune: {e}", file=sys.stderr)
        return 2
    if plan.dp > 1:
        print(DP_REFUSAL.format(dp=plan.dp), file=sys.stderr)
        return 2
    if args.dry_run:
        for name, config in candidates(plan, args.k_max).items():
            argv = plan.server_spec(config).serve_argv(0)
            print(f"# {tp.label(name)}\n{shlex.join(argv)}")
        return 0
    out = Path(args.out)
    (out / "servers").mkdir(parents=True, exist_ok=True)
    try:
        report = tune(args, plan, out)
    except TuneError as e:
        print(f"dsv4-mtp tune: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(report, out)
    print(paths["text"])
    return 0
