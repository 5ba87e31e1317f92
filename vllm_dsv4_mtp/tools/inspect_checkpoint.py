"""Check a DeepSeek-V4 checkpoint against its ``config.json``: what is stored, in which precision, and
every problem.

:func:`inspect_checkpoint` reads only the safetensors headers (no tensor data) and returns an
:class:`InspectReport`: per module kind the storage precisions found (bf16 / fp8-block / mxfp4 /
fp4-official, plus f32 / int for the tensors that are never quantized), tensor and parameter counts, whether
the MTP layer is present and in which precision, and a list of :class:`Problem` (each names the tensor):

- a tensor missing, mis-shaped or in the wrong dtype against config.json;
- a scale missing, mis-shaped or in the wrong dtype for a quantized weight;
- an MTP layer absent, or stored quantized (a warning: the BF16 draft decodes it at load; an error under
  ``VLLM_DSV4_MTP_QUANTIZED_MTP=refuse``);
- a ``quantization_config`` that does not describe what is stored: quantized tensors it excludes or does not
  cover, BF16 linears it would quantize, quantized tensors with no config at all;
- tensors that are not part of the layout (e.g. a compressor on a sliding-window layer);
- with ``mtp=True`` ("I will serve this with an MTP speculative config"): no MTP layer declared is an error;
- with ``scan_values=True``: NaN / Inf values in any tensor (this reads every tensor's data, see
  :mod:`vllm_dsv4_mtp.formats.finite`; the default stays header-only).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from vllm_dsv4_mtp.config import (
    FP4_OFFICIAL_SCALE,
    FP8_SCALE,
    MXFP4_SCALE,
    ConfigError,
    DeepseekV4Spec,
    WeightSlot,
    fp8_block_scale_shape,
    mx_scale_shape,
    packed_fp4_shape,
    weight_slots,
)
from vllm_dsv4_mtp.formats.checkpoint import CheckpointError, CheckpointReader, tokenizer_problems
from vllm_dsv4_mtp.tools.inspect_report import KIND_LABELS, InspectReport, KindSummary, Problem

__all__ = ["Problem", "KindSummary", "InspectReport", "inspect_checkpoint", "KIND_LABELS"]

# stored dtype of a linear weight -> storage precision
_WEIGHT_PRECISION = {"BF16": "bf16", "F8_E4M3": "fp8-block", "U8": "mxfp4", "I8": "fp4-official"}
# storage precision of tensors that are never quantized
_PLAIN_PRECISION = {"BF16": "bf16", "F32": "f32", "I64": "int", "I32": "int"}
_QUANTIZED = ("fp8-block", "mxfp4", "fp4-official")


# ---------------------------------------------------------------------------------------------------------
def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


class _Inspector:
    def __init__(
        self,
        reader: CheckpointReader,
        spec: DeepseekV4Spec,
        report: InspectReport,
        allow_quantized_mtp: bool,
        for_mtp: bool = False,
    ):
        self.r = reader
        self.spec = spec
        self.report = report
        self.allow_quantized_mtp = allow_quantized_mtp
        self.for_mtp = for_mtp
        self.claimed: set[str] = set()
        self.stored_precision: dict[str, str] = {}  # slot name -> precision

    def problem(self, code: str, tensor: str | None, message: str, severity: str = "error") -> None:
        self.report.problems.append(Problem(severity, code, tensor, message))

    # ------------------------------------------------------------------ per tensor
    def check_plain(self, slot: WeightSlot) -> None:
        info = self.r.info(slot.name)
        if info.dtype not in slot.dtypes:
            self.problem("dtype", slot.name, f"{slot.name}: dtype {info.dtype}, expected {' or '.join(slot.dtypes)}")
        if info.shape != slot.shape:
            self.problem("shape", slot.name, f"{slot.name}: shape {_fmt(info.shape)}, expected {_fmt(slot.shape)}")
        self.record(slot, _PLAIN_PRECISION.get(info.dtype, info.dtype.lower()), [info.name])

    def check_linear(self, slot: WeightSlot) -> None:
        info = self.r.info(slot.name)
        precision = _WEIGHT_PRECISION.get(info.dtype)
        if precision is None:
            allowed = ", ".join(["BF16"] + [d for d, p in _WEIGHT_PRECISION.items() if p in slot.quantizable])
            self.problem("dtype", slot.name, f"{slot.name}: dtype {info.dtype}, expected one of {allowed}")
            self.record(slot, info.dtype.lower(), [slot.name])
            return
        if precision != "bf16" and precision not in slot.quantizable:
            self.problem(
                "precision",
                slot.name,
                f"{slot.name}: stored {precision}, which is not supported for "
                f"{KIND_LABELS[slot.kind]} (expected bf16" + "".join(f" or {p}" for p in slot.quantizable) + ")",
            )
        self.stored_precision[slot.name] = precision
        stored = [slot.name]
        if precision in ("bf16", "fp8-block"):
            want = slot.shape
        else:
            want = packed_fp4_shape(slot.shape)
        if info.shape != want:
            what = "" if want == slot.shape else f" (packed [out, in/2] of {_fmt(slot.shape)})"
            self.problem(
                "shape",
                slot.name,
                f"{slot.name}: shape {_fmt(info.shape)}, expected {_fmt(want)}{what} for {precision}",
            )
        if precision != "bf16":
            s = self.check_scale(slot, precision)
            if s:
                stored.append(s)
        self.record(slot, precision, stored)

    def check_scale(self, slot: WeightSlot, precision: str) -> str | None:
        module = slot.module
        candidates = [module + ".weight_scale", module + ".scale"]
        if precision == "fp4-official":
            candidates.reverse()
        present = [c for c in candidates if c in self.r]
        if not present:
            self.problem(
                "scale-missing",
                candidates[0],
                f"{candidates[0]}: missing: {slot.name} is stored {precision} and needs its scale "
                f"(neither {candidates[0]} nor {candidates[1]} is stored)",
            )
            return None
        name = present[0]
        if len(present) > 1:
            self.problem("unexpected", present[1], f"{present[1]}: second scale for {slot.name} (already has {name})")
            self.claimed.add(present[1])
        info = self.r.info(name)
        if precision == "fp8-block":
            shape, dtypes = fp8_block_scale_shape(slot.shape), FP8_SCALE
        else:
            shape = mx_scale_shape(slot.shape)
            dtypes = MXFP4_SCALE if precision == "mxfp4" else FP4_OFFICIAL_SCALE + ("U8",)
        if info.shape != shape:
            self.problem(
                "scale-shape",
                name,
                f"{name}: shape {_fmt(info.shape)}, expected {_fmt(shape)} "
                f"({precision} scale of {slot.name} {_fmt(slot.shape)})",
            )
        if info.dtype not in dtypes:
            self.problem(
                "scale-dtype",
                name,
                f"{name}: dtype {info.dtype}, expected {' or '.join(dtypes)} ({precision} scale of {slot.name})",
            )
        self.claimed.add(name)
        return name

    def record(self, slot: WeightSlot, precision: str, stored: list[str]) -> None:
        self.claimed.update(stored)
        kinds = self.report.mtp_kinds if slot.is_mtp else self.report.kinds
        kinds.setdefault(slot.kind, KindSummary()).add(
            precision, math.prod(slot.shape), len(stored), sum(self.r.info(n).nbytes for n in stored)
        )

    # ------------------------------------------------------------------ whole checkpoint
    def run(self) -> None:
        spec = self.spec
        slots = weight_slots(spec, mtp=True)
        mtp_missing: dict[str, list[WeightSlot]] = defaultdict(list)
        mtp_total: Counter = Counter()
        for slot in slots.values():
            layer = spec.layer_prefix(slot.layer)[:-1] if slot.is_mtp else None
            if layer:
                mtp_total[layer] += 1
            if slot.name not in self.r:
                if layer:
                    mtp_missing[layer].append(slot)
                else:
                    self.missing(slot)
                continue
            if slot.quantizable:
                self.check_linear(slot)
            else:
                self.check_plain(slot)
        self.check_mtp(mtp_missing, mtp_total)
        self.check_quant_config(slots)
        for name in self.r:
            if name not in self.claimed:
                info = self.r.info(name)
                self.problem(
                    "unexpected",
                    name,
                    f"{name}: unexpected tensor ({info.dtype} {_fmt(info.shape)}): {self.unexpected_reason(name)}",
                )

    def missing(self, slot: WeightSlot) -> None:
        self.problem(
            "missing",
            slot.name,
            f"{slot.name}: missing (expected {' or '.join(slot.dtypes)} {_fmt(slot.shape)}"
            + (", or a quantized form" if slot.quantizable else "")
            + ")",
        )

    def check_mtp(self, mtp_missing: dict[str, list[WeightSlot]], mtp_total: Counter) -> None:
        spec, rep = self.spec, self.report
        rep.mtp_layers_declared = spec.num_nextn_predict_layers
        if spec.num_nextn_predict_layers == 0:
            cfg = self.r.path / "config.json"
            if self.for_mtp:
                self.problem(
                    "no-mtp",
                    None,
                    f"{cfg}: num_nextn_predict_layers = 0: the checkpoint has no MTP layer, "
                    f"so it cannot be served with speculative_config method 'mtp' (vLLM 0.32 would stop "
                    f"with 'ZeroDivisionError: integer modulo by zero'); serve it without a speculative "
                    f"config",
                )
            else:
                self.problem(
                    "no-mtp",
                    None,
                    f"{cfg}: num_nextn_predict_layers = 0: the checkpoint declares no MTP "
                    f"layer, so MTP speculative decoding is unavailable",
                    "warning",
                )
            return
        for layer, total in mtp_total.items():
            missing = mtp_missing.get(layer, [])
            if len(missing) == total:
                self.problem(
                    "mtp-absent",
                    layer,
                    f"{layer}: MTP layer absent: config.json declares num_nextn_predict_layers = "
                    f"{spec.num_nextn_predict_layers} but no {layer}.* tensor is stored",
                )
                continue
            rep.mtp_layers_present.append(layer)
            for slot in missing:
                self.missing(slot)
        quantized = {n: p for n, p in self.stored_precision.items() if n.startswith("mtp.") and p in _QUANTIZED}
        if quantized and self.allow_quantized_mtp:  # the draft's default: decoded exactly to BF16 at load
            kinds = ", ".join(sorted(set(quantized.values())))
            self.problem(
                "mtp-quantized",
                None,
                f"{len(quantized)} MTP tensor(s) stored quantized ({kinds}); the plugin's BF16 MTP draft "
                "decodes them exactly to BF16 at load (VLLM_DSV4_MTP_QUANTIZED_MTP=refuse would refuse "
                "them)",
                "warning",
            )
        elif quantized:
            for name, precision in quantized.items():
                self.problem(
                    "mtp-quantized",
                    name,
                    f"{name}: MTP tensor stored {precision}, refused by VLLM_DSV4_MTP_QUANTIZED_MTP=refuse "
                    "(the draft runs in BF16; unset it to decode the MTP layer at load)",
                )

    def check_quant_config(self, slots: dict[str, WeightSlot]) -> None:
        """Does config.json's ``quantization_config`` describe what is stored? (none / official fp8 / Quark)"""
        rep = self.report
        qc = self.spec.quantization_config
        quantized = {n: p for n, p in self.stored_precision.items() if p in _QUANTIZED}
        if qc is None:
            rep.quantization = "none"
            for name, p in quantized.items():
                self.problem("quant-config", name, f"{name}: stored {p} but config.json has no quantization_config")
            return
        method = qc.get("quant_method")
        if method == "fp8":
            self.check_fp8_config(quantized)
        elif method == "quark":
            self.check_quark_config(qc, quantized, slots)
        else:
            rep.quantization = f"unsupported ({method!r})"
            self.problem(
                "quant-config",
                None,
                f"config.json: quantization_config.quant_method {method!r} is not "
                f"supported (expected 'quark' or 'fp8')",
            )

    def check_fp8_config(self, quantized: dict[str, str]) -> None:
        """The official release's ``quant_method: fp8``: FP8 blocks, plus official FP4 experts when
        ``expert_dtype`` is "fp4"; never the Quark MXFP4 layout."""
        self.report.quantization = "fp8 (official block FP8)"
        for name, p in quantized.items():
            if p == "mxfp4":
                self.problem(
                    "quant-config",
                    name,
                    f"{name}: stored mxfp4 (Quark layout) but quantization_config.quant_method is 'fp8', not 'quark'",
                )
            elif p == "fp4-official" and self.spec.official_expert_dtype != "fp4":
                self.problem(
                    "quant-config",
                    name,
                    f"{name}: stored fp4-official but config.json "
                    f"expert_dtype is {self.spec.expert_dtype!r}, not 'fp4' (absent means fp4)",
                )

    def check_quark_config(self, qc: dict[str, Any], quantized: dict[str, str], slots: dict[str, WeightSlot]) -> None:
        """Every stored linear (embedding and head aside) against the precision the Quark config declares."""
        from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

        rep = self.report
        try:
            q = QuarkQuantConfig.from_dict(qc, source=str(self.r.path / "config.json"))
        except ValueError as e:
            rep.quantization = "quark (invalid)"
            self.problem("quant-config", None, str(e))
            return
        found = sorted(set(quantized.values()))
        rep.quantization = "quark" + (f" ({', '.join(found)} stored)" if found else "")
        excluded_mtp: list[str] = []
        for name, slot in slots.items():
            if name not in self.r or not (name.endswith(".weight") and len(slot.shape) == 2):
                continue
            if slot.kind == "embed_head":
                continue  # embedding and LM head are not Quark-quantized linears
            module = slot.module
            excluded = q.is_excluded(module)
            try:
                wanted = None if excluded else q.spec_for(module)
            except ValueError as e:  # a scheme the project cannot serve: one message per distinct cause
                if str(e) not in rep.messages():
                    self.problem("quant-config", name, str(e))
                continue
            stored = self.stored_precision.get(name, "bf16")
            if excluded and name.startswith("mtp.") and stored == "mxfp4" and self.allow_quantized_mtp:
                excluded_mtp.append(name)  # see below: the draft reads the format from the tensors
                continue
            message = _quark_mismatch(name, module, stored, excluded, wanted)
            if message:
                self.problem("quant-config", name, message)
        if excluded_mtp:
            # the engine serves this: the plugin's draft never asks quantization_config about the MTP layer; it
            # takes the format from the stored weight and its scale and decodes it exactly to BF16
            self.problem(
                "quant-config",
                None,
                f"{len(excluded_mtp)} MTP tensor(s) stored mxfp4 although quantization_config excludes "
                f"them (e.g. '{excluded_mtp[0]}'): the plugin's BF16 MTP draft takes the format from the "
                f"stored tensors, not from quantization_config, and decodes them exactly to BF16, so the "
                f"engine serves it; vLLM's own quantized MTP (a stored-precision draft) would read them "
                f"as unquantized",
                "warning",
            )

    def unexpected_reason(self, name: str) -> str:
        spec = self.spec
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            lid = int(parts[1])
            if lid >= spec.num_hidden_layers:
                return f"layer {lid} is beyond num_hidden_layers = {spec.num_hidden_layers}"
            return self._layer_reason(lid, ".".join(parts[2:]), f"layer {lid}")
        if parts[0] == "mtp" and len(parts) > 1 and parts[1].isdigit():
            i = int(parts[1])
            if i >= spec.num_nextn_predict_layers:
                return f"MTP layer {i} is beyond num_nextn_predict_layers = {spec.num_nextn_predict_layers}"
            return self._layer_reason(spec.num_hidden_layers + i, ".".join(parts[2:]), f"MTP layer {i}")
        return "not part of the DeepSeek-V4 layout"

    def _layer_reason(self, lid: int, rest: str, what: str) -> str:
        spec = self.spec
        r = spec.compress_ratio(lid)
        if rest.startswith("attn.compressor.") and r == 0:
            return f"{what} is sliding-window only (compress ratio 0) and has no compressor"
        if rest.startswith("attn.indexer.") and not spec.has_indexer(lid):
            return f"{what} has compress ratio {r}; only ratio 4 layers have an indexer"
        if rest == "ffn.gate.tid2eid":
            return f"{what} is score-routed (num_hash_layers = {spec.num_hash_layers}); it has gate.bias, not tid2eid"
        if rest == "ffn.gate.bias":
            return f"{what} is hash-routed; it has gate.tid2eid, not gate.bias"
        if rest.startswith("ffn.experts."):
            e = rest.split(".")[2]
            if e.isdigit() and int(e) >= spec.n_routed_experts:
                return f"expert {e} is beyond n_routed_experts = {spec.n_routed_experts}"
        if rest.endswith((".scale", ".weight_scale")) and not rest.endswith("hc_head_scale"):
            return "a scale for a weight that is not stored quantized"
        return "not part of the DeepSeek-V4 layout"


def _quark_mismatch(name: str, module: str, stored: str, excluded: bool, wanted: str | None) -> str | None:
    """Why a tensor stored in precision ``stored`` contradicts its Quark entry (None when they agree)."""
    if stored not in _QUANTIZED:
        if wanted is None:
            return None
        return (
            f"{name}: stored {stored} but quantization_config quantizes '{module}' as {wanted} (it is not in exclude)"
        )
    if excluded:
        # Quark's exports keep excluded layers in the source checkpoint's format (AMD's MXFP4 export: its MTP
        # layer as the official release stores it, FP8 blocks and FP4 experts); only Quark's own MXFP4 is wrong
        if stored in ("fp8-block", "fp4-official"):
            return None
        return f"{name}: stored {stored} but quantization_config excludes '{module}'"
    if stored == "fp4-official":
        return (
            f"{name}: stored in the official FP4 layout (int8 + .scale) but quantization_config quantizes "
            f"'{module}' as {wanted}"
        )
    if wanted is None:
        return f"{name}: stored {stored} but no quantization_config spec covers '{module}'"
    if wanted != stored:
        return f"{name}: stored {stored} but quantization_config says {wanted} for '{module}'"
    return None


def inspect_checkpoint(
    path: str | Path, *, allow_quantized_mtp: bool | None = None, mtp: bool = False, scan_values: bool = False
) -> InspectReport:
    """Inspect a checkpoint directory. Never raises for a bad checkpoint: problems are reported.

    Headers only, unless ``scan_values`` (read every tensor for NaN / Inf: the whole checkpoint's bytes once,
    one tensor in memory at a time). ``mtp``: the checkpoint is meant for MTP speculative decoding, so a
    config without an MTP layer is an error, not a warning. ``allow_quantized_mtp``: whether a quantized MTP
    layer is acceptable (one warning) or an error per tensor; None follows the draft's own policy,
    ``VLLM_DSV4_MTP_QUANTIZED_MTP`` (default: decoded exactly to BF16 at load, allowed).
    """
    if allow_quantized_mtp is None:
        from vllm_dsv4_mtp.draft_policy import REFUSE, quantized_mtp_option

        allow_quantized_mtp = quantized_mtp_option() != REFUSE
    report = InspectReport(path=str(path), for_mtp=mtp)
    for message in tokenizer_problems(path):  # the engine's config parser says the same (startup_checks.py)
        report.problems.append(Problem("error", "tokenizer", None, message))
    try:
        reader = CheckpointReader(path)
    except CheckpointError as e:
        for message in [str(e)] + _other_shard_problems(Path(path), str(e)):
            report.problems.append(Problem("error", "checkpoint", None, message))
        return report
    report.n_tensors, report.n_shards, report.nbytes = len(reader), len(reader.shards), reader.total_bytes
    try:
        spec = DeepseekV4Spec.from_dir(path)
    except ConfigError as e:
        report.problems.append(Problem("error", "config", None, str(e)))
        return report
    sched = Counter(
        "SWA" if spec.compress_ratio(i) == 0 else f"C{spec.compress_ratio(i)}" for i in range(spec.num_hidden_layers)
    )
    report.config = {
        "num_hidden_layers": spec.num_hidden_layers,
        "schedule": ", ".join(f"{k} {v}" for k, v in sorted(sched.items(), key=lambda kv: kv[0])),
        "compress_ratios": list(spec.compress_ratios),
        "hidden_size": spec.hidden_size,
        "n_routed_experts": spec.n_routed_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "vocab_size": spec.vocab_size,
        "num_hash_layers": spec.num_hash_layers,
        "num_nextn_predict_layers": spec.num_nextn_predict_layers,
    }
    _Inspector(reader, spec, report, allow_quantized_mtp, mtp).run()
    if scan_values:
        scan_nonfinite(reader, report)
    return report


def _other_shard_problems(path: Path, first: str) -> list[str]:
    """The header problem of every other broken shard in the directory, so that one run names them all."""
    from vllm_dsv4_mtp.formats.checkpoint import read_safetensors_header

    out = []
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else []:
        try:
            read_safetensors_header(f)
        except CheckpointError as e:
            if str(e) != first:
                out.append(str(e))
    return out


def scan_nonfinite(reader: CheckpointReader, report: InspectReport) -> None:
    """Read every stored tensor and report those holding NaN / Inf (one tensor in memory at a time)."""
    import torch

    from vllm_dsv4_mtp.formats.finite import stored_nonfinite

    for name, info in reader.tensors.items():
        if not info.nbytes:
            continue
        found = stored_nonfinite(name, info.dtype, torch.frombuffer(reader.raw_buffer(name), dtype=torch.uint8))
        if found:
            report.problems.append(
                Problem("error", "nonfinite", name, f"{name}: non-finite values ({found}) in {info.file.name}")
            )
    report.values_scanned = True
