"""vllm_dsv4_mtp: DeepSeek-V4 with OCP MXFP4 experts and a BF16 MTP draft, as an out-of-tree vLLM plugin.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every process it starts, so importing
this package must stay cheap and free of side effects: no torch, no vllm at import time.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM plugin entry point; see :mod:`vllm_dsv4_mtp.registration`."""
    from vllm_dsv4_mtp.registration import register_models

    register_models()
