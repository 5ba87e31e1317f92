"""Test oracles and checkpoint makers (not needed to serve): the HF transformers oracle, tiny checkpoints in
the published layouts, and vLLM's in-tree DeepSeek-V4 MTP parameter tree rebuilt from classes that build on
CPU."""
