"""Benchmarks of the plugin against vLLM's own floor, run as ``python -m vllm_dsv4_mtp.benchmarks.<name>``."""
