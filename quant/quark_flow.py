"""amd-quark's own file-to-file flow for DeepSeek-V4 (for users with a GPU):

    python -m vllm_dsv4_mtp.quant.quark_flow SRC DST [--device cuda] [--shared-experts keep|mxfp4] [--force]

It runs ``ModelQuantizer(LLMTemplate.get("deepseek_v4").get_config("mxfp4", exclude_layers=...))
.direct_quantize_checkpoint(SRC, ..., keep_excluded_layers_as_original_model_state=<SRC is quantized>,
device=...)``:
Quark's own template (exclude ``*attn*``, ``embed``, ``head``, ``*ffn.gate*``, ``hc_*``, ``mtp.*``, plus
``*shared_experts*`` unless ``--shared-experts mxfp4``), W4A4 MXFP4, excluded layers kept exactly as in the
source (FP8 layers stay FP8 and are described in ``layer_quant_config``).

Guards around Quark's behaviour:
- with an FP8 source (the official release) Quark needs a GPU: its FP8 dequantization is a Triton kernel, and on
  CPU it logs an error and RETURNS WITHOUT WRITING ANYTHING. This script refuses that combination up front, and
  after any run checks that Quark really wrote a Quark checkpoint.
- Quark keeps an excluded MTP layer as stored: from the official FP8 release the MTP stays FP8/FP4 (``dsv4-mtp
  quantize`` writes it BF16, the project's policy); from a BF16 source it stays BF16 either way.
- output goes to a hidden directory next to DST that replaces DST atomically at the end
  (``vllm_dsv4_mtp.quant.publish``, as for ``dsv4-mtp quantize``); DST is replaced only with --force.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_dsv4_mtp.quant.publish import WorkDir, discard, publish, signals_deferred, signals_interrupt, sync_tree
from vllm_dsv4_mtp.quant.quantize import QuantizeError, _check_paths, _sweep

SHARED_EXPERTS_PATTERN = "*shared_experts*"


def is_fp8_source(src: Path) -> bool:
    """Does SRC hold FP8 weights (an FP8 ``quantization_config`` or any F8_E4M3 tensor)? Headers only."""
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    reader = CheckpointReader(src)
    qc = (reader.config or {}).get("quantization_config") or {}
    return qc.get("quant_method") == "fp8" or any(i.dtype == "F8_E4M3" for i in reader.tensors.values())


def is_quantized_source(src: Path) -> bool:
    """Does SRC's config.json carry a ``quantization_config``? Quark can keep excluded layers "as in the source"
    only then (``keep_excluded_layers_as_original_model_state=True`` raises on a plain BF16 config, where
    there is nothing to keep: excluded BF16 layers are copied either way)."""
    cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    return bool(cfg.get("quantization_config"))


def quark_exclude(shared_experts: str) -> list[str]:
    """Quark's DeepSeek-V4 template exclude patterns (+ shared experts when they are kept)."""
    from quark.torch import LLMTemplate

    exclude = list(LLMTemplate.get("deepseek_v4").exclude_layers_name)
    if shared_experts == "keep":
        exclude.append(SHARED_EXPERTS_PATTERN)
    return exclude


def run_quark_flow(
    src: str | Path, dst: str | Path, *, device: str | None = None, shared_experts: str = "keep", force: bool = False
) -> Path:
    """Run Quark's file-to-file MXFP4 flow SRC -> DST; returns DST. Raises :class:`QuantizeError`."""
    src, dst = Path(src), Path(dst)
    if shared_experts not in ("keep", "mxfp4"):
        raise QuantizeError(f"shared_experts must be 'keep' or 'mxfp4', got {shared_experts!r}")
    _sweep(dst)
    _check_paths(src, dst, force)
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    quantized_source = is_quantized_source(src)
    if str(device).startswith("cpu") and is_fp8_source(src):
        raise QuantizeError(
            f"{src}: FP8 source on device 'cpu': amd-quark dequantizes FP8 with a Triton GPU kernel and, on CPU, "
            f"logs an error and writes nothing. Run with --device cuda on a GPU, or use `dsv4-mtp quantize` "
            f"(CPU, re-encodes the official FP4 experts losslessly)"
        )

    from quark.torch import LLMTemplate, ModelQuantizer

    config = LLMTemplate.get("deepseek_v4").get_config(scheme="mxfp4", exclude_layers=quark_exclude(shared_experts))
    dst.parent.mkdir(parents=True, exist_ok=True)
    with signals_interrupt():
        work = WorkDir(dst)
        try:
            ModelQuantizer(config).direct_quantize_checkpoint(
                str(src), str(work.path), keep_excluded_layers_as_original_model_state=quantized_source, device=device
            )
            _check_quark_output(work.path, src)
            sync_tree(work.path)
            with signals_deferred():
                publish(work, dst)
        except BaseException:
            discard(work, dst)
            raise
        work.close()
    return dst


def _check_quark_output(out: Path, src: Path) -> None:
    """Quark may return without raising and without writing (see the module docstring): verify it wrote."""
    cfg_file = out / "config.json"
    shards = list(out.glob("*.safetensors")) if out.is_dir() else []
    if not cfg_file.is_file() or not shards:
        raise QuantizeError(
            f"amd-quark wrote no checkpoint for {src} (no config.json or safetensors in its "
            f"output); see its QUARK-ERROR log lines above"
        )
    qc = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "quark":
        raise QuantizeError(f"{cfg_file}: amd-quark's output has no Quark quantization_config")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_dsv4_mtp.quant.quark_flow", description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "--device", default=None, help="cuda (default when a GPU is visible), cuda:N, or cpu (BF16 sources only)"
    )
    p.add_argument("--shared-experts", choices=("keep", "mxfp4"), default="keep")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = p.parse_args(argv)
    try:
        out = run_quark_flow(
            args.src, args.dst, device=args.device, shared_experts=args.shared_experts, force=args.force
        )
    except QuantizeError as e:
        print(f"quark_flow: error: {e}", file=sys.stderr)
        return 2
    print(f"amd-quark wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
