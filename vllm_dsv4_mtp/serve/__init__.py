"""Deployment: ``dsv4-mtp serve`` (named profiles over vLLM's OpenAI server), capacity checks, ``/metrics``.

- :mod:`.versions`: the one declared vLLM range (``SUPPORTED_VLLM``), checked at run time and by the Docker build.
- :mod:`.profiles`: the profile table (vLLM flags + environment + target hardware) and the known checkpoints.
- :mod:`.command`: profile + command-line overrides -> the vLLM server command line and environment.
- :mod:`.capacity`: weights per GPU from the checkpoint's config (precision of each part, MTP in BF16) and the
  KV / activation headroom left at the memory utilisation; refuses what cannot fit, showing the arithmetic.
- :mod:`.cli`: the ``serve`` sub-command; :mod:`.metrics`: spec-decode acceptance from a server's ``/metrics``.

Nothing here imports torch or vllm at module import time: ``dsv4-mtp --help`` must stay instant and the
server itself is vLLM's own process.
"""
