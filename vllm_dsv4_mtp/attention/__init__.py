"""The portable DeepSeek-V4 attention as a vLLM attention backend (``backend.py``), below ``model/``."""
