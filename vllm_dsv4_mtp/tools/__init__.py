"""Checkpoint tools: the tiny DeepSeek-V4 builder (:mod:`.tiny`) and the checker behind ``dsv4-mtp inspect``."""
