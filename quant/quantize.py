"""Convert a DeepSeek-V4 checkpoint to Quark OCP MXFP4 routed experts, shard by shard, on CPU.

What happens to each tensor (native names; ``N`` a main layer, ``E`` an expert):

- ``layers.N.ffn.experts.E.w{1,2,3}.weight`` (routed experts):
  - BF16 / F16 / F32 -> MXFP4 exactly as amd-quark 0.13 quantizes them (:mod:`vllm_dsv4_mtp.formats.mxfp4`):
    ``.weight`` uint8 ``[out, in/2]`` + ``.weight_scale`` uint8 E8M0 ``[out, in/32]``;
  - official FP4 (int8 packed ``.weight`` + F8_E8M0 ``.scale`` at 1x32) -> the SAME bytes, stored as uint8
    ``.weight`` + uint8 ``.weight_scale`` (lossless: no decode, no re-rounding);
  - FP8 128x128 block (``expert_dtype: fp8`` releases) -> decoded exactly, then MXFP4 as above.
- ``layers.N.ffn.shared_experts.*``: ``--shared-experts keep`` (default) leaves them as stored (BF16: excluded;
  FP8: kept, see below); ``mxfp4`` quantizes them like routed experts (the AMD export's fused-shared layout).
- the MTP layer (``mtp.*``), ``--mtp bf16`` (default): BF16, listed in ``exclude``. BF16/F32 tensors are copied;
  FP8 and FP4 weights of an official release are decoded to BF16 (exact: a few significant bits times a power of
  two) and their scales dropped. ``--mtp amd``: as AMD's Quark export stores it: routed experts MXFP4 (as the
  main layers'), the shared expert FP8 e4m3 in 128x128 blocks with an E8M0 ``.weight_scale`` (an FP8 source's
  bytes kept, a float one quantized), both declared by ``layer_quant_config`` entries keyed as AMD's config
  keys them; every other MTP tensor as the source stores it (BF16 excluded, FP8 kept as below).
- FP8 block weights elsewhere (official attention, indexer, ...): bytes kept; the ``.scale`` is renamed
  ``.weight_scale`` (as Quark's own flow writes kept FP8 layers) and the module gets an FP8 per-block entry in
  ``layer_quant_config``.
- everything else: copied byte for byte under its own name.

``config.json`` gets the Quark ``quantization_config``
(:func:`~vllm_dsv4_mtp.formats.quark_config.mxfp4_experts_config`); other files (tokenizer, generation
config, ...) are copied. Output goes to a hidden directory next to DST that replaces DST atomically only when
complete (:mod:`vllm_dsv4_mtp.quant.publish`: at every instant DST is the previous output or the complete new one); an
existing DST is replaced only with ``force``. Leftovers of interrupted runs are removed (and reported) first.

Refused, naming the file and tensor: NaN / Inf source weights (they would quantize to the E8M0 NaN/Inf scales
255/254 and serve garbage), a destination without room for the output (checked up front), and any I/O error on
the way (a full disk included): the partial output is removed and DST left as it was.
Memory: one output shard (at most ``max_shard_bytes``, by default the largest source shard) plus the tensor
being converted.
"""

from __future__ import annotations

import errno
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from vllm_dsv4_mtp.quant.publish import (
    Busy,
    WorkDir,
    crash_point,
    discard,
    publish,
    signals_deferred,
    signals_interrupt,
    sweep,
    sync_tree,
)
from vllm_dsv4_mtp.quant.report import QuantizeReport

__all__ = ["QuantizeError", "QuantizeReport", "quantize_checkpoint", "SHARED_EXPERT_MODES", "MTP_MODES"]

SHARED_EXPERT_MODES = ("keep", "mxfp4")
MTP_MODES = ("bf16", "amd")

ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
SHARED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.shared_experts\.w[123]\.weight$")
MTP_ROUTED_EXPERT = re.compile(r"^mtp\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
MTP_SHARED_EXPERT = re.compile(r"^mtp\.\d+\.ffn\.shared_experts\.w[123]\.weight$")
# how AMD's export declares its MTP experts (vLLM's get_deepseek_v4_quark_config keys them the same way)
MTP_ROUTED_PATTERN = r"re:mtp\.\d+\.ffn\.experts\.\d+\.w[123]$"
MTP_SHARED_PATTERN = r"re:mtp\.\d+\.ffn\.shared_experts\.w[123]$"
_FLOAT = ("BF16", "F16", "F32")
_PACKED_FP4 = ("I8", "U8")
_E8M0 = ("F8_E8M0", "U8")
# sibling scale names of "<module>.weight": official release, Quark, DeepSeek-V3-style FP8
_SCALE_SUFFIXES = (".scale", ".weight_scale", ".weight_scale_inv")


class QuantizeError(Exception):
    """The conversion cannot proceed; the message names the checkpoint file or tensor."""


def _is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Quark's notion of a linear weight (file2file flow): ``<module>.weight``, 2-D, module not a norm or an
    embedding. These are the modules Quark lists in ``exclude`` when it leaves them unquantized."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    module = name[: -len(".weight")]
    return not module.endswith("norm") and "embed" not in module


def _module(name: str) -> str:
    return name[: -len(".weight")]


def _scale_of(reader, weight_name: str) -> str | None:
    """The sibling scale tensor of ``<module>.weight`` (``.scale``, ``.weight_scale`` or ``.weight_scale_inv``)."""
    module = _module(weight_name)
    found = [module + s for s in _SCALE_SUFFIXES if module + s in reader]
    if len(found) > 1:
        raise QuantizeError(f"{reader.info(weight_name).file}: {weight_name} has several scale tensors: {found}")
    return found[0] if found else None


def _scale_owner(reader, name: str) -> str | None:
    """For a scale tensor, the weight it belongs to (if that weight is stored)."""
    for s in _SCALE_SUFFIXES:
        if name.endswith(s):
            weight = name[: -len(s)] + ".weight"
            return weight if weight in reader else None
    return None


class _Converter:
    """One conversion: decides per tensor, writes through a CheckpointWriter."""

    def __init__(self, reader, writer, shared_experts: str, report: QuantizeReport, mtp: str = "bf16"):
        self.r, self.w, self.shared_experts, self.report, self.mtp = reader, writer, shared_experts, report, mtp
        self.exclude: set[str] = set()
        self.fp8_layers: dict[str, dict[str, Any]] = {}
        self.mtp_layers: dict[str, dict[str, Any]] = {}  # --mtp amd: the MTP experts' layer_quant_config entries

    # ------------------------------------------------------------------------------------------ helpers
    def where(self, name: str) -> str:
        return f"{self.r.info(name).file}: {name}"

    def load(self, name: str):
        return self.r.get(name)

    def copy(self, name: str, new_name: str | None = None) -> None:
        info = self.r.info(name)
        data = self.r.raw_buffer(name)
        self.refuse_nonfinite(name, info.dtype, data)
        self.w.add_raw(new_name or name, info.dtype, info.shape, data)
        self.report.copied += 1

    def refuse_nonfinite(self, name: str, dtype: str, data) -> None:
        """Stored bytes of ``name`` with a NaN / Inf (see formats.finite) stop the conversion, naming it."""
        import torch

        from vllm_dsv4_mtp.formats.finite import stored_nonfinite

        found = stored_nonfinite(name, dtype, torch.frombuffer(data, dtype=torch.uint8)) if len(data) else None
        if found:
            self.nonfinite(name, found)

    def nonfinite(self, name: str, found: str) -> None:
        raise QuantizeError(
            f"{self.where(name)}: non-finite values in the source ({found}): a broken or corrupted "
            f"weight cannot be quantized (`dsv4-mtp inspect --scan-values {self.r.path}` lists "
            f"every such tensor)"
        )

    def fp4_pair(self, name: str, scale: str | None) -> bool:
        """Is ``name`` + ``scale`` an MXFP4 pair (packed bytes ``[out, k/2]`` + E8M0 ``[out, k/32]``)? Checks shapes."""
        wi = self.r.info(name)
        if wi.dtype not in _PACKED_FP4:
            return False
        if scale is None:
            raise QuantizeError(
                f"{self.where(name)}: packed FP4 weight ({wi.dtype}) without a scale tensor "
                f"(expected {_module(name)}.scale or .weight_scale)"
            )
        si = self.r.info(scale)
        want = (wi.shape[0], wi.shape[1] * 2 // 32) if len(wi.shape) == 2 else None
        if si.dtype not in _E8M0 or want is None or (wi.shape[1] * 2) % 32 or tuple(si.shape) != want:
            raise QuantizeError(
                f"{self.where(name)}: packed FP4 weight {wi.dtype} {list(wi.shape)} needs an E8M0 scale "
                f"{list(want) if want else '[out, in/32]'} (F8_E8M0 or U8), but {scale} is {si.dtype} "
                f"{list(si.shape)}"
            )
        return True

    def fp8_pair(self, name: str, scale: str | None) -> bool:
        wi = self.r.info(name)
        if wi.dtype != "F8_E4M3":
            return False
        if scale is None:
            raise QuantizeError(
                f"{self.where(name)}: FP8 weight without a block scale tensor (expected {_module(name)}.scale)"
            )
        from vllm_dsv4_mtp.formats.fp8 import block_scale_shape

        si = self.r.info(scale)
        want = block_scale_shape(wi.shape)
        if tuple(si.shape) != want or si.dtype not in ("F8_E8M0", "U8", "F32"):
            raise QuantizeError(
                f"{self.where(name)}: FP8 weight {list(wi.shape)} needs a block scale "
                f"{list(want)} (F8_E8M0, U8 or F32), but {scale} is {si.dtype} {list(si.shape)}"
            )
        return True

    def decode(self, name: str, scale: str | None):
        """The float value of a stored weight: FP8 block or FP4 decoded exactly (float32), float as stored."""
        import torch

        from vllm_dsv4_mtp.formats import fp8, mxfp4

        if self.fp8_pair(name, scale):
            return fp8.dequantize_block_fp8(self.load(name), self.load(scale), torch.float32, name=name)
        if self.fp4_pair(name, scale):
            return mxfp4.dequantize(self.load(name), self.load(scale), torch.float32)
        dtype = self.r.info(name).dtype
        if dtype not in _FLOAT:
            raise QuantizeError(f"{self.where(name)}: cannot read a {dtype} weight as numbers")
        return self.load(name)

    # ------------------------------------------------------------------------------------------ actions
    def to_mxfp4(self, name: str, scale: str | None) -> None:
        """Routed (or shared) expert -> Quark MXFP4 ``.weight`` + ``.weight_scale`` (uint8)."""
        from vllm_dsv4_mtp.formats import mxfp4

        module = _module(name)
        if self.fp4_pair(name, scale):  # official FP4: keep the bytes, Quark names and uint8 containers
            wi, si = self.r.info(name), self.r.info(scale)
            scale_bytes = self.r.raw_buffer(scale)
            self.refuse_nonfinite(scale, si.dtype, scale_bytes)
            self.w.add_raw(name, "U8", wi.shape, self.r.raw_buffer(name))
            self.w.add_raw(module + ".weight_scale", "U8", si.shape, scale_bytes)
            self.report.reencoded.append(name)
            return
        from_fp8 = self.fp8_pair(name, scale)
        value = self.decode(name, scale)
        try:
            packed, scales = mxfp4.quantize(value)
        except (ValueError, TypeError) as e:
            raise QuantizeError(f"{self.where(name)}: {e}") from None
        if int(scales.max()) >= 254:  # the NaN / Inf scale bytes: look at the values only then (cheap otherwise)
            from vllm_dsv4_mtp.formats.finite import describe_nonfinite

            found = describe_nonfinite(value)
            if found:
                self.nonfinite(name, found)
        self.w.add(name, packed)
        self.w.add(module + ".weight_scale", scales)
        (self.report.requantized_fp8 if from_fp8 else self.report.quantized).append(name)

    def to_bf16(self, name: str, scale: str | None) -> None:
        """MTP weight: BF16/F32 copied; FP8 / FP4 decoded exactly to BF16 (scale dropped)."""
        import torch

        if self.r.info(name).dtype in _FLOAT:
            if scale is not None:
                raise QuantizeError(
                    f"{self.where(name)}: {self.r.info(name).dtype} weight has a scale tensor "
                    f"{scale}; only FP8 and FP4 weights carry scales"
                )
            self.copy(name)
            return
        from vllm_dsv4_mtp.formats.finite import describe_nonfinite

        value = self.decode(name, scale)
        found = describe_nonfinite(value)  # an FP8 NaN code or an E8M0 NaN scale decodes to NaN
        if found:
            self.nonfinite(name, found)
        self.w.add(name, value.to(torch.bfloat16))
        self.report.mtp_dequantized.append(name)

    def copy_fp8(self, name: str, scale: str) -> str:
        """An FP8 block weight's bytes kept and its scale renamed ``.weight_scale``; returns the Quark
        ``scale_type`` that describes the scale as stored (F32 or E8M0)."""
        self.copy(name)
        self.copy(scale, _module(name) + ".weight_scale")
        return "float32" if self.r.info(scale).dtype == "F32" else "float8_e8m0fnu"

    def to_fp8_block(self, name: str, scale: str | None) -> str:
        """MTP shared expert (``--mtp amd``) -> FP8 e4m3 128x128 blocks + ``.weight_scale``: an FP8 source's bytes
        kept (its scale renamed, F32 or E8M0 as stored), a float one quantized (E8M0: the smallest power-of-two scale
        >= amax/448). Returns the scale's Quark ``scale_type``."""
        import torch

        from vllm_dsv4_mtp.formats.fp8 import quantize_block_fp8

        module = _module(name)
        if self.fp8_pair(name, scale):
            return self.copy_fp8(name, scale)
        if self.fp4_pair(name, scale):
            raise QuantizeError(f"{self.where(name)}: a packed FP4 shared expert cannot be stored FP8 exactly")
        value = self.decode(name, scale)
        from vllm_dsv4_mtp.formats.finite import describe_nonfinite

        found = describe_nonfinite(value)
        if found:
            self.nonfinite(name, found)
        q, s = quantize_block_fp8(value.float(), scale_format="e8m0")
        self.w.add(name, q)
        self.w.add(module + ".weight_scale", s.view(torch.float8_e8m0fnu))
        self.report.quantized.append(name)
        return "float8_e8m0fnu"

    def keep_fp8(self, name: str, scale: str) -> None:
        """FP8 block weight outside the experts: bytes kept, scale renamed ``.weight_scale``, described as FP8."""
        from vllm_dsv4_mtp.formats.quark_config import fp8_block_layer_config

        module = _module(name)
        self.fp8_layers[module] = fp8_block_layer_config(self.copy_fp8(name, scale))
        self.report.fp8_kept.append(module)

    # ------------------------------------------------------------------------------------------ dispatch
    def convert(self, name: str) -> None:
        info = self.r.info(name)
        if _scale_owner(self.r, name) is not None:
            return  # written together with its weight
        if not name.endswith(".weight"):
            self.copy(name)
            return
        scale = _scale_of(self.r, name)
        linear = _is_linear_weight(name, info.shape)
        if name.startswith("mtp.") and self.mtp == "amd":
            self.convert_mtp_amd(name, scale, linear)
            return
        if name.startswith("mtp."):
            self.to_bf16(name, scale)
            if linear:
                self.exclude.add(_module(name))
            return
        if ROUTED_EXPERT.match(name) or (SHARED_EXPERT.match(name) and self.shared_experts == "mxfp4"):
            self.to_mxfp4(name, scale)
            return
        if self.fp8_pair(name, scale):
            self.keep_fp8(name, scale)
            return
        if info.dtype in _PACKED_FP4 and scale is not None:
            raise QuantizeError(f"{self.where(name)}: packed FP4 storage is only expected for routed experts")
        if scale is not None:
            raise QuantizeError(
                f"{self.where(name)}: {info.dtype} weight has a scale tensor {scale}; only FP8 "
                f"(F8_E4M3) and FP4 (I8/U8) weights carry scales"
            )
        self.copy(name)
        if linear:
            self.exclude.add(_module(name))

    def convert_mtp_amd(self, name: str, scale: str | None, linear: bool) -> None:
        """``--mtp amd``: one MTP weight as AMD's export stores it (module docstring)."""
        from vllm_dsv4_mtp.formats.quark_config import fp8_block_layer_config, mxfp4_layer_config

        if MTP_ROUTED_EXPERT.match(name):
            self.to_mxfp4(name, scale)
            self.mtp_layers[MTP_ROUTED_PATTERN] = mxfp4_layer_config()
        elif MTP_SHARED_EXPERT.match(name):
            layer = fp8_block_layer_config(self.to_fp8_block(name, scale))
            if self.mtp_layers.setdefault(MTP_SHARED_PATTERN, layer) != layer:  # one declaration for w1/w2/w3
                raise QuantizeError(
                    f"{self.where(name)}: its FP8 scales are stored unlike the other shared-expert "
                    "weights' (F32 and E8M0 mixed); one Quark entry cannot describe both"
                )
        elif self.fp8_pair(name, scale):
            self.keep_fp8(name, scale)
        else:
            self.to_bf16(name, scale)  # BF16 copied; an FP4 weight outside the experts is not expected
            if linear:
                self.exclude.add(_module(name))


def _preflight(src: Path, allow_missing_mtp: bool, mtp: str = "bf16") -> list[str]:
    """Header-only check of SRC against its config.json (dsv4-mtp inspect). Errors stop the conversion."""
    from vllm_dsv4_mtp.tools.inspect_checkpoint import inspect_checkpoint

    report = inspect_checkpoint(src, allow_quantized_mtp=True)  # an official release's FP8 MTP is expected
    # no tokenizer: the output has none either (it copies the source's files); inspect says so for the output
    soft = {"tokenizer"} | ({"mtp-absent", "no-mtp"} if allow_missing_mtp else set())
    errors = [p for p in report.errors if p.code not in soft]
    if errors:
        shown = "\n  ".join(p.message for p in errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise QuantizeError(
            f"{src}: the source checkpoint has {len(errors)} problem(s) (dsv4-mtp inspect {src}):\n  {shown}{more}"
        )
    notes = [p for p in report.problems if p.severity == "warning" or p.code in soft]
    out: list[str] = []
    mtp_q = [p for p in notes if p.code == "mtp-quantized"]
    if mtp_q:  # the official release: expected, and handled (decoded to BF16, or --mtp amd's layout)
        what = "decoded to BF16" if mtp == "bf16" else "stored as AMD's export stores them"
        out.append(f"{src}: {len(mtp_q)} MTP weight(s) stored quantized (e.g. {mtp_q[0].tensor}); {what} in the output")
    rest = [p for p in notes if p.code != "mtp-quantized"]
    out += [p.message for p in rest[:10]]
    if len(rest) > 10:
        out.append(f"... and {len(rest) - 10} more (dsv4-mtp inspect {src})")
    return out


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise QuantizeError(f"{src}: source checkpoint directory not found")
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise QuantizeError(f"{dst}: the destination must not be the source, inside it, or contain it ({src})")
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"{dst}: exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise QuantizeError(f"{dst}: already exists and is not empty; pass --force to replace it")


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    shared_experts: str = "keep",
    force: bool = False,
    max_shard_bytes: int | None = None,
    progress: bool = True,
    check: bool = True,
    allow_missing_mtp: bool = False,
    mtp: str = "bf16",
) -> QuantizeReport:
    """Convert SRC (BF16, or the official FP8/FP4 release) into DST with Quark MXFP4 experts and a BF16 MTP
    (``mtp="amd"``: the MTP layer as AMD's export stores it, module docstring).

    ``shared_experts``: "keep" or "mxfp4". ``force``: replace an existing DST. ``max_shard_bytes``: output
    shard size (default: the largest source shard). ``check``: run ``dsv4-mtp inspect``'s header checks on SRC
    first (a missing MTP layer is an error unless ``allow_missing_mtp``). Returns a :class:`QuantizeReport`.
    """
    t0 = time.monotonic()
    if shared_experts not in SHARED_EXPERT_MODES:
        raise QuantizeError(f"shared_experts must be one of {SHARED_EXPERT_MODES}, got {shared_experts!r}")
    if mtp not in MTP_MODES:
        raise QuantizeError(f"mtp must be one of {MTP_MODES}, got {mtp!r}")
    src, dst = Path(src), Path(dst)
    swept = _sweep(dst)  # first: a previous output hidden by an interrupted run is put back before DST is judged
    _check_paths(src, dst, force)
    reader, cfg, spec = _open_source(src)
    report = QuantizeReport(
        src=str(src),
        dst=str(dst),
        source_quantization="fp8 (official)" if cfg.get("quantization_config") else "none",
        bytes_in=reader.total_bytes,
        shards_in=len(reader.shards),
        warnings=swept,
    )
    if check:
        report.warnings += _preflight(src, allow_missing_mtp, mtp)
    if spec.num_nextn_predict_layers and not any(n.startswith("mtp.") for n in reader):
        report.warnings.append(
            f"{src}: config declares {spec.num_nextn_predict_layers} MTP layer(s) but no "
            f"mtp.* tensors are stored; the output has no MTP draft either"
        )
    if max_shard_bytes is None:
        max_shard_bytes = max(p.stat().st_size for p in reader.shards)
    _check_space(reader, dst, shared_experts, mtp)
    crash_point("swept")
    with signals_interrupt():
        work, published = WorkDir(dst), False
        try:
            _write_output(
                reader,
                cfg,
                work.path,
                shared_experts=shared_experts,
                max_shard_bytes=max_shard_bytes,
                progress=progress,
                report=report,
                mtp=mtp,
            )
            sync_tree(work.path)
            crash_point("synced")
            with signals_deferred():  # an interrupt arriving now is raised once DST is the complete new output
                atomic = publish(work, dst)
                published = True
            if not atomic:
                report.warnings.append(
                    f"{dst.parent}: the filesystem cannot exchange directories atomically "
                    f"(renameat2 RENAME_EXCHANGE); DST was replaced in two renames"
                )
        except BaseException as e:
            discard(work, dst)
            if isinstance(e, OSError):
                raise QuantizeError(_io_error(e, work.path, dst)) from None
            if isinstance(e, KeyboardInterrupt):
                e.published = published  # for the CLI's message: was DST replaced before the interrupt?
            raise
        work.close()
    crash_point("done")
    report.seconds = time.monotonic() - t0
    return report


def _sweep(dst: Path) -> list[str]:
    """Leftovers of interrupted runs next to DST, dealt with (vllm_dsv4_mtp.quant.publish.sweep) and reported on
    stderr."""
    try:
        notes = sweep(dst)
    except Busy as e:
        raise QuantizeError(str(e)) from None
    except OSError as e:
        raise QuantizeError(
            f"{e.filename or dst.parent}: cannot clean up an earlier run's leftovers: {e.strerror}"
        ) from None
    for n in notes:  # at once, not only in the final report: the run may still fail afterwards
        print(f"dsv4-mtp quantize: {n}", file=sys.stderr)
    return notes


def _io_error(e: OSError, work: Path, dst: Path) -> str:
    """One line for an I/O error during the conversion: the file, the system's reason, what became of DST."""
    where = e.filename or work
    state = f"{dst} is unchanged" if dst.exists() else f"nothing was written to {dst}"
    hint = f"; free space on the filesystem of {dst.parent} or choose another DST" if e.errno == errno.ENOSPC else ""
    return f"{where}: {e.strerror or e} (the partial output was removed; {state}{hint})"


def _output_bytes(reader, shared_experts: str, mtp: str = "bf16") -> int:
    """About how many bytes the output's tensors take (never more than they will): experts become packed E2M1
    (1/2 byte per element) + E8M0 scales (1/32), a quantized MTP tensor becomes BF16 (``--mtp amd``: its
    experts MXFP4, its shared expert 1 byte per element), the rest is copied."""
    total = 0
    for name, info in reader.tensors.items():
        owner = _scale_owner(reader, name)
        if owner is not None and (_is_expert(owner, shared_experts, mtp) or owner.startswith("mtp.")):
            continue  # counted with its weight (or dropped)
        elements = info.numel * (2 if info.dtype in _PACKED_FP4 else 1)  # packed FP4 shapes count bytes
        if _is_expert(name, shared_experts, mtp):
            total += elements // 2 + elements // 32
        elif mtp == "amd" and MTP_SHARED_EXPERT.match(name):
            total += elements
        elif name.startswith("mtp.") and info.dtype not in _FLOAT and _scale_of(reader, name):
            total += elements * 2
        else:
            total += info.nbytes
    return total


def _is_expert(name: str, shared_experts: str, mtp: str = "bf16") -> bool:
    return bool(
        ROUTED_EXPERT.match(name)
        or (SHARED_EXPERT.match(name) and shared_experts == "mxfp4")
        or (MTP_ROUTED_EXPERT.match(name) and mtp == "amd")
    )


def _check_space(reader, dst: Path, shared_experts: str, mtp: str = "bf16") -> None:
    """Refuse up front when DST's filesystem cannot hold the output (rather than fail after writing most of it)."""
    need = _output_bytes(reader, shared_experts, mtp)
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if free < need:
        both = (
            " (the current DST stays in place until the new output is complete, so both must fit)"
            if dst.exists()
            else ""
        )
        raise QuantizeError(
            f"{dst.parent}: not enough free space for the output: it needs about "
            f"{need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free{both}"
        )


def _open_source(src: Path):
    """``(CheckpointReader, config.json dict, DeepseekV4Spec)`` of a BF16 or official-FP8 source; anything else
    (no config.json, an already-quantized Quark checkpoint, another quant_method) is refused."""
    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    reader = CheckpointReader(src)
    cfg = reader.config
    if cfg is None:
        raise QuantizeError(f"{src / 'config.json'}: missing (needed to validate and to write the Quark config)")
    spec = DeepseekV4Spec.from_dict(cfg, source=str(src / "config.json"))
    qc = cfg.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if qc is not None and method != "fp8":
        raise QuantizeError(
            f"{src / 'config.json'}: quantization_config.quant_method is {method!r}: "
            + (
                "the checkpoint is already Quark-quantized"
                if method == "quark"
                else "expected no quantization_config (BF16) or the official 'fp8' release"
            )
        )
    return reader, cfg, spec


def _write_output(
    reader,
    cfg: dict[str, Any],
    tmp: Path,
    *,
    shared_experts: str,
    max_shard_bytes: int,
    progress: bool,
    report: QuantizeReport,
    mtp: str = "bf16",
) -> None:
    """The whole converted checkpoint into TMP: tensors shard by shard, config.json with the Quark config, the
    other files of SRC; then read back (a valid checkpoint whose Quark config parses)."""
    from tqdm import tqdm

    from vllm_dsv4_mtp.formats.checkpoint import INDEX_FILE, CheckpointReader, CheckpointWriter
    from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig, mxfp4_experts_config

    writer = CheckpointWriter(tmp, max_shard_bytes=max_shard_bytes, always_index=reader.index_file is not None)
    conv = _Converter(reader, writer, shared_experts, report, mtp)
    done = 0
    with writer, tqdm(total=len(reader), unit="tensor", desc="quantize", disable=not progress, file=sys.stderr) as bar:
        for shard in reader.shards:
            bar.set_postfix_str(shard.name)
            for name in reader.shard_names(shard):
                conv.convert(name)
                crash_point(f"tensor:{done}")
                done += 1
                bar.update(1)
        out_cfg = dict(cfg)
        out_cfg["quantization_config"] = mxfp4_experts_config(
            sorted(conv.exclude), layer_quant_config={**conv.fp8_layers, **conv.mtp_layers}
        )
        if "expert_dtype" in out_cfg:
            out_cfg["expert_dtype"] = "fp4"  # the experts are now MXFP4
        writer.write_config(out_cfg)
    skip = {"config.json", INDEX_FILE}
    for f in sorted(reader.path.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copyfile(f, tmp / f.name)
    crash_point("written")
    out = CheckpointReader(tmp)
    QuarkQuantConfig.from_dict(out.config["quantization_config"], source=str(tmp / "config.json"))
    crash_point("verified")
    report.exclude = sorted(conv.exclude)
    report.bytes_out, report.shards_out = out.total_bytes, len(out.shards)
