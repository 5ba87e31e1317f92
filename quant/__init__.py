"""``vllm_dsv4_mtp.quant`` (the repository's ``quant/`` folder): a DeepSeek-V4 checkpoint -> Quark-format OCP
MXFP4 experts, with the MTP layer in BF16.

- :mod:`vllm_dsv4_mtp.quant.quantize`: the converter behind ``dsv4-mtp quantize SRC DST`` (CPU, shard by shard).
- :mod:`vllm_dsv4_mtp.quant.cli`: its command-line entry.
- :mod:`vllm_dsv4_mtp.quant.quark_flow`: amd-quark's own file-to-file flow (``direct_quantize_checkpoint``),
  for GPU users.

See ``quant/README.md``.
"""
