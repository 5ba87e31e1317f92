"""The CPU speed kit, below the model: compiled loops (``compiled.py``, ``csrc/``, ``sink_loop.py``,
``mxfp4_round.py``), routes to vLLM's CPU kernels (``paged_window.py``, ``linear.py``) and the one capability
object that says which of them this process may use (``kit.py``). ``model/`` computes the maths and asks
``kit.KIT``; a no there means the same formula in torch."""
