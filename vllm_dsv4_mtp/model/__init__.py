"""The plugin's DeepSeek-V4 model on vLLM's building blocks (one concept per file)."""
