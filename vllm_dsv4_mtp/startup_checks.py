"""DeepSeek-V4 ``config.json`` checks that run before vLLM's own config code: the ``dsv4_mtp`` config format.

vLLM 0.32 builds its ``SpeculativeConfig`` and the MTP proposer from ``config.json`` before any model code of the
plugin runs, so two bad inputs die inside vLLM naming neither the file nor the field:

- ``num_nextn_predict_layers: 0`` with ``speculative_config={"method": "mtp", "num_speculative_tokens": K}``:
  ``ZeroDivisionError: integer modulo by zero`` (``SpeculativeConfig`` computes ``K % n_predict``);
- a negative dimension such as ``hidden_size: -128``: the proposer's buffers fail with ``zeros: Dimension size
  must be non-negative``.

The one place vLLM lets a plugin run code there without patching vLLM is a registered config parser
(``vllm.transformers_utils.config.register_config_parser``), chosen with ``--config-format`` (engine argument
``config_format``); the general-plugin hook (``vllm.general_plugins``) runs earlier but sees no engine arguments.
:func:`register_config_format` registers ``dsv4_mtp``: vLLM's own HF parser, then, for ``model_type:
deepseek_v4``, the plugin's full validation of the config (:class:`~vllm_dsv4_mtp.config.DeepseekV4Spec`, every
error naming config.json and the field) and, when vLLM parses the config of the MTP draft, that the checkpoint
declares an MTP layer. Without ``--config-format dsv4_mtp`` vLLM's own messages stand; ``dsv4-mtp inspect --mtp
DIR`` is the same check as a pre-flight command.
"""

from __future__ import annotations

import copy
from pathlib import Path

__all__ = ["CONFIG_FORMAT", "StartupCheckError", "check_config", "register_config_format"]

CONFIG_FORMAT = "dsv4_mtp"
# the architecture vLLM's SpeculativeConfig gives the draft of a DeepSeek-V4 target (method "mtp")
_MTP_DRAFT_ARCH = "DeepSeekV4MTPModel"


class StartupCheckError(RuntimeError):
    """A config.json that vLLM would reject with an unclear error, or accept and then fail on. Not a ValueError:
    vLLM's pydantic config classes would rewrap a ValueError into a multi-line validation report."""


def check_config(model: str | Path, config: dict, *, mtp_draft: bool) -> None:
    """Validate a DeepSeek-V4 ``config.json`` dict (``mtp_draft``: vLLM is building the MTP draft from it)."""
    from vllm_dsv4_mtp.config import ConfigError, DeepseekV4Spec

    source = str(Path(model) / "config.json")
    try:
        spec = DeepseekV4Spec.from_dict(config, source=source)
    except ConfigError as e:
        raise StartupCheckError(str(e)) from None
    if mtp_draft and spec.num_nextn_predict_layers == 0:
        raise StartupCheckError(
            f"{source}: num_nextn_predict_layers = 0: the checkpoint has no MTP layer, so it cannot be served with "
            f"speculative_config method 'mtp'; serve it without a speculative config"
        )


def _own_tokenizer_wanted(argv: list[str] | None = None) -> bool:
    """Will vLLM load the checkpoint's own tokenizer? Not with ``--tokenizer DIR`` or ``--skip-tokenizer-init`` on
    the server's command line (a config parser is not told vLLM's tokenizer arguments; ``LLM(tokenizer=...)``
    with this config format is not seen, see docs/bad-inputs.md)."""
    import sys

    args = sys.argv if argv is None else argv
    return not any(a.split("=", 1)[0].replace("_", "-") in ("--tokenizer", "--skip-tokenizer-init") for a in args)


def check_tokenizer(model: str | Path) -> None:
    """The checkpoint folder's tokenizer files, as ``dsv4-mtp inspect`` checks them (same messages). vLLM loads the
    tokenizer in the API server before the engine (and any model code) starts, so this is the plugin's one chance
    to name the folder and the files before transformers' ``Couldn't instantiate the backend tokenizer``."""
    from vllm_dsv4_mtp.formats.checkpoint import tokenizer_problems

    if not _own_tokenizer_wanted():
        return
    problems = tokenizer_problems(model)
    if problems:
        raise StartupCheckError("; ".join(problems))


def _is_mtp_draft(config, hf_overrides) -> bool:
    """Is vLLM parsing this config for the MTP draft? Its ``hf_overrides`` then turn a DeepSeek-V4 config into
    the draft architecture (applied here to a copy, as vLLM's own parser probes them)."""
    if not callable(hf_overrides):
        return False
    probe = hf_overrides(copy.deepcopy(config))
    return _MTP_DRAFT_ARCH in (getattr(probe, "architectures", None) or [])


def register_config_format() -> None:
    """Register the ``dsv4_mtp`` config parser with vLLM (idempotent; cheap: imports vLLM's config module only)."""
    from vllm.transformers_utils.config import HFConfigParser, get_config_parser, register_config_parser

    try:
        if type(get_config_parser(CONFIG_FORMAT)).__name__ == "Dsv4MtpConfigParser":
            return
    except ValueError:  # not registered yet
        pass

    @register_config_parser(CONFIG_FORMAT)
    class Dsv4MtpConfigParser(HFConfigParser):
        """vLLM's HF config parser, plus :func:`check_config` for DeepSeek-V4 checkpoints."""

        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
                # transformers would say "Should have a `model_type` key in its config.json"
                raise StartupCheckError(
                    f"{Path(model) / 'config.json'}: not found: a checkpoint directory needs its config.json"
                )
            overrides = kwargs.get("hf_overrides")
            config_dict, config = super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
            if config_dict.get("model_type") == "deepseek_v4":
                raw = {**config_dict, **overrides} if isinstance(overrides, dict) else config_dict
                check_config(model, raw, mtp_draft=_is_mtp_draft(config, overrides))
                check_tokenizer(model)
            return config_dict, config


def check_step_budget(vllm_config) -> None:
    """Refuse an engine in which a prompt the server accepts could never be scheduled (issue 38, item 4).

    Without chunked prefill a prompt must fit one step's token budget whole. vLLM checks that against
    ``--max-model-len`` when chunked prefill is off on the command line, but on CPU its platform turns chunked
    prefill off later for ``model_type: deepseek_v4`` (vLLM sees MLA; ``VLLM_MLA_DISABLE=1`` keeps it on), after
    that check: it raises ``max_num_batched_tokens`` but, with speculative decoding, the scheduler's own
    ``max_num_scheduled_tokens`` keeps the value given, and a longer prompt then waits forever with no error.
    The portable target calls this while the engine starts, so the flags are named before any request.
    """
    sched = vllm_config.scheduler_config
    if sched.enable_chunked_prefill:
        return
    budget = min(b for b in (sched.max_num_batched_tokens, sched.max_num_scheduled_tokens) if b is not None)
    max_len = vllm_config.model_config.max_model_len
    if budget < max_len:
        raise StartupCheckError(
            f"a prompt longer than {budget} tokens could never be scheduled, so it would wait forever: chunked "
            f"prefill is off (vLLM's CPU platform turns it off for model_type deepseek_v4 unless "
            f"VLLM_MLA_DISABLE=1) and a step schedules at most {budget} tokens (--max-num-batched-tokens), "
            f"while --max-model-len is {max_len}. Give --max-num-batched-tokens >= {max_len}, lower "
            f"--max-model-len, or keep chunked prefill on with VLLM_MLA_DISABLE=1"
        )


#: command-line flag -> (where the final config keeps it, what it is): the flags vLLM's CPU platform turns off for
#: ``model_type: deepseek_v4`` (it sees MLA) on CPUs without AMX, with one INFO line that names neither flag
MLA_DROPPED = {
    "--enable-prefix-caching": (("cache_config", "enable_prefix_caching"), "prefix caching"),
    "--enable-chunked-prefill": (("scheduler_config", "enable_chunked_prefill"), "chunked prefill"),
}


def _passed(flag: str, argv: list[str]) -> bool:
    """Was ``flag`` turned on on this command line (``--x`` or ``--x=true``, underscores or dashes)? vLLM's
    boolean flags take no separate value; ``--no-x`` turns one off."""
    on = False
    for a in argv:
        name, eq, value = a.partition("=")
        name = name.replace("_", "-")
        if name == flag:
            on = not eq or value.lower() in ("true", "1", "yes")
        elif name == "--no-" + flag[2:]:
            on = False
    return on


def dropped_flags_line(vllm_config, argv: list[str] | None = None) -> str | None:
    """One start-up line naming each flag on the server's command line that the final config no longer has on,
    and the fix; None when nothing was dropped."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    hf = getattr(vllm_config.model_config, "hf_config", None)
    if getattr(hf, "model_type", None) != "deepseek_v4":
        return None
    dropped = [
        (flag, what)
        for flag, ((part, field), what) in MLA_DROPPED.items()
        if _passed(flag, argv) and not getattr(getattr(vllm_config, part), field)
    ]
    if not dropped:
        return None
    flags = " and ".join(f for f, _ in dropped)
    return (
        f"vllm-dsv4-mtp: {flags} dropped: vLLM's CPU platform turns {' and '.join(w for _, w in dropped)} off for "
        f"model_type deepseek_v4 (it sees MLA) on CPUs without AMX. Set VLLM_MLA_DISABLE=1 to keep "
        f"{'them' if len(dropped) > 1 else 'it'} (dsv4-mtp serve sets it when the command asks for "
        f"{'them' if len(dropped) > 1 else 'it'}); the portable model does not use vLLM's MLA"
    )
