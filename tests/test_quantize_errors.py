"""``dsv4-mtp quantize`` refusals that name the tensor or file, in the tool's one-line form (exit status 2), with
nothing written: non-finite source values, a full disk (a real ENOSPC from a size-limited tmpfs), a file size
limit (a real EFBIG), no room for the output, and a second run on the same DST."""

from __future__ import annotations

import fcntl
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader, CheckpointWriter
from vllm_dsv4_mtp.quant.quantize import _output_bytes
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("quantize-errors")


@pytest.fixture(scope="module")
def bf16(work):
    return build_tiny_checkpoint(work / "bf16", seed=6, tokenizer=False)


@pytest.fixture(scope="module")
def official(work):
    return build_tiny_checkpoint(work / "official", seed=6, experts="fp4-official", linears="fp8", tokenizer=False)


def _edit(src: Path, dst: Path, name: str, edit) -> Path:
    """A copy of checkpoint ``src`` in which the raw bytes of tensor ``name`` (uint8, flat) went through ``edit``."""
    r = CheckpointReader(src)
    with CheckpointWriter(dst) as w:
        for n in r:
            info = r.info(n)
            data = r.raw_buffer(n)
            if n == name:
                edit(torch.frombuffer(data, dtype=torch.uint8))
            w.add_raw(n, info.dtype, info.shape, data)
        w.write_config(r.config)
    return dst


def _set(index_values, dtype=torch.uint8):
    """An edit of a tensor's raw bytes: element ``i`` (of the bytes read as ``dtype``) set to ``x``."""

    def edit(raw):
        v = raw.view(dtype)
        for i, x in index_values:
            v[i] = x

    return edit


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    from vllm_dsv4_mtp.cli import main

    rc = main(["quantize", *map(str, argv), "--no-progress"])
    return rc, capsys.readouterr().err.strip().splitlines()


NAN, INF = float("nan"), float("inf")
# (source, tensor, edit of its stored bytes, what the message says was found)
NONFINITE = [
    (
        "bf16",
        "layers.1.ffn.experts.2.w3.weight",
        _set([(0, NAN), (7, NAN), (9, INF)], torch.bfloat16),
        "2 NaN, 1 +Inf of 8192 values",
    ),  # a routed expert: found from its E8M0 NaN/Inf scales, then counted
    ("bf16", "layers.0.attn.wq_a.weight", _set([(5, -INF)], torch.bfloat16), "1 -Inf of 8192 values"),  # copied as is
    ("bf16", "hc_head_fn", _set([(3, NAN)], torch.float32), "1 NaN of 2048 values"),  # an F32 tensor
    ("bf16", "mtp.0.e_proj.weight", _set([(1, INF)], torch.bfloat16), "1 +Inf of 16384 values"),  # the MTP draft
    ("official", "layers.2.ffn.experts.1.w2.scale", _set([(0, 255)]), "1 NaN of 256 values"),  # E8M0 NaN
    ("official", "layers.0.attn.wq_a.weight", _set([(2, 0x7F), (3, 0xFF)]), "2 NaN of 8192 values"),  # FP8
    ("official", "layers.0.attn.wq_a.scale", _set([(0, 255)]), "1 NaN of 1 values"),  # a kept FP8's scale
    ("official", "mtp.0.e_proj.weight", _set([(0, 0x7F)]), "1 NaN of 16384 values"),  # decoded to BF16
]


@pytest.mark.parametrize("source,name,edit,found", NONFINITE, ids=[f"{s}-{n}" for s, n, _, _ in NONFINITE])
def test_nonfinite_source_values_are_refused_naming_the_tensor(capsys, request, tmp_path, source, name, edit, found):
    src = _edit(request.getfixturevalue(source), tmp_path / "src", name, edit)
    file = CheckpointReader(src).info(name).file
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2
    assert err == [
        f"dsv4-mtp quantize: error: {file}: {name}: non-finite values in the source ({found}): a broken "
        f"or corrupted weight cannot be quantized (`dsv4-mtp inspect --scan-values {src}` lists every "
        f"such tensor)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no hidden leftover


def _quantize_subprocess(src: Path, dst: Path, *, wrap: list[str] | None = None, preexec=None):
    code = "import sys; from vllm_dsv4_mtp.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "quantize", str(src), str(dst), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run((wrap or []) + argv, env=env, capture_output=True, text=True, preexec_fn=preexec, timeout=300)


def _in_tmpfs(mnt: Path, size: int) -> list[str]:
    """A command prefix that runs the command with a tmpfs of ``size`` bytes mounted on ``mnt`` (a private mount
    in a user namespace: no privileges needed)."""
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs "{mnt}" && exec "$@"',
        "sh",
    ]


def _tmpfs_available(tmp_path: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    (tmp_path / "probe").mkdir()
    return subprocess.run(_in_tmpfs(tmp_path / "probe", 2**20) + ["true"], capture_output=True).returncode == 0


def test_full_disk_is_one_line_and_leaves_nothing(bf16, tmp_path):
    """A real ENOSPC: a tmpfs with room for the up-front estimate but not for the shard headers and files that
    come on top of it, so the disk fills in the middle of writing."""
    # a real full disk needs a private tmpfs (util-linux's unshare, no privileges); missing is a failure
    assert _tmpfs_available(tmp_path), (
        "this machine does not allow a private tmpfs mount in a user namespace "
        "(unshare --user --map-root-user --mount): the full-disk path is untested"
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    need = _output_bytes(CheckpointReader(bf16), "keep")
    res = _quantize_subprocess(bf16, mnt / "dst", wrap=_in_tmpfs(mnt, need + 4096 - need % 4096 + 4096))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert re.fullmatch(
        rf"dsv4-mtp quantize: error: {re.escape(str(mnt))}/\.dst\.partial-\d+/\.shard-00000\."
        rf"safetensors\.tmp: No space left on device \(the partial output was removed; nothing was "
        rf"written to {re.escape(str(mnt / 'dst'))}; free space on the filesystem of "
        rf"{re.escape(str(mnt))} or choose another DST\)",
        lines[0],
    ), lines[0]
    # too small even for the estimate: refused before writing anything
    res = _quantize_subprocess(bf16, mnt / "dst", wrap=_in_tmpfs(mnt, 2**20))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"dsv4-mtp quantize: error: {mnt}: not enough free space for the output: it needs about "
        f"{need / 2**30:.2f} GiB, 0.00 GiB are free"
    ]


def test_file_size_limit_is_one_line_and_leaves_nothing(bf16, tmp_path):
    """A real EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored): any OS error while writing takes the same one-line path."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    res = _quantize_subprocess(bf16, tmp_path / "dst", preexec=limit)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"dsv4-mtp quantize: error: {tmp_path}/.dst.partial-")
    assert lines[0].endswith(
        f": File too large (the partial output was removed; nothing was written to {tmp_path / 'dst'})"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_second_run_on_the_same_dst_is_refused(capsys, bf16, tmp_path):
    """A live run's work directory is locked; another run on the same DST stops before touching anything."""
    live = tmp_path / ".dst.partial-31337"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        rc, err = _cli(capsys, bf16, tmp_path / "dst")
    finally:
        os.close(fd)
    assert rc == 2
    assert err == [
        f"dsv4-mtp quantize: error: {tmp_path / 'dst'}: another dsv4-mtp quantize (pid 31337) is writing "
        f"it now ({live} is locked); wait for it to finish or stop it"
    ]
    assert live.is_dir() and not (tmp_path / "dst").exists()
    # once that run is gone (its lock with it), the directory is a leftover: removed and reported
    rc, err = _cli(capsys, bf16, tmp_path / "dst")
    assert rc == 0 and err == [f"dsv4-mtp quantize: {live}: removed (0.0 MiB), left by an interrupted run (pid 31337)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


# ----------------------------------------------------------------------------------------------------------
# malformed sources: the rows of docs/bad-inputs.md, exact messages through the CLI
# ----------------------------------------------------------------------------------------------------------
def _copy_without(src: Path, dst: Path, drop=lambda n: False, config=None, max_shard_bytes=None) -> Path:
    r = CheckpointReader(src)
    with CheckpointWriter(dst, **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {})) as w:
        for n in r:
            if not drop(n):
                w.copy_from(r, n)
        w.write_config(config if config is not None else r.config)
    return dst


def test_truncated_source_shard(capsys, bf16, tmp_path):
    src = _copy_without(bf16, tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"dsv4-mtp quantize: error: {f}: truncated safetensors file: its header describes ")
    assert err[0].endswith(
        " data bytes (through tensor 'norm.weight') but the file holds only "
        f"{CheckpointReader(bf16).total_bytes - 1000}"
    )


def test_missing_source_shard(capsys, bf16, tmp_path):
    src = _copy_without(bf16, tmp_path / "src", max_shard_bytes=1_000_000)
    (src / "model-00003-of-00005.safetensors").unlink()
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(
        f"dsv4-mtp quantize: error: {src / 'model.safetensors.index.json'}: shard "
        f"'model-00003-of-00005.safetensors' (listed for "
    )
    assert err[0].endswith(") does not exist")


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"hidden_size": -128}, "field 'hidden_size' must be > 0, got -128"),
        (
            {"compress_ratios": [0, 4, 128, 4]},
            "field 'compress_ratios' has 4 entries, expected num_hidden_layers + "
            "num_nextn_predict_layers = 4 + 1 = 5 (one per main layer, then one per MTP layer)",
        ),
    ],
)
def test_malformed_config_field(capsys, bf16, tmp_path, edit, message):
    cfg = dict(CheckpointReader(bf16).config, **edit)
    src = _copy_without(bf16, tmp_path / "src", config=cfg)
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2 and err == [f"dsv4-mtp quantize: error: {src / 'config.json'}: {message}"]


def test_missing_config(capsys, bf16, tmp_path):
    src = _copy_without(bf16, tmp_path / "src")
    (src / "config.json").unlink()
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2 and err == [
        f"dsv4-mtp quantize: error: {src / 'config.json'}: missing (needed to validate and to write the Quark config)"
    ]


@pytest.mark.parametrize(
    "drop,problem",
    [
        (
            "layers.1.attn.wq_a.weight",
            "layers.1.attn.wq_a.weight: missing (expected BF16 [64, 128], or a quantized form)",
        ),
        (
            "layers.0.attn.wq_a.scale",
            "layers.0.attn.wq_a.weight_scale: missing: layers.0.attn.wq_a.weight is stored "
            "fp8-block and needs its scale (neither layers.0.attn.wq_a.weight_scale nor layers.0.attn.wq_a.scale "
            "is stored)",
        ),
    ],
)
def test_missing_tensor_or_scale_is_named_by_the_preflight(capsys, request, tmp_path, drop, problem):
    base = request.getfixturevalue("official" if drop.endswith(".scale") else "bf16")
    src = _copy_without(base, tmp_path / "src", drop=lambda n: n == drop)
    rc, err = _cli(capsys, src, tmp_path / "dst")
    assert rc == 2
    assert err == [
        f"dsv4-mtp quantize: error: {src}: the source checkpoint has 1 problem(s) (dsv4-mtp inspect {src}):",
        f"  {problem}",
    ]


def test_stripped_mtp_needs_allow_missing_mtp(capsys, bf16, tmp_path):
    src = _copy_without(bf16, tmp_path / "src", drop=lambda n: n.startswith("mtp."))
    rc, err = _cli(capsys, src, tmp_path / "dst")
    absent = (
        "mtp.0: MTP layer absent: config.json declares num_nextn_predict_layers = 1 but no mtp.0.* tensor is stored"
    )
    assert rc == 2
    assert err == [
        f"dsv4-mtp quantize: error: {src}: the source checkpoint has 1 problem(s) (dsv4-mtp inspect {src}):",
        f"  {absent}",
    ]
    from vllm_dsv4_mtp.cli import main

    assert main(["quantize", str(src), str(tmp_path / "dst"), "--no-progress", "--allow-missing-mtp"]) == 0
    out = capsys.readouterr().out
    assert f"  warning: {absent}" in out.splitlines()


def test_no_mtp_layer_declared_is_a_warning(capsys, tmp_path):
    from vllm_dsv4_mtp.cli import main
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    src = build_tiny_checkpoint(tmp_path / "src", tiny_config(num_nextn_predict_layers=0), tokenizer=False)
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--no-progress"]) == 0
    assert (
        f"  warning: {src / 'config.json'}: num_nextn_predict_layers = 0: the checkpoint declares no MTP layer, "
        f"so MTP speculative decoding is unavailable"
    ) in capsys.readouterr().out.splitlines()
