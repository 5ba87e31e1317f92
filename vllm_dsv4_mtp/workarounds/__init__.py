"""Routes around vLLM bugs, one module each, each citing its upstream issue and applied only where a probe
shows the bug."""
