"""Ops and wall time per mHC call (``hc_pre``, ``hc_post``, ``hc_head``) at T tokens, embedded model's shape.

    .venv/bin/python vllm_dsv4_mtp/benchmarks/hyper_connection.py                       # this tree
    git show 8d90f1e:vllm_dsv4_mtp/model/hyper_connection.py > /tmp/hc_before.py
    .venv/bin/python vllm_dsv4_mtp/benchmarks/hyper_connection.py --module-file /tmp/hc_before.py   # an older version

    .venv/bin/python vllm_dsv4_mtp/benchmarks/hyper_connection.py --decode-ops \
        vllm_dsv4_mtp/embedded/assets/tiny-dsv4-bf16

For each dtype and T it times the modules' public calls (``HyperConnection.pre`` / ``.post``,
``HyperHead``: what the decoder layer runs, fused kernel where it applies) and the torch functions
(``hc_pre`` / ``hc_post`` / ``hc_head``), and counts the operators ``torch.profiler`` records in one call
(every ``aten::`` / ``_C::`` event, nested ones included, and the top-level ones). One thread, as vLLM's
CPU worker pins one core per rank here; each time is the fastest of 9 batches of calls (the dev machine is
shared, and the least disturbed batch is the closest to the call's own cost). Prints a markdown table.

``--decode-ops CKPT`` instead measures a whole decode step in vLLM's engine (in-process, ``enforce_eager``,
``--dtype``, default bfloat16, one prompt of 100 tokens, greedy). Ops per step: ``(ops(generate 33 tokens) -
ops(generate 1 token)) / 32``, every profiler event with ``::`` in its name (engine work included), and of
them mHC's: events under a ``record_function("mhc")`` that this script wraps, in its own process and for the
measurement only, around ``HyperConnection.pre`` / ``.post`` and ``HyperHead.forward``. Ms per step: the
same difference of unprofiled wall times, each the fastest of 7 runs (other jobs' vLLM workers bind to the
same cores of the shared dev machine, and a disturbed run can be many times slower: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _load(path: str | None):
    if path is None:
        from vllm_dsv4_mtp.model import hyper_connection

        return hyper_connection
    spec = importlib.util.spec_from_file_location("hc_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ops(call) -> tuple[int, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    events = [e for e in prof.events() if "::" in e.name]
    top = [e for e in events if e.cpu_parent is None]
    return len(events), len(top)


def _us(call, budget_s: float = 0.4) -> float:
    for _ in range(5):
        call()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s / 4:
        call()
        n += 1
    samples = []
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(n):
            call()
        samples.append((time.perf_counter() - t) / n * 1e6)
    return min(samples)  # the machine is shared: the fastest batch of calls is the least disturbed


def _calls(hc_mod, x, f, d, hc):
    g = torch.Generator().manual_seed(0)
    site = hc_mod.HyperConnection(d, hc, 20, 1e-6, 1e-6)
    head = hc_mod.HyperHead(d, hc, 1e-6, 1e-6)
    for p in list(site.parameters()) + list(head.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.5))
    _, post, comb = site.pre(x)
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    return {
        "HyperConnection.pre": lambda: site.pre(x),
        "hc_pre (torch)": lambda: hc_mod.hc_pre(x, site.fn, site.base, site.scale, **kw),
        "HyperConnection.post": lambda: site.post(f, x, post, comb),
        "hc_post (torch)": lambda: hc_mod.hc_post(f, x, post, comb),
        "HyperHead": lambda: head(x),
        "hc_head (torch)": lambda: hc_mod.hc_head(x, head.fn, head.base, head.scale, hc_eps=1e-6, norm_eps=1e-6),
    }


def _annotate(cls, name: str, static: bool = False) -> None:
    """Wrap ``cls.name`` in ``record_function("mhc")`` (measurement only, in this script's process)."""
    fn = getattr(cls, name)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function("mhc"):
            return fn(*args, **kwargs)

    setattr(cls, name, staticmethod(wrapped) if static else wrapped)


def _under(event, label: str) -> bool:
    while event is not None:
        if event.name == label:
            return True
        event = event.cpu_parent
    return False


def _decode_ops(ckpt: str, module_file: str | None, dtype: str) -> None:
    import os
    import sys

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so profiled here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one core, as the served worker (no OMP barriers)
    hc_mod = _load(module_file)
    sys.modules["vllm_dsv4_mtp.model.hyper_connection"] = hc_mod  # before the plugin's model imports it
    _annotate(hc_mod.HyperConnection, "pre")
    _annotate(hc_mod.HyperConnection, "post", static=True)
    _annotate(hc_mod.HyperHead, "forward")
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
    prompt = {"prompt_token_ids": list(range(3, 103))}

    def count(n_tokens: int) -> tuple[int, int]:
        params = SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([prompt], params, use_tqdm=False)
        events = [e for e in prof.events() if "::" in e.name]
        return len(events), sum(_under(e, "mhc") for e in events)

    def seconds(n_tokens: int) -> float:
        params = SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        runs = []
        for _ in range(7):
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            runs.append(time.perf_counter() - t)
        return min(runs)  # other jobs bind their vLLM workers to the same cores: keep the undisturbed run

    (a1, m1), (a33, m33) = count(1), count(33)
    step_ms = (seconds(33) - seconds(1)) / 32 * 1e3
    print(f"module {hc_mod.__file__}; checkpoint {ckpt}; {dtype}")
    print(
        f"ops per decode step (batch 1): {(a33 - a1) / 32:.0f}, of which mHC: {(m33 - m1) / 32:.0f}; "
        f"ms per decode step (fastest of 7, unprofiled): {step_ms:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module-file", help="a hyper_connection.py to measure instead of the installed one")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--hidden", type=int, default=128, help="D (the embedded model's hidden size)")
    ap.add_argument("--hc", type=int, default=4)
    ap.add_argument("--decode-ops", metavar="CKPT", help="count the ops of a decode step of this checkpoint")
    ap.add_argument("--dtype", default="bfloat16", help="with --decode-ops: the engine's dtype")
    args = ap.parse_args()
    if args.decode_ops:
        return _decode_ops(args.decode_ops, args.module_file, args.dtype)
    torch.set_num_threads(1)
    hc_mod = _load(args.module_file)
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 1 thread, D={args.hidden}, "
        f"hc={args.hc}, 20 Sinkhorn iterations; module {hc_mod.__file__}"
    )
    print("\n| dtype | call | " + " | ".join(f"T={t}: ops (top) / us" for t in args.tokens) + " |")
    print("|---|---|" + "---:|" * len(args.tokens))
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            rows: dict[str, list[str]] = {}
            for t in args.tokens:
                g = torch.Generator().manual_seed(t)
                x = torch.randn(t, args.hc, args.hidden, generator=g).to(dtype)
                f = torch.randn(t, args.hidden, generator=g).to(dtype)
                for name, call in _calls(hc_mod, x, f, args.hidden, args.hc).items():
                    n_all, n_top = _ops(call)
                    rows.setdefault(name, []).append(f"{n_all} ({n_top}) / {_us(call):.0f}")
            for name, cells in rows.items():
                print(f"| {str(dtype).removeprefix('torch.')} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
