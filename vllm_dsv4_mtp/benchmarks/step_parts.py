"""Where a decode step goes: ms and aten ops per step in attention, MoE, the rest of the forward, and vLLM.

    python -m vllm_dsv4_mtp.benchmarks.step_parts [--models floor bf16 mxfp4] [--batches 1 64] [--steps 24] \
        [--mtp-k 2] [--json OUT]

The engine runs as in ``decode_step`` (``ENGINE_FLAGS``, engine core and worker in their own processes, so
vLLM's CPU thread binding applies); PyTorch forward hooks (:mod:`.forward_hooks`), installed in the worker
through vLLM's public ``LLM.collective_rpc`` (functions travel by reference, hence
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), time the model's forward and every decoder block's attention
(``*.attn`` / ``*.self_attn``) and MoE / MLP (``*.ffn`` / ``*.mlp``). A decode step runs from one decode
forward's start to the next's (forwards over exactly ``batch`` tokens after the prefill); ``rest of forward``
is the forward minus attention and MoE (mHC, norms, embedding, ``hc_head``), ``vLLM`` the step minus the
forwards (scheduling, input preparation, sampling, outputs). With ``--mtp-k K`` the plugin models run again
with MTP K drafts: a step's target forward is the verify window (``(K + 1) x batch`` tokens), ``draft`` the
draft model's forwards inside the step and ``draft_attention`` its attention layer's share of them. A second
pass under ``torch.profiler`` counts the ``aten::`` ops (nested ones included) that start inside each part,
per step. Medians over the steps (so the parts need not add up exactly).

With ``--mtp-k K`` a second table puts each plugin model's K-draft step in MTP-off steps of the same model and
batch (:func:`mtp_costs`): the verify's extra forward, the draft's forwards, and vLLM's own speculative work
(the rejection sampler, the proposer's input preparation, the draft's attention metadata (the plugin's
builder) and sampling, the extra round trip to the engine core: its ``vLLM`` part minus the MTP-off step's),
and the end-to-end speedup those costs leave room for: at most ``(K + 1) / (1 + verify + vLLM)`` with a draft
that cost nothing and every draft accepted, and ``(K + 1) / (1 + vLLM)`` if the verify cost nothing too. A
speedup bound above those cannot be met by a faster draft.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import tempfile

from vllm_dsv4_mtp.evaluate.forward_hooks import decoder_blocks, finish_profile, time_forward


def install(worker) -> list[str]:
    """In the worker: hooks on the target's forward and its blocks' attention and MoE / MLP modules, and on the
    speculative draft's forward when there is one."""
    model = worker.model_runner.model
    time_forward(model, "forward")
    found = []
    for name, kind, mod in decoder_blocks(model):
        time_forward(mod, kind)
        found.append(name)
    draft = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    if draft is not None:
        time_forward(draft, "draft")
        found.append("drafter.model")
        for name, mod in draft.named_modules():
            if name.rsplit(".", 1)[-1] == "attn":
                time_forward(mod, "draft_attention")
                found.append(f"drafter.model.{name}")
    return found


def stop_profile(worker, batch: int) -> dict:
    """In the worker: end :func:`~.forward_hooks.start_profile`'s session; aten ops per decode step by part."""
    return _op_counts(finish_profile(), batch)


PARTS = ("step", "forward", "attention", "moe", "draft", "draft_attention")


def _steps(records, tokens: int) -> list[dict]:
    """Per decode step (target forwards over ``tokens`` tokens, to the next one's start): seconds per part."""
    fwd = sorted((r for r in records if r[0] == "forward"), key=lambda r: r[2])
    steps = []
    for a, b in zip(fwd[:-1], fwd[1:]):
        if a[1] != tokens or b[1] != tokens:
            continue
        inside = [r for r in records if a[2] <= r[2] < b[2]]
        st = {"step": b[2] - a[2], "forward": a[3] - a[2]}
        for part in ("attention", "moe", "draft", "draft_attention"):
            st[part] = sum(r[3] - r[2] for r in inside if r[0] == part)
        st["rest_of_forward"] = st["forward"] - st["attention"] - st["moe"]
        st["vllm"] = st["step"] - st["forward"] - st["draft"]
        steps.append(st)
    return steps


def _op_counts(prof, tokens: int) -> dict:
    """aten ops per decode step, by part, from the profiler's events and the hooks' ``bench::`` ranges."""
    events = list(prof.events())
    aten = sorted(e.time_range.start for e in events if e.name.startswith("aten::"))
    ranges = {p: [] for p in ("forward", "attention", "moe", "draft", "draft_attention")}
    for e in events:
        if e.name.startswith("bench::"):
            part, n = e.name[7:].rsplit(":", 1)
            if part != "forward" or int(n) == tokens:  # decode forwards only
                ranges[part].append((e.time_range.start, e.time_range.end))

    def count(lo, hi):
        return bisect.bisect_left(aten, hi) - bisect.bisect_left(aten, lo)

    fwd = sorted(ranges["forward"])
    per_step = {k: [] for k in PARTS}
    for (a0, a1), (b0, _) in zip(fwd[:-1], fwd[1:]):
        per_step["step"].append(count(a0, b0))
        per_step["forward"].append(count(a0, a1))
        for part in ("attention", "moe", "draft", "draft_attention"):
            per_step[part].append(sum(count(lo, hi) for lo, hi in ranges[part] if a0 <= lo < b0))
    out = {k: int(statistics.median(v)) for k, v in per_step.items() if v}
    out["rest_of_forward"] = out["forward"] - out["attention"] - out["moe"]
    out["vllm"] = out["step"] - out["forward"] - out["draft"]
    return out


def measure(name: str, ckpt: str, batches: list[int], n_steps: int, mtp_k: int = 0) -> dict:
    from vllm import LLM

    # by reference (module name), so the worker's hooks and this process's calls share the worker's globals
    from vllm_dsv4_mtp.benchmarks.decode_step import ENGINE_FLAGS, greedy, random_prompts
    from vllm_dsv4_mtp.benchmarks.step_parts import install, stop_profile
    from vllm_dsv4_mtp.evaluate.common import running
    from vllm_dsv4_mtp.evaluate.forward_hooks import start_profile, take_records

    with open(f"{ckpt}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    spec = {"method": "mtp", "num_speculative_tokens": mtp_k} if mtp_k else None
    with running(LLM(model=ckpt, speculative_config=spec, **ENGINE_FLAGS)) as llm:
        llm.collective_rpc(install)
        res = {"model": name, "mtp_k": mtp_k, "batches": {}}
        for b in batches:
            prompts = [{"prompt_token_ids": p} for p in random_prompts(vocab, b, 100, seed=b)]
            sp = greedy(n_steps + 1)
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up
            llm.collective_rpc(take_records)
            llm.generate(prompts, sp, use_tqdm=False)
            tokens = b * (mtp_k + 1)  # a decode step's target forward: each request's verify window
            steps = _steps(llm.collective_rpc(take_records)[0], tokens)
            if not steps:
                raise RuntimeError(f"{name}, batch {b}: no decode step of {tokens} tokens recorded")
            ms = {k: round(1000 * statistics.median(st[k] for st in steps), 3) for k in steps[0]}
            llm.collective_rpc(start_profile)
            llm.generate(prompts, greedy(9), use_tqdm=False)
            ops = llm.collective_rpc(stop_profile, args=(tokens,))[0]
            res["batches"][b] = {"ms": ms, "aten_ops": ops, "steps": len(steps)}
    return res


def mtp_costs(results: list[dict]) -> list[dict]:
    """Per model and batch measured both MTP off and with K drafts: the K-draft step's parts in MTP-off steps
    (``verify``: its forward minus the MTP-off forward; ``draft``: the draft's forwards; ``vllm_spec``: its
    ``vLLM`` part minus the MTP-off step's) and the speedups they leave room for with every draft accepted,
    ``ceiling_free_draft = (K + 1) / (1 + verify + vllm_spec)`` and ``ceiling_free_draft_verify =
    (K + 1) / (1 + vllm_spec)``."""
    off = {(r["model"], b): v["ms"] for r in results if not r["mtp_k"] for b, v in r["batches"].items()}
    rows = []
    for r in results:
        k = r["mtp_k"]
        if not k:
            continue
        for b, v in r["batches"].items():
            o, m = off.get((r["model"], b)), v["ms"]
            if o is None:
                continue
            rel = {
                "verify": (m["forward"] - o["forward"]) / o["step"],
                "draft": m["draft"] / o["step"],
                "vllm_spec": (m["vllm"] - o["vllm"]) / o["step"],
            }
            rows.append(
                {
                    "model": r["model"],
                    "batch": b,
                    "mtp_k": k,
                    "off_step_ms": o["step"],
                    "step_ms": m["step"],
                    "step_in_off_steps": round(m["step"] / o["step"], 3),
                    **{p: round(x, 3) for p, x in rel.items()},
                    "ceiling_free_draft": round((k + 1) / (1 + rel["verify"] + rel["vllm_spec"]), 3),
                    "ceiling_free_draft_verify": round((k + 1) / (1 + rel["vllm_spec"]), 3),
                }
            )
    return rows


def render(results: list[dict]) -> str:
    parts = ("step", "attention", "moe", "rest_of_forward", "draft", "draft_attention", "vllm")
    lines = [
        "| model, batch | " + " | ".join(f"{p} ms (aten ops)" for p in parts) + " |",
        "|---|" + "---:|" * len(parts),
    ]
    for r in results:
        mtp = f", MTP K={r['mtp_k']}" if r["mtp_k"] else ""
        for b, v in r["batches"].items():
            lines.append(
                f"| {r['model']}{mtp}, {b} | "
                + " | ".join(f"{v['ms'][p]:.2f} ({v['aten_ops'].get(p, 0):,})" for p in parts)
                + " |"
            )
    costs = mtp_costs(results)
    if costs:
        lines += [
            "",
            "| in MTP-off steps | MTP-off step ms | K-draft step | verify | draft | vLLM's speculative "
            "work | speedup ceiling: free draft | free draft and verify |",
            "|---|" + "---:|" * 7,
        ]
        lines += [
            f"| {c['model']}, K={c['mtp_k']}, batch {c['batch']} | {c['off_step_ms']:.2f} | "
            f"{c['step_in_off_steps']:.2f} | {c['verify']:+.2f} | {c['draft']:.2f} | {c['vllm_spec']:+.2f} | "
            f"{c['ceiling_free_draft']:.2f}x | {c['ceiling_free_draft_verify']:.2f}x |"
            for c in costs
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dsv4_mtp.benchmarks.step_parts", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--models", nargs="+", default=["floor", "bf16", "mxfp4"], choices=["floor", "bf16", "mxfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    ap.add_argument("--mtp-k", type=int, default=0, help="also measure the plugin models with MTP K drafts")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships this module's functions
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_dsv4_mtp.benchmarks import report
    from vllm_dsv4_mtp.benchmarks.decode_step import model_dirs

    with tempfile.TemporaryDirectory(prefix="dsv4-step-parts-") as tmp:
        dirs = model_dirs(tmp)
        results = [measure(m, dirs[m], args.batches, args.steps) for m in args.models]
        if args.mtp_k:
            results += [measure(m, dirs[m], args.batches, args.steps, args.mtp_k) for m in args.models if m != "floor"]
    return report(render(results), {"results": results, "mtp_costs": mtp_costs(results)}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
