"""Engine start time, decode step time and peak memory of the plugin's target model on this machine.

    python -m vllm_dsv4_mtp.benchmarks.target_model [--experts bf16|mxfp4] [--dtype bfloat16] [--decode 64]

Builds the default tiny checkpoint (``tools.tiny``), starts ``LLM(..., enforce_eager=True)`` and times:

* engine start: the ``LLM(...)`` constructor (model load, KV-cache set-up, profile run);
* ms per decode step: ``(t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1)`` for the same prompts, so the
  prefill cancels; for a batch of 4 prompts (5 / 130 / 300 / 520 tokens) and for one 300-token prompt. It is
  ``decode_step.decode_step_ms``: an untimed run first, the median of 3, and an error where noise made it
  zero or negative (a larger ``--decode`` is then needed), never a recorded non-positive step;
* peak memory: resident set size sampled every 50 ms over this process and its children (vLLM's engine core
  and worker): the peak of the sum and of the largest single process.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time


class RssSampler(threading.Thread):
    """Peak RSS (bytes) of this process tree: ``peak_total`` (sum) and ``peak_single`` (largest process)."""

    def __init__(self, interval: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process()
        self.interval = interval
        self.peak_total = 0
        self.peak_single = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        while not self._stop_event.is_set():
            total = 0
            for p in [self.root, *self.root.children(recursive=True)]:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                self.peak_single = max(self.peak_single, rss)
            self.peak_total = max(self.peak_total, total)
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", choices=["bf16", "mxfp4"], default="bf16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode", type=int, default=64, help="generated tokens per request in the timed run")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (default: build the tiny one)")
    args = ap.parse_args(argv)
    if args.decode < 2:
        ap.error(f"--decode: at least 2 tokens (a decode step is t(N) - t(1) over N - 1 steps), got {args.decode}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch

    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    ckpt = args.ckpt or str(
        build_tiny_checkpoint(
            tempfile.mkdtemp(prefix="dsv4-bench-") + "/ck", tiny_config(), seed=0, experts=args.experts, tokenizer=False
        )
    )
    sampler = RssSampler()
    sampler.start()
    from vllm import LLM

    from vllm_dsv4_mtp.benchmarks.decode_step import decode_step_ms
    from vllm_dsv4_mtp.evaluate.common import running

    t0 = time.perf_counter()
    with running(
        LLM(
            model=ckpt,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=8,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            seed=0,
        )
    ) as llm:
        start_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        batches = {
            "batch4": [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 130, 300, 520)],
            "batch1": [torch.randint(2, 512, (300,), generator=g).tolist()],
        }

        result = {"experts": args.experts, "dtype": args.dtype, "engine_start_s": round(start_s, 1)}
        for name, prompts in batches.items():
            # the issue-10 benchmark's measurement: median of 3, an error where it is not positive
            ms = decode_step_ms(llm, prompts, args.decode, reps=3)
            result[f"ms_per_decode_step_{name}"] = round(ms, 1)
        sampler.stop()
        result["peak_rss_total_gib"] = round(sampler.peak_total / 2**30, 2)
        result["peak_rss_single_process_gib"] = round(sampler.peak_single / 2**30, 2)
        print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
