"""The model's RMS norms (sub-layer, ``q_norm`` / ``kv_norm``, compressor, MTP and final norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.layernorm import RMSNorm


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` for a vLLM ``RMSNorm`` (its weight and eps), ``x: [..., C]`` -> same shape and dtype.

    On CPU, where vLLM runs this norm's native formula (normalise in float32, round to the weight's dtype,
    multiply by the weight), the same formula without the custom-op dispatch, with torch's ``rms_norm`` for the
    normalisation: 4 ops instead of 9 for norms of a few hundred channels per token, whose host time is the cost.
    ``tests/test_model_layers.py`` holds it equal to vLLM's ``RMSNorm``.
    """
    if x.device.type != "cpu":
        return norm(x)
    xf = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return (xf.to(norm.weight.dtype) * norm.weight).to(x.dtype)
