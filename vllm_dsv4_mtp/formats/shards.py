"""Safetensors shard headers: parse and validate them, and say which files of a checkpoint a loader reads.

Header-only (the first bytes of each file, never the tensor data), so a whole checkpoint is checked in
milliseconds per shard: :func:`validate_shard_headers` is what engine start-up runs before vLLM opens the files,
:func:`read_safetensors_header` what :class:`~vllm_dsv4_mtp.formats.checkpoint.CheckpointReader` builds on.
Every error is a :class:`CheckpointError` whose message starts with the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "DTYPE_BYTES",
    "INDEX_FILE",
    "read_safetensors_header",
    "weight_files",
    "index_shards",
    "validate_shard_headers",
]

INDEX_FILE = "model.safetensors.index.json"

# Bytes per element for each safetensors dtype ("F4" packs two elements per byte: its shape counts elements).
DTYPE_BYTES: dict[str, float] = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "C64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F4": 0.5,
}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class CheckpointError(ValueError):
    """A malformed checkpoint directory; the message names the file (and the tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard and absolute byte range there, plus dtype and shape."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset of the data in ``file``
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors header: ``({name: TensorInfo}, __metadata__)``, in data order. Reads only the header.

    Checks what the safetensors library checks before it reads any data, so that a bad file is named here and
    not deep inside a loader: a header that parses, known dtypes, non-negative shapes, each tensor's byte range
    matching its dtype and shape, and the tensors covering the data section exactly (no gap, no overlap, no
    byte missing at the end of a truncated file, none left over after the last tensor).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    out = {name: _header_entry(path, name, h, data_start) for name, h in header.items()}
    _check_coverage(path, sorted(out.values(), key=lambda i: (i.begin, i.end)), data_start, size)
    return dict(sorted(out.items(), key=lambda kv: kv[1].begin)), meta


def _header_entry(path: Path, name: str, h: Any, data_start: int) -> TensorInfo:
    """One header entry as a :class:`TensorInfo` (absolute offsets), its byte range checked against its size."""
    try:
        dtype, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
        b, e = int(b), int(e)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}': {h!r}") from None
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
    if any(s < 0 for s in shape):
        raise CheckpointError(f"{path}: tensor '{name}' has a negative dimension in shape {list(shape)}")
    want = math.ceil(math.prod(shape) * DTYPE_BYTES[dtype])
    if b < 0 or e - b != want:
        raise CheckpointError(
            f"{path}: tensor '{name}' ({dtype} {list(shape)}) has data_offsets [{b}, {e}] that "
            f"do not match its size ({want} bytes)"
        )
    return TensorInfo(name, dtype, shape, path, data_start + b, data_start + e)


def _check_coverage(path: Path, infos: list[TensorInfo], data_start: int, size: int) -> None:
    """The tensors, in offset order, must tile ``[data_start, size)`` exactly (as safetensors requires)."""
    pos, prev = data_start, None
    for i in infos:
        if i.begin != pos:
            what = "overlaps" if i.begin < pos else "leaves a gap after"
            after = f"the previous tensor '{prev.name}'" if prev else "the header"
            raise CheckpointError(
                f"{path}: corrupt safetensors file: tensor '{i.name}' at data_offsets "
                f"[{i.begin - data_start}, {i.end - data_start}] {what} {after} (data offset "
                f"{pos - data_start})"
            )
        pos, prev = i.end, i
    if pos > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: its header describes {pos - data_start} data "
            f"bytes (through tensor '{prev.name}') but the file holds only {size - data_start}"
        )
    if pos < size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file: {size - pos} byte(s) after the last tensor's data "
            f"(the header covers {pos - data_start} of {size - data_start} data bytes)"
        )


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files a loader reads from ``model_dir``, as vLLM picks them: the shards named by
    ``model.safetensors.index.json`` when there is one (each must exist), else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if not index.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no {INDEX_FILE} and no *.safetensors file")
        return files
    by_shard = index_shards(index)
    return [model_dir / s for s in by_shard]


def index_shards(index: Path) -> dict[str, list[str]]:
    """``{shard file name: [tensor names]}`` from ``model.safetensors.index.json``; every listed shard must exist
    next to the index (the error names each missing one, with a tensor it should hold)."""
    model_dir = index.parent
    by_shard: dict[str, list[str]] = {}
    for name, shard in _read_weight_map(index).items():
        by_shard.setdefault(shard, []).append(name)
    missing = [s for s in by_shard if not (model_dir / s).is_file()]
    if missing:
        listed = "; ".join(
            f"'{s}' (listed for {len(by_shard[s])} tensors, e.g. '{by_shard[s][0]}')" for s in missing[:5]
        ) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else "")
        verb = "does" if len(missing) == 1 else "do"
        raise CheckpointError(f"{index}: shard{'s' if len(missing) > 1 else ''} {listed} {verb} not exist")
    return by_shard


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``. A tensor named twice in it is an error: JSON readers (Python's, vLLM's, the
    safetensors tools') silently keep the last entry, so which shard is meant depends on the order written."""
    repeated: list[tuple[str, object, object]] = []

    def pairs(items):
        obj: dict = {}
        for key, value in items:
            if key in obj:
                repeated.append((key, obj[key], value))
            obj[key] = value
        return obj

    try:
        data = json.loads(index.read_text(), object_pairs_hook=pairs)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: missing or empty 'weight_map'")
    twice = [(k, a, b) for k, a, b in repeated if k in weight_map and isinstance(b, str)]
    if twice:
        name, first, second = twice[0]
        more = f" (and {len(twice) - 1} more tensor(s) listed twice)" if len(twice) > 1 else ""
        raise CheckpointError(
            f"{index}: tensor '{name}' is listed twice in weight_map, for '{first}' and for "
            f"'{second}'{more}; JSON keeps only the last entry, so the index is ambiguous: "
            f"keep one entry per tensor"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map entry for tensor '{name}' is not a file name: {shard!r}")
    return weight_map


def validate_shard_headers(model_dir: str | Path) -> list[Path] | None:
    """Header-only check of every weight file vLLM will read from a local checkpoint directory (engine start-up).

    Raises :class:`CheckpointError` naming the file for a shard the index lists but that does not exist, and
    for a header that does not parse or whose tensors do not cover the file exactly (a truncated or corrupt
    shard). Reads the first bytes of each shard only: milliseconds per shard. Returns the files checked, or
    None when ``model_dir`` is not a local directory (a hub id or remote URI: nothing on disk to check yet).
    """
    if not Path(model_dir).is_dir():
        return None
    files = weight_files(model_dir)
    for f in files:
        read_safetensors_header(f)
    return files
