"""Export the trained target + MTP layer as a native-name DeepSeek-V4 BF16 checkpoint.

Layout = the DeepSeek release (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash, its safetensors index) with
BF16 where the release has FP8/FP4:
``hc_*`` / ``attn_sink`` / ``ape`` / ``gate.bias`` F32, ``tid2eid`` int64, every other tensor BF16; the
MTP layer under ``mtp.0.*`` (no embed/head of its own: it shares the target's). config.json in the HF
DeepSeek-V4 style, plus the tokenizer.

    python -m vllm_dsv4_mtp.embedded.training.export --state /tmp/dsv4-train/state.pt

Before writing, the trained float32 weights are rounded in place to the stored dtypes, so the exported
checkpoint computes exactly what the in-memory model computes afterwards (the round-trip test relies on it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...reference.names import causal_lm_to_native, native_dtype
from .. import ASSETS_DIR, BF16_CHECKPOINT_DIR

MAX_SHARD_BYTES = 4 * 2**20  # several shards + index, like the real releases


def native_tensors(model, mtp) -> dict[str, torch.Tensor]:
    """Target + MTP in native names; the tensors share storage with the modules' parameters."""
    out = causal_lm_to_native(model.state_dict(keep_vars=True), model.config.num_hidden_layers)
    out.update(mtp.native_state_dict())
    return {k: v.detach() for k, v in out.items()}


@torch.no_grad()
def round_to_native_dtypes_(model, mtp) -> None:
    """Round every parameter that is stored BF16 to BF16 precision, in place (kept float32)."""
    for name, t in native_tensors(model, mtp).items():
        if native_dtype(name) == torch.bfloat16:
            t.copy_(t.to(torch.bfloat16).float())


def export_checkpoint(model, mtp, config: dict, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write ``out_dir`` (replacing its safetensors). Returns ``out_dir``."""
    from ...formats.checkpoint import CheckpointWriter

    round_to_native_dtypes_(model, mtp)
    tensors = native_tensors(model, mtp)
    with CheckpointWriter(out_dir, max_shard_bytes=MAX_SHARD_BYTES, overwrite=True) as w:
        for name in sorted(tensors, key=_release_order):
            w.add(name, tensors[name].to(native_dtype(name)).contiguous())
        w.write_config(config)
        w.copy_tokenizer_files(tokenizer_dir)
    return Path(out_dir)


def _release_order(name: str) -> tuple:
    """embed, layers in numeric order, norm/head/hc_head, then mtp (as the official shards are ordered)."""
    parts = name.split(".")
    if parts[0] == "embed":
        return (0, 0, name)
    if parts[0] == "layers":
        return (1, int(parts[1]), name)
    if parts[0] == "mtp":
        return (3, int(parts[1]), name)
    return (2, 0, name)


def main(argv: list[str] | None = None) -> int:
    from .recipe import MODEL_CONFIG, build_models

    ap = argparse.ArgumentParser(description="Export a training state.pt as the native BF16 checkpoint.")
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=BF16_CHECKPOINT_DIR)
    ap.add_argument("--assets", type=Path, default=ASSETS_DIR, help="where data.py wrote the tokenizer")
    args = ap.parse_args(argv)
    st = torch.load(args.state, weights_only=False)
    config = st.get("config", MODEL_CONFIG)
    model, mtp = build_models(config, seed=0)
    model.load_state_dict(st["model"])
    mtp.load_state_dict(st["mtp"])
    export_checkpoint(model, mtp, config, args.assets / "tokenizer", args.out)
    print(f"exported step {st['step']} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
