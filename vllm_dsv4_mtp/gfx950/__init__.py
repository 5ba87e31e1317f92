"""The MTP draft on MI350/MI355 (gfx950): vLLM's in-tree AMD MTP layers, built in BF16 and loaded by the plugin.

:mod:`.draft` is the ROCm-only glue (it imports vLLM's ``vllm.models.deepseek_v4.amd``, which needs a ROCm
GPU); :mod:`.plan` holds the logic it needs as plain functions that import on any platform, so CI checks
them by driving vLLM's real code on CPU.
"""
