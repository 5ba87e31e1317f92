"""What a K = 0 step of vLLM's schedule costs, in MTP-off steps, with the draft's cache-only path and without it.

::

    python -m vllm_dsv4_mtp.benchmarks.k0_step [--requests 32] [--tokens 64] [--reps 3]

In-process engines on the embedded MXFP4 model (bfloat16, eager), one after another: MTP off, and MTP with the
schedule ``[[1, 1024, 0]]`` (every step K = 0) twice: with the plugin's K = 0 path (the draft writes its attention
cache only, ``vllm_dsv4_mtp/draft_schedule.py``) and with the draft's whole layer (what vLLM runs without it; the
draft's table cleared). Each times ``--requests`` greedy requests of ``--tokens`` tokens at once, ``--reps`` times
after a warm-up; medians. A K = 0 step's cost in off steps is ``t(K=0) / t(off)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def timed(llm, prompts, sp, reps: int) -> float:
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from vllm_dsv4_mtp.embedded import MXFP4_CHECKPOINT_DIR

    k0 = {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j * 13) % 400 for j in range(64)]} for i in range(args.requests)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    out = {}
    for name, spec in (("off", None), ("K=0, cache only", k0), ("K=0, whole layer", k0)):
        llm = LLM(
            model=str(MXFP4_CHECKPOINT_DIR),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=args.requests,
            seed=0,
            speculative_config=spec,
        )
        if name.endswith("whole layer"):
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            runner.drafter.model.step_k.lookup = None
        out[name] = timed(llm, prompts, sp, args.reps)
        del llm
    tok = args.requests * args.tokens
    print(f"| engine | s for {args.requests} x {args.tokens} tokens | tok/s | in MTP-off steps |")
    print("|---|---:|---:|---:|")
    for name, s in out.items():
        print(f"| {name} | {s:.2f} | {tok / s:.0f} | {s / out['off']:.2f} |")


if __name__ == "__main__":
    main()
