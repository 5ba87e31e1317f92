"""The CPU speed kit, below the model and the attention backend: compiled loops (``compiled.py``, ``csrc/``,
``sparse_attn.py``, ``mxfp4_round.py``), routes to vLLM's CPU kernels (``paged_window.py``, ``linear.py``) and the
one capability object that says which of them this process may use (``kit.py``). It imports nothing above it;
a no from ``kit.KIT`` means the same formula in torch."""
