"""What one ``dsv4-mtp quantize`` conversion did (:class:`QuantizeReport`, printed by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["QuantizeReport"]


@dataclass
class QuantizeReport:
    """What one conversion did."""

    src: str
    dst: str
    source_quantization: str  # "none" | "fp8 (official)"
    quantized: list[str] = field(default_factory=list)  # expert weights quantized to MXFP4 from float
    reencoded: list[str] = field(default_factory=list)  # official FP4 experts re-encoded losslessly
    requantized_fp8: list[str] = field(default_factory=list)  # FP8 experts decoded then quantized to MXFP4
    mtp_dequantized: list[str] = field(default_factory=list)  # MTP weights decoded to BF16
    fp8_kept: list[str] = field(default_factory=list)  # FP8 modules kept (layer_quant_config entries)
    copied: int = 0  # tensors copied byte for byte (renamed FP8 scales included)
    exclude: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    shards_in: int = 0
    shards_out: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [
            f"quantized {self.src} -> {self.dst} in {self.seconds:.1f} s",
            f"  source quantization: {self.source_quantization}",
            f"  routed/shared experts -> MXFP4: {len(self.quantized)} quantized from float, "
            f"{len(self.reencoded)} re-encoded losslessly from official FP4, "
            f"{len(self.requantized_fp8)} decoded from FP8 and quantized",
            f"  MTP weights decoded to BF16: {len(self.mtp_dequantized)}; FP8 modules kept: {len(self.fp8_kept)}",
            f"  copied byte for byte: {self.copied} tensors; exclude lists {len(self.exclude)} modules",
            f"  {self.bytes_in / 2**20:.1f} MiB in {self.shards_in} shard(s) -> "
            f"{self.bytes_out / 2**20:.1f} MiB in {self.shards_out} shard(s)",
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)
