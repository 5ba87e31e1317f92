"""Shard headers (vllm_dsv4_mtp.formats.shards): every way a safetensors file can be broken is named with the file,
checked against the safetensors library itself (what vLLM's loader would say) where that library refuses it too."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_dsv4_mtp.formats.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    read_safetensors_header,
    validate_shard_headers,
)


def _raw(path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: 8-byte little-endian header length, JSON header, data."""
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _safetensors_refuses(path) -> str:
    """The safetensors library's own refusal (what vLLM's loader raises, naming no file)."""
    with pytest.raises(Exception) as e:
        with safe_open(str(path), framework="pt") as f:
            for n in f.keys():
                f.get_tensor(n)
    return str(e.value)


def _sharded(path, n_tensors=6, max_shard_bytes=900):
    with CheckpointWriter(path, max_shard_bytes=max_shard_bytes) as w:
        for i in range(n_tensors):
            w.add(f"t{i}", torch.full((100,), float(i)))  # 400 bytes each: 2 per shard
        w.write_config({"model_type": "deepseek_v4"})
    return path


def test_good_shards_pass_and_only_listed_files_are_read(tmp_path):
    d = _sharded(tmp_path / "c")
    files = validate_shard_headers(d)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    # a stray file the index does not list is not read by vLLM, so it is not checked at start-up either
    (d / "stray.safetensors").write_bytes(b"garbage")
    assert len(validate_shard_headers(d)) == 3
    assert validate_shard_headers(tmp_path / "not-a-dir") is None  # a hub id: nothing local to check


def test_truncated_shard_is_named(tmp_path):
    d = _sharded(tmp_path / "c")
    f = d / "model-00002-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    assert "incomplete metadata" in _safetensors_refuses(f)  # vLLM's message names no file
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(d)
    assert str(e.value) == (
        f"{f}: truncated safetensors file: its header describes 800 data bytes (through tensor "
        f"'t3') but the file holds only 793"
    )


def test_truncated_inside_the_header_is_named(tmp_path):
    d = _sharded(tmp_path / "c")
    f = d / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(d)
    assert str(e.value).startswith(f"{f}: corrupt or truncated safetensors header (header length ")
    assert str(e.value).endswith(", file size 40)")


def test_trailing_bytes_are_named(tmp_path):
    f = tmp_path / "model.safetensors"
    _raw(f, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12))
    assert "not fully covered" in _safetensors_refuses(f)
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(tmp_path)
    assert str(e.value) == (
        f"{f}: corrupt safetensors file: 4 byte(s) after the last tensor's data (the header covers 8 of 12 data bytes)"
    )


def test_gap_and_overlap_are_named(tmp_path):
    f = tmp_path / "model.safetensors"
    _raw(
        f,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
        },
        bytes(16),
    )
    _safetensors_refuses(f)
    with pytest.raises(CheckpointError) as e:
        read_safetensors_header(f)
    assert str(e.value) == (
        f"{f}: corrupt safetensors file: tensor 'b' at data_offsets [12, 16] leaves a gap after "
        f"the previous tensor 'a' (data offset 8)"
    )
    _raw(
        f,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        bytes(12),
    )
    _safetensors_refuses(f)
    with pytest.raises(CheckpointError) as e:
        read_safetensors_header(f)
    assert str(e.value) == (
        f"{f}: corrupt safetensors file: tensor 'b' at data_offsets [4, 12] overlaps the "
        f"previous tensor 'a' (data offset 8)"
    )


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}, "tensor 'a' has unknown dtype 'F33'"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "tensor 'a' has a negative dimension in shape [-1]"),
        (
            {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
            "tensor 'a' (F32 [2]) has data_offsets [0, 4] that do not match its size (8 bytes)",
        ),
        (
            {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]},
            "corrupt header entry for tensor 'a': {'dtype': 'F32', 'shape': 'x', 'data_offsets': [0, 4]}",
        ),
    ],
)
def test_bad_header_entries_are_named(tmp_path, entry, message):
    f = tmp_path / "model.safetensors"
    _raw(f, {"a": entry}, bytes(4))
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(tmp_path)
    assert str(e.value) == f"{f}: {message}"


def test_header_not_json_is_named(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 5) + b"{nope" + bytes(4))
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(tmp_path)
    assert str(e.value).startswith(f"{f}: corrupt safetensors header: ")


def test_missing_shard_files_are_named(tmp_path):
    d = _sharded(tmp_path / "c")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(d)
    assert str(e.value) == (
        f"{d / INDEX_FILE}: shard 'model-00002-of-00003.safetensors' (listed for 2 tensors, e.g. 't2') does not exist"
    )
    (d / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(d)
    assert str(e.value) == (
        f"{d / INDEX_FILE}: shards 'model-00002-of-00003.safetensors' (listed for 2 tensors, "
        f"e.g. 't2'); 'model-00003-of-00003.safetensors' (listed for 2 tensors, e.g. 't4') do "
        f"not exist"
    )


def test_index_pointing_one_tensor_at_a_missing_file_names_that_file(tmp_path):
    """The issue's case: one index entry renamed to a file that does not exist; the reader used to complain
    about the shard that really holds the tensor instead of naming the missing file."""
    d = _sharded(tmp_path / "c")
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["t3"] = "model-00009-of-00009.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    for check in (validate_shard_headers, CheckpointReader):
        with pytest.raises(CheckpointError) as e:
            check(d)
        assert str(e.value) == (
            f"{d / INDEX_FILE}: shard 'model-00009-of-00009.safetensors' (listed for 1 tensors, "
            f"e.g. 't3') does not exist"
        )


def test_index_not_json_is_named(tmp_path):
    d = _sharded(tmp_path / "c")
    (d / INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(d)
    assert str(e.value).startswith(f"{d / INDEX_FILE}: not valid JSON: ")


def test_no_weights_at_all(tmp_path):
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(tmp_path)
    assert str(e.value) == f"{tmp_path}: no {INDEX_FILE} and no *.safetensors file"


def test_header_check_reads_no_tensor_data(tmp_path):
    """Header-only: a file whose data bytes are unreadable garbage of the right length still passes (the data is
    never read), so start-up costs the same for a 1 MB and a 100 GB shard."""
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(1000)}, str(f))
    raw = bytearray(f.read_bytes())
    raw[-4000:] = b"\xff" * 4000
    f.write_bytes(bytes(raw))
    assert validate_shard_headers(tmp_path) == [f]
