"""CheckpointReader / CheckpointWriter (vllm_dsv4_mtp.formats.checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_dsv4_mtp.formats.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    e8m0 = torch.tensor([[0, 127, 128, 254, 255, 1]], dtype=torch.uint8)  # 255 = NaN: must survive as a byte
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "hc_head_fn": torch.randn(4, 128, generator=g),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 8, (64, 2), generator=g),
        "layers.0.attn.wq_a.weight": torch.randn(128, 32, generator=g).to(torch.float8_e4m3fn),
        "layers.0.attn.wq_a.scale": e8m0.view(torch.float8_e8m0fnu),
        "layers.0.ffn.experts.0.w1.weight": torch.randint(0, 256, (16, 16), generator=g, dtype=torch.uint8),
        "layers.0.ffn.experts.0.w1.weight_scale": e8m0.clone(),
        "layers.0.ffn.experts.1.w1.weight": torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int8),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }


def _write(path, tensors, **kw):
    with CheckpointWriter(path, **kw) as w:
        for n, t in tensors.items():
            w.add(n, t)
        w.write_config({"model_type": "deepseek_v4"})
    return path


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_sharded_round_trip(tmp_path):
    ts = _tensors()
    _write(tmp_path, ts, max_shard_bytes=3000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    r = CheckpointReader(tmp_path)
    assert sorted(r.names()) == sorted(ts)
    # listing is in storage order: shard by shard, by data offset
    assert [(r.shards.index(r.info(n).file), r.info(n).begin) for n in r.names()] == sorted(
        (r.shards.index(r.info(n).file), r.info(n).begin) for n in r.names()
    )
    assert r.config == {"model_type": "deepseek_v4"}
    for n, t in ts.items():
        info = r.info(n)
        assert info.shape == tuple(t.shape)
        assert (
            info.dtype
            == {
                "torch.bfloat16": "BF16",
                "torch.float32": "F32",
                "torch.int64": "I64",
                "torch.float8_e4m3fn": "F8_E4M3",
                "torch.float8_e8m0fnu": "F8_E8M0",
                "torch.uint8": "U8",
                "torch.int8": "I8",
            }[str(t.dtype)]
        )
        got = r.get(n)
        assert got.dtype == t.dtype and _bytes(got) == _bytes(t)
        assert r.raw_bytes(n) == _bytes(t)
    # each shard respects the limit unless one tensor alone exceeds it
    for shard in r.shards:
        infos = [r.info(n) for n in r.shard_names(shard)]
        assert len(infos) == 1 or sum(i.nbytes for i in infos) <= 3000
    seen = {}
    for shard, tensors in r.iter_shards():
        assert set(tensors) == set(r.shard_names(shard))
        seen.update(tensors)
    assert set(seen) == set(ts)
    assert [n for n, _ in r.iter_tensors()] == r.names()
    # E8M0 bytes, NaN included, are stored as they are
    assert r.raw_bytes("layers.0.attn.wq_a.scale") == bytes([0, 127, 128, 254, 255, 1])


def test_single_file_has_no_index(tmp_path):
    _write(tmp_path, _tensors())
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / INDEX_FILE).exists()
    assert len(CheckpointReader(tmp_path)) == len(_tensors())
    out = tmp_path / "idx"
    _write(out, _tensors(), always_index=True)
    assert json.loads((out / INDEX_FILE).read_text())["weight_map"]["norm.weight"] == "model-00001-of-00001.safetensors"


def test_byte_for_byte_copy(tmp_path):
    src = CheckpointReader(_write(tmp_path / "a", _tensors(), max_shard_bytes=2000))
    with CheckpointWriter(tmp_path / "b", max_shard_bytes=10**6) as w:
        for n in src:
            w.copy_from(src, n)
    dst = CheckpointReader(tmp_path / "b")
    for n in src:
        assert (dst.info(n).dtype, dst.info(n).shape) == (src.info(n).dtype, src.info(n).shape)
        assert dst.raw_bytes(n) == src.raw_bytes(n)


def test_fp4_dtype_raw_copy(tmp_path):
    t = torch.randint(0, 256, (4, 8), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    _write(tmp_path / "a", {"x": t})
    r = CheckpointReader(tmp_path / "a")
    assert (r.info("x").dtype, r.info("x").shape, r.info("x").nbytes) == ("F4", (4, 16), 32)
    with CheckpointWriter(tmp_path / "b") as w:
        w.copy_from(r, "x")
    assert CheckpointReader(tmp_path / "b").raw_bytes("x") == r.raw_bytes("x") == _bytes(t)


def test_tokenizer_files_are_copied(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text('{"a": 1}')
    with CheckpointWriter(tmp_path / "dst") as w:
        w.add("x", torch.zeros(2))
        copied = w.copy_tokenizer_files(src)
    assert sorted(p.name for p in copied) == ["tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "dst" / "tokenizer_config.json").read_text() == '{"a": 1}'
    assert CheckpointReader(tmp_path / "dst").tokenizer_files() == copied


def test_missing_shard_is_named(tmp_path):
    _write(tmp_path, _tensors(), max_shard_bytes=3000)
    shard = sorted(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / INDEX_FILE}: shard '{shard}' (listed for ")
    assert str(e.value).endswith(") does not exist")


def test_index_entry_for_absent_tensor_is_named(tmp_path):
    _write(tmp_path, _tensors(), max_shard_bytes=3000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shard = index["weight_map"]["norm.weight"]
    index["weight_map"]["layers.9.attn.wkv.weight"] = shard
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / INDEX_FILE}: tensor 'layers.9.attn.wkv.weight' is mapped to '{shard}', which does not contain it"
    )


def test_tensor_missing_from_index_is_named(tmp_path):
    _write(tmp_path, _tensors(), max_shard_bytes=3000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shard = index["weight_map"].pop("norm.weight")
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / shard}: tensor 'norm.weight' is stored in this shard but {INDEX_FILE} "
        f"does not list it here (1 such tensors)"
    )


def test_duplicate_tensor_names_are_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"embed.weight": torch.zeros(2), "a": torch.zeros(1)}, str(tmp_path / "x-1.safetensors"))
    save_file({"embed.weight": torch.ones(2)}, str(tmp_path / "x-2.safetensors"))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == f"{tmp_path}: tensor 'embed.weight' is stored twice: in x-1.safetensors and x-2.safetensors"


def test_truncated_and_empty(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json and no"):
        CheckpointReader(tmp_path)
    _write(tmp_path, {"w": torch.zeros(100)})
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == (
        f"{f}: truncated safetensors file: its header describes 400 data bytes (through tensor "
        f"'w') but the file holds only 390"
    )
    f.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="shorter than its 8-byte header length"):
        CheckpointReader(tmp_path)


def test_writer_refuses_duplicates_and_existing_output(tmp_path):
    w = CheckpointWriter(tmp_path)
    w.add("a", torch.zeros(1))
    with pytest.raises(CheckpointError, match="tensor 'a' written twice"):
        w.add("a", torch.zeros(1))
    w.close()
    with pytest.raises(CheckpointError, match="already holds safetensors files"):
        CheckpointWriter(tmp_path)
    with CheckpointWriter(tmp_path, overwrite=True) as w2:
        w2.add("b", torch.zeros(1))
    assert CheckpointReader(tmp_path).names() == ["b"]


def test_failed_write_leaves_no_shards(tmp_path):
    with pytest.raises(RuntimeError):
        with CheckpointWriter(tmp_path, max_shard_bytes=8) as w:
            w.add("a", torch.zeros(4))
            w.add("b", torch.zeros(4))  # flushes "a"
            raise RuntimeError("boom")
    assert not list(tmp_path.glob("*safetensors*"))


@pytest.mark.parametrize("right_last", [False, True])
def test_tensor_listed_twice_in_the_index_is_named_by_inspect_and_engine(tmp_path, right_last):
    """Issue 38 item 5: an index naming a tensor twice was blamed on "stored in this shard but ... does not list
    it here" (wrong shard last), or accepted silently (right shard last). Now ``inspect`` (through
    ``CheckpointReader``) and the engine's start-up check (``validate_shard_headers``) name the duplicate."""
    from vllm_dsv4_mtp.formats.shards import validate_shard_headers
    from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint

    _write(tmp_path, _tensors(), max_shard_bytes=3000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    right = index["weight_map"]["norm.weight"]
    wrong = next(s for s in set(index["weight_map"].values()) if s != right)
    first, second = (wrong, right) if right_last else (right, wrong)
    entries = [f'"norm.weight": "{first}"'] + [
        f"{json.dumps(n)}: {json.dumps(s)}" for n, s in index["weight_map"].items() if n != "norm.weight"
    ]
    text = '{"weight_map": {' + ", ".join(entries) + f', "norm.weight": "{second}"' + "}}"
    (tmp_path / INDEX_FILE).write_text(text)
    assert text.count('"norm.weight"') == 2
    want = (
        f"{tmp_path / INDEX_FILE}: tensor 'norm.weight' is listed twice in weight_map, for '{first}' and for "
        f"'{second}'; JSON keeps only the last entry, so the index is ambiguous: keep one entry per tensor"
    )
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert str(e.value) == want
    with pytest.raises(CheckpointError) as e:
        validate_shard_headers(tmp_path)
    assert str(e.value) == want
    report = inspect_checkpoint(tmp_path)
    # (this test's checkpoint has no tokenizer files: inspect names that too, as a separate problem)
    assert [p.message for p in report.problems if p.severity == "error" and p.code != "tokenizer"] == [want]
