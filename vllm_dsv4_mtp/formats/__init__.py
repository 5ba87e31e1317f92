"""Tensor and checkpoint formats shared by the model, the loader and the quantizer.

- :mod:`.mxfp4`: the OCP MXFP4 codec (E2M1 elements, E8M0 scales, AMD Quark 0.13 "even" scale rule).
- :mod:`.fp8`: FP8 e4m3 128x128 block-scaled weights (official DeepSeek-V4 release, Quark FP8).
- :mod:`.quark_config`: the Quark ``quantization_config`` of ``config.json`` (parse, match, write).
- :mod:`.checkpoint`: sharded safetensors checkpoints in native DeepSeek-V4 naming.

Submodules import torch; this package itself imports nothing heavy.
"""
