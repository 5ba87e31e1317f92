"""What the plugin registers in place of its own classes when the installed vLLM is outside its supported range.

It has the interface of a text-generation model, so vLLM's config checks accept the architecture and the
version error is what stops the engine when it builds the model (one message, naming both versions).
"""

from __future__ import annotations

from torch import nn


class UnsupportedVllm(nn.Module):
    """Constructed by vLLM in place of a DeepSeek-V4 model class; always raises the version error."""

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()
        from vllm_dsv4_mtp.versions import check_vllm_version

        check_vllm_version()  # raises UnsupportedVllmError naming the installed and the supported versions
        raise RuntimeError("vllm-dsv4-mtp: UnsupportedVllm built on a supported vLLM (a stale registration)")

    def embed_input_ids(self, input_ids):  # pragma: no cover - never built
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):  # pragma: no cover
        raise NotImplementedError

    def compute_logits(self, hidden_states):  # pragma: no cover - never built
        raise NotImplementedError
