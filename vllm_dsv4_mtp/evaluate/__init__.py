"""Accuracy and speed on a served model: ``dsv4-mtp eval`` (GSM8K through lm-eval), ``dsv4-mtp bench``
(concurrency sweep, MTP off vs on) and ``dsv4-mtp demo`` (the embedded model answering held-out problems).

- :mod:`.server`: start / stop one vLLM server through ``dsv4-mtp serve`` (profile ``cpu-tiny`` by default).
- :mod:`.client`: a timed, streaming ``/v1/completions`` client (standard library).
- :mod:`.engine_clock`: per-request decode / prefill times on the engine's clock, from ``/metrics``.
- :mod:`.lmeval`: lm-eval runs (vLLM's recipe by default), the local GSM8K-style task
  (``templates/gsm_tiny_task.yaml``), the stock dataset check, results and per-answer samples.
- :mod:`.eval_cmd`, :mod:`.bench`, :mod:`.demo`: the three sub-commands; :mod:`.eval_ab` is ``eval --ab``.

Acceptance numbers come from the server's ``/metrics`` through :mod:`vllm_dsv4_mtp.serve.metrics`.
Nothing here imports torch or vllm: every model runs in vLLM's own server process.
"""
