"""What ``dsv4-mtp inspect`` found: :class:`InspectReport` (per module kind, MTP, problems), printed as a table
or as JSON. Built by :func:`vllm_dsv4_mtp.tools.inspect_checkpoint.inspect_checkpoint`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "KindSummary", "InspectReport", "KIND_LABELS"]

KIND_LABELS = {
    "attention": "attention linears",
    "compressor": "compressor",
    "indexer": "indexer",
    "router": "router",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "norm_hc": "norms / hc / sinks",
    "embed_head": "embed / head",
    "mtp_proj": "MTP e_proj / h_proj",
}


@dataclass(frozen=True)
class Problem:
    """One finding. ``message`` starts with the tensor (or file / layer) it is about."""

    severity: str  # "error" | "warning"
    code: str  # missing | shape | dtype | precision | scale-missing | scale-shape | scale-dtype | mtp-absent |
    #            mtp-quantized | quant-config | unexpected | config | checkpoint | no-mtp | nonfinite
    tensor: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "tensor": self.tensor, "message": self.message}


@dataclass
class KindSummary:
    """Totals for one module kind (main model) or for the MTP layer(s)."""

    precisions: Counter = field(default_factory=Counter)  # precision -> number of logical tensors
    tensors: int = 0  # stored tensors (scales included)
    parameters: int = 0  # logical (unquantized) parameters of the tensors present
    nbytes: int = 0

    def add(self, precision: str, params: int, stored: int, nbytes: int) -> None:
        self.precisions[precision] += 1
        self.parameters += params
        self.tensors += stored
        self.nbytes += nbytes

    @property
    def precision(self) -> str:
        return ", ".join(p for p, _ in sorted(self.precisions.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "precisions": dict(self.precisions),
            "tensors": self.tensors,
            "parameters": self.parameters,
            "bytes": self.nbytes,
        }


@dataclass
class InspectReport:
    path: str
    config: dict[str, Any] = field(default_factory=dict)
    quantization: str = "none"
    kinds: dict[str, KindSummary] = field(default_factory=dict)  # main model (layers.* + model-level)
    mtp_kinds: dict[str, KindSummary] = field(default_factory=dict)  # mtp.* by module kind
    mtp_layers_declared: int = 0
    mtp_layers_present: list[str] = field(default_factory=list)
    n_tensors: int = 0
    n_shards: int = 0
    nbytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    values_scanned: bool = False  # every tensor's data read for NaN / Inf (scan_values)
    for_mtp: bool = False  # checked for serving with an MTP speculative config

    # ------------------------------------------------------------------ derived
    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def mtp(self) -> KindSummary:
        total = KindSummary()
        for k in self.mtp_kinds.values():
            total.precisions.update(k.precisions)
            total.tensors += k.tensors
            total.parameters += k.parameters
            total.nbytes += k.nbytes
        return total

    @property
    def mtp_precision(self) -> str:
        """Precision of the MTP layer's linear weights ("bf16", "mixed: ...", or "absent")."""
        if not self.mtp_layers_present:
            return "absent"
        lin = Counter()
        for s in self.mtp_kinds.values():
            for p, n in s.precisions.items():
                if p not in ("f32", "int"):
                    lin[p] += n
        if len(lin) == 1:
            return next(iter(lin))
        return "mixed: " + ", ".join(sorted(lin))

    @property
    def parameters(self) -> int:
        return sum(k.parameters for k in self.kinds.values()) + self.mtp.parameters

    def messages(self) -> list[str]:
        return [p.message for p in self.problems]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "config": self.config,
            "quantization": self.quantization,
            "tensors": self.n_tensors,
            "shards": self.n_shards,
            "bytes": self.nbytes,
            "parameters": self.parameters,
            "kinds": {k: v.to_dict() for k, v in self.kinds.items()},
            "mtp": {
                **self.mtp.to_dict(),
                "precision": self.mtp_precision,  # of its linear weights ("absent" when not stored)
                "declared_layers": self.mtp_layers_declared,
                "present_layers": self.mtp_layers_present,
                "kinds": {k: v.to_dict() for k, v in self.mtp_kinds.items()},
            },
            "values_scanned": self.values_scanned,
            "for_mtp": self.for_mtp,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "problems": [p.to_dict() for p in self.problems],
        }

    def format_table(self, max_per_code: int = 25) -> str:
        lines = [f"DeepSeek-V4 checkpoint {self.path}"]
        c = self.config
        if c:
            lines.append(
                f"  config: {c['num_hidden_layers']} layers ({c['schedule']}), hidden {c['hidden_size']}, "
                f"{c['n_routed_experts']} routed experts top-{c['num_experts_per_tok']}, "
                f"vocab {c['vocab_size']}, MTP layers {c['num_nextn_predict_layers']}"
            )
        lines.append(f"  quantization_config: {self.quantization}")
        lines.append(
            f"  stored: {self.n_tensors} tensors in {self.n_shards} shard(s), "
            f"{self.nbytes / 2**20:.1f} MiB; {self.parameters:,} parameters"
        )
        if self.kinds or self.mtp_kinds:
            lines.append("")
            lines.append(f"  {'module kind':<22} {'precision':<28} {'tensors':>8} {'parameters':>15}")
            for kind, label in KIND_LABELS.items():
                if kind in self.kinds:
                    s = self.kinds[kind]
                    lines.append(f"  {label:<22} {s.precision:<28} {s.tensors:>8} {s.parameters:>15,}")
            if self.mtp_layers_present:
                s = self.mtp
                name = "MTP (" + ", ".join(self.mtp_layers_present) + ")"
                lines.append(f"  {name:<22} {s.precision:<28} {s.tensors:>8} {s.parameters:>15,}")
        lines.append("")
        if self.mtp_layers_declared == 0:
            lines.append("  MTP: none declared")
        else:
            lines.append(
                f"  MTP: {self.mtp_precision}"
                + (f" ({', '.join(self.mtp_layers_present)})" if self.mtp_layers_present else "")
            )
        lines.append(
            "  values: "
            + (
                "scanned for NaN / Inf"
                if self.values_scanned
                else "not read (headers only; --scan-values reads every tensor for NaN / Inf)"
            )
        )
        lines.append(f"  problems: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        shown: Counter = Counter()
        hidden: Counter = Counter()
        for p in self.problems:
            if shown[p.code] >= max_per_code:
                hidden[p.code] += 1
                continue
            shown[p.code] += 1
            lines.append(f"  {p.severity.upper()}: {p.message}")
        for code, n in hidden.items():
            lines.append(f"  ... and {n} more '{code}' problem(s) (--json lists all)")
        return "\n".join(lines)
