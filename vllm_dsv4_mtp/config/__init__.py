"""DeepSeek-V4's configuration and its native tensor layout.

- :mod:`.spec`: :class:`DeepseekV4Spec`, the validated ``config.json`` (every error names the file and field);
- :mod:`.hf`: vLLM 0.33's form of the config (transformers' ``DeepseekV4Config``) back to those fields;
- :mod:`.layout`: every tensor of the native release layout for a config, in any storage precision.

No torch import here: this package is imported by ``--help`` paths and by vLLM's plugin loader.
"""

from vllm_dsv4_mtp.config.hf import spec_from_hf_config
from vllm_dsv4_mtp.config.layout import (  # noqa: F401  (the stored dtypes of each precision, for inspect)
    FP4_OFFICIAL_SCALE,
    FP4_OFFICIAL_WEIGHT,
    FP8_SCALE,
    FP8_WEIGHT,
    MXFP4_SCALE,
    MXFP4_WEIGHT,
    PRECISIONS,
    TensorExpectation,
    WeightSlot,
    expected_tensors,
    fp8_block_scale_shape,
    mx_scale_shape,
    packed_fp4_shape,
    parameter_count,
    quantized_expectations,
    scale_name,
    weight_slots,
)
from vllm_dsv4_mtp.config.spec import LAYER_TYPE_NAMES, MODULE_KINDS, ConfigError, DeepseekV4Spec

__all__ = [
    "ConfigError",
    "DeepseekV4Spec",
    "spec_from_hf_config",
    "TensorExpectation",
    "WeightSlot",
    "weight_slots",
    "expected_tensors",
    "packed_fp4_shape",
    "mx_scale_shape",
    "fp8_block_scale_shape",
    "parameter_count",
    "quantized_expectations",
    "scale_name",
    "PRECISIONS",
    "LAYER_TYPE_NAMES",
    "MODULE_KINDS",
]
