"""Read and write DeepSeek-V4 checkpoints: ``config.json`` + single-file or sharded safetensors.

:class:`CheckpointReader` lists every tensor (name, dtype, shape, shard, byte range) from the safetensors
headers alone, without touching the data; loads one tensor (:meth:`~CheckpointReader.get`), one shard at a time
(:meth:`~CheckpointReader.iter_shards`) or the raw bytes of a tensor for byte-for-byte copies
(:meth:`~CheckpointReader.raw_buffer`). A malformed checkpoint is an error naming the file: a shard the index
lists but that is missing, an index entry whose shard does not hold the tensor, a tensor stored twice, a
truncated or corrupt shard (headers: :mod:`vllm_dsv4_mtp.formats.shards`).

:class:`CheckpointWriter` writes shards of at most ``max_shard_bytes`` (one tensor larger than that gets a
shard of its own), ``model.safetensors.index.json``, ``config.json`` and copies tokenizer files.

dtypes are the safetensors names ("BF16", "F8_E4M3", "F8_E8M0", "U8", ...). E8M0 scales load as
``torch.float8_e8m0fnu``; view them as ``torch.uint8`` for their raw bytes, never cast them numerically.
FP8 block decoding lives in :mod:`vllm_dsv4_mtp.formats.fp8`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_dsv4_mtp.formats.shards import (  # re-exported: the header layer of this module
    DTYPE_BYTES,
    INDEX_FILE,
    CheckpointError,
    TensorInfo,
    index_shards,
    read_safetensors_header,
    validate_shard_headers,
    weight_files,
)

if TYPE_CHECKING:  # torch is imported lazily so that header-only tools stay light
    import torch

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "CheckpointReader",
    "CheckpointWriter",
    "INDEX_FILE",
    "DTYPE_BYTES",
    "read_safetensors_header",
    "validate_shard_headers",
    "weight_files",
    "TOKENIZER_FILES",
    "tokenizer_problems",
]

SINGLE_FILE = "model.safetensors"
# Files that travel with a checkpoint besides the weights (copied by CheckpointWriter.copy_tokenizer_files).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def tokenizer_problems(path: str | Path) -> list[str]:
    """What keeps vLLM from loading the checkpoint's own tokenizer, one message per problem (empty: loadable as
    far as files go). A DeepSeek-V4 tokenizer is a fast (Rust) tokenizer: ``tokenizer.json`` plus
    ``tokenizer_config.json``; a sentencepiece ``tokenizer.model`` can stand in for ``tokenizer.json``. Without
    them transformers says ``Couldn't instantiate the backend tokenizer ... install sentencepiece``, which names
    neither the folder nor the files."""
    d = Path(path)
    if not d.is_dir():
        return []
    problems = []
    wanted = ("tokenizer.json", "tokenizer_config.json")
    present = [n for n in wanted + ("tokenizer.model",) if (d / n).exists()]
    if not (d / "tokenizer.json").exists() and not (d / "tokenizer.model").exists():
        have = f"it has {', '.join(present)}" if present else "it has none of them"
        problems.append(
            f"{d}: no tokenizer: expected tokenizer.json (or a sentencepiece tokenizer.model) and "
            f"tokenizer_config.json in the checkpoint folder, {have}; copy the tokenizer files of the "
            f"checkpoint this one was made from, or serve with --tokenizer DIR"
        )
    elif not (d / "tokenizer_config.json").exists():
        problems.append(
            f"{d}: no tokenizer_config.json beside {present[0]} (it says the tokenizer class and the "
            f"special tokens); copy it from the checkpoint this one was made from"
        )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = d / name
        if not f.exists():
            continue
        try:
            json.loads(f.read_bytes())
        except OSError as e:
            problems.append(f"{f}: unreadable: {e.strerror or e}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"{f}: not valid JSON: {e}")
    return problems


class CheckpointReader:
    """A DeepSeek-V4 checkpoint directory, opened header-only.

    ``reader.tensors`` maps every tensor name to its :class:`TensorInfo`, in shard order; ``reader.config`` is
    the raw ``config.json`` dict (``None`` when absent); ``reader.spec`` the validated
    :class:`~vllm_dsv4_mtp.config.DeepseekV4Spec`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.index_file: Path | None = None
        self.shards: list[Path] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[Path, dict[str, str]] = {}
        self._load()

    # ------------------------------------------------------------------ opening
    def _load(self) -> None:
        index = self.path / INDEX_FILE
        if index.is_file():
            self.index_file = index
            self._load_indexed(index)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no {INDEX_FILE} and no *.safetensors file")
            for f in files:
                self._add_shard(f)

    def _add_shard(self, f: Path) -> dict[str, TensorInfo]:
        infos, meta = read_safetensors_header(f)
        for name in infos:
            if name in self.tensors:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' is stored twice: in {self.tensors[name].file.name} and {f.name}"
                )
        self.shards.append(f)
        self.metadata[f] = meta
        self.tensors.update(infos)
        return infos

    def _load_indexed(self, index: Path) -> None:
        by_shard = index_shards(index)  # every listed shard exists, or the error names each missing one
        weight_map = {n: shard for shard, names in by_shard.items() for n in names}
        for shard, names in by_shard.items():
            f = self.path / shard
            infos = self._add_shard(f)
            for name in names:
                if name not in infos:
                    raise CheckpointError(f"{index}: tensor '{name}' is mapped to '{shard}', which does not contain it")
            extra = [n for n in infos if weight_map.get(n) != shard]
            if extra:
                raise CheckpointError(
                    f"{f}: tensor '{extra[0]}' is stored in this shard but {INDEX_FILE} "
                    f"does not list it here ({len(extra)} such tensors)"
                )
        others = sorted(p.name for p in self.path.glob("*.safetensors") if p.name not in by_shard)
        if others:
            raise CheckpointError(f"{index}: {others[0]} is in the directory but not listed in the index")

    # ------------------------------------------------------------------ config
    @property
    def config(self) -> dict[str, Any] | None:
        f = self.path / "config.json"
        if not f.is_file():
            return None
        try:
            return json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{f}: not valid JSON: {e}") from None

    @property
    def spec(self):
        from vllm_dsv4_mtp.config import DeepseekV4Spec

        return DeepseekV4Spec.from_dir(self.path)

    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    # ------------------------------------------------------------------ listing
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"tensor '{name}' is not in checkpoint {self.path}") from None

    def shard_names(self, shard: str | Path) -> list[str]:
        f = self.path / Path(shard).name
        return [n for n, i in self.tensors.items() if i.file == f]

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    # ------------------------------------------------------------------ data
    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (its stored dtype; E8M0 as ``torch.float8_e8m0fnu``)."""
        from safetensors import safe_open

        info = self.info(name)
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(name)

    def raw_bytes(self, name: str) -> bytes:
        """The stored bytes of one tensor, exactly (for comparisons; copies use :meth:`raw_buffer`)."""
        return bytes(self.raw_buffer(name))

    def raw_buffer(self, name: str) -> bytearray:
        """The stored bytes of one tensor in a fresh writable buffer, read once: ``torch.frombuffer`` can view
        it without another copy, so a byte-for-byte copy holds the tensor in memory once."""
        info = self.info(name)
        data = bytearray(info.nbytes)
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            n = f.readinto(data)
        if n != info.nbytes:
            raise CheckpointError(f"{info.file}: truncated data for tensor '{name}'")
        return data

    def iter_shards(self) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
        """Yield ``(shard_path, {name: tensor})`` one shard at a time: memory stays bounded by one shard."""
        for shard in self.shards:
            yield shard, self.load_shard(shard)

    def load_shard(self, shard: str | Path) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        f = self.path / Path(shard).name
        with safe_open(str(f), framework="pt") as h:
            return {n: h.get_tensor(n) for n in self.shard_names(f)}

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in storage order, one tensor in memory at a time."""
        from safetensors import safe_open

        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as h:
                for n in self.shard_names(shard):
                    yield n, h.get_tensor(n)


# ------------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------------
_TORCH_DTYPE_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float4_e2m1fn_x2": "F4",
}


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors")
    return _TORCH_DTYPE_NAMES[name]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    inv = {v: k for k, v in _TORCH_DTYPE_NAMES.items()}
    return getattr(torch, inv[name])


class CheckpointWriter:
    """Write a checkpoint: shards of at most ``max_shard_bytes`` plus ``model.safetensors.index.json``.

    Tensors are buffered and flushed a shard at a time (memory bounded by one shard). ``close()`` (or leaving
    the ``with`` block without an exception) names the shards ``model-0000i-of-0000N.safetensors`` and writes
    the index; a single shard is written as ``model.safetensors`` with no index unless ``always_index``.
    """

    def __init__(
        self, path: str | Path, max_shard_bytes: int = 5 * 2**30, *, always_index: bool = False, overwrite: bool = False
    ):
        self.path = Path(path)
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be > 0")
        if self.path.exists() and any(self.path.glob("*.safetensors")) and not overwrite:
            raise CheckpointError(f"{self.path}: already holds safetensors files (pass overwrite=True)")
        self.path.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for f in list(self.path.glob("*.safetensors")) + [self.path / INDEX_FILE]:
                f.unlink(missing_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.always_index = always_index
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._tmp_shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._total = 0
        self._closed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # never leave a half-written checkpoint that looks complete
            for f, _ in self._tmp_shards:
                f.unlink(missing_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (stored in its own dtype, contiguous)."""
        if self._closed:
            raise CheckpointError(f"{self.path}: writer is closed")
        if name in self._names:
            raise CheckpointError(f"{self.path}: tensor '{name}' written twice")
        torch_dtype_name(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._buf[name] = tensor.detach().contiguous().cpu()
        self._buf_bytes += nbytes
        self._total += nbytes

    def add_raw(self, name: str, dtype: str, shape: tuple[int, ...] | list[int], data: bytes | bytearray) -> None:
        """Queue a tensor given as raw stored bytes (``CheckpointReader.raw_buffer``): copied byte for byte.

        A ``bytearray`` is used in place (the writer keeps a view of it); ``bytes`` are copied once.
        """
        import torch

        buf = data if isinstance(data, bytearray) else bytearray(data)
        if dtype == "F4":  # shape counts fp4 elements; torch's float4_e2m1fn_x2 counts bytes
            t = torch.frombuffer(buf, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
            t = t.reshape(*shape[:-1], shape[-1] // 2)
        else:
            t = torch.frombuffer(buf, dtype=torch.uint8).view(_torch_dtype(dtype)).reshape(tuple(shape))
        self.add(name, t)

    def copy_from(self, reader: CheckpointReader, name: str, new_name: str | None = None) -> None:
        """Copy one tensor from another checkpoint byte for byte."""
        info = reader.info(name)
        self.add_raw(new_name or name, info.dtype, info.shape, reader.raw_buffer(name))

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        f = self.path / f".shard-{len(self._tmp_shards):05d}.safetensors.tmp"
        try:
            save_file(self._buf, str(f), metadata={"format": "pt"})
        except Exception as e:  # safetensors' own error type names no file and hides the OS error number
            f.unlink(missing_ok=True)
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code:
                raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(f)) from None
            raise CheckpointError(f"{f}: writing the shard failed: {e}") from None
        self._tmp_shards.append((f, list(self._buf)))
        self._buf = {}
        self._buf_bytes = 0

    def write_config(self, config: Mapping[str, Any]) -> Path:
        f = self.path / "config.json"
        f.write_text(json.dumps(config, indent=2) + "\n")
        return f

    def copy_tokenizer_files(self, src: str | Path) -> list[Path]:
        """Copy the tokenizer / generation-config files present in ``src`` (see TOKENIZER_FILES)."""
        out = []
        for n in TOKENIZER_FILES:
            s = Path(src) / n
            if s.is_file():
                shutil.copyfile(s, self.path / n)
                out.append(self.path / n)
        return out

    def close(self) -> list[Path]:
        """Flush, name the shards, write the index; returns the shard paths."""
        if self._closed:
            return [self.path / n for n in self._final_names]
        self._flush()
        n = len(self._tmp_shards)
        if n == 0:
            raise CheckpointError(f"{self.path}: no tensors written")
        if n == 1 and not self.always_index:
            names = [SINGLE_FILE]
        else:
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        umask = os.umask(0)
        os.umask(umask)
        for (tmp, tensor_names), final in zip(self._tmp_shards, names):
            os.replace(tmp, self.path / final)
            os.chmod(self.path / final, 0o666 & ~umask)  # safetensors creates files 0600
            for t in tensor_names:
                weight_map[t] = final
        if len(names) > 1 or self.always_index:
            index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
            (self.path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self._final_names = names
        self._closed = True
        return [self.path / n for n in names]
