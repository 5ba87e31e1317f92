"""The embedded default: a tiny DeepSeek-V4 trained on synthetic grade-school arithmetic, with a trained MTP head.

- ``data``: the seeded word-problem generator (GSM8K format) and the BPE tokenizer trained on it.
- ``training/`` (repository only, not in the wheel): ``recipe`` (config and initialisation), ``train`` (the
  target with HF transformers' ``DeepseekV4ForCausalLM`` and the MTP layer with
  :mod:`vllm_dsv4_mtp.reference.mtp`, on CPU), ``export`` (the native-name BF16 checkpoint with its ``mtp.0.*``
  weights), ``accuracy``.
- ``assets/``: the shipped held-out set, few-shot examples, tokenizer and checkpoints.
"""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
BF16_CHECKPOINT_DIR = ASSETS_DIR / "tiny-dsv4-bf16"
MXFP4_CHECKPOINT_DIR = ASSETS_DIR / "tiny-dsv4-mxfp4"
TEST_JSONL = ASSETS_DIR / "gsm_tiny_test.jsonl"
FEWSHOT_JSONL = ASSETS_DIR / "gsm_tiny_fewshot.jsonl"
MEASURED_JSON = ASSETS_DIR / "measured.json"  # the shipped model's held-out accuracy (embedded.training.record)
