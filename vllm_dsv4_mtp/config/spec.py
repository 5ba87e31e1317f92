"""DeepSeek-V4 model configuration: the fields of the HF-style ``config.json``, validated.

:class:`DeepseekV4Spec` is the one parsed, checked view of a DeepSeek-V4 ``config.json`` that the model, the
draft, the quantizer and ``dsv4-mtp inspect`` share. Every error names the file and the field.

No torch import here: this module is imported by ``--help`` paths and by vLLM's plugin loader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: HF transformers' names for the attention schedule (``layer_types``), keyed by how a ratio behaves.
LAYER_TYPE_NAMES = {
    "swa": "sliding_attention",
    "overlap": "compressed_sparse_attention",  # ratio 4: overlapping blocks + lightning indexer (CSA)
    "dense": "heavily_compressed_attention",  # any other ratio > 1: non-overlapping, all entries kept (HCA)
}

#: Module kinds, in report order. ``weight_slots`` tags every tensor with one of these.
MODULE_KINDS = (
    "attention",  # wq_a, wq_b, wkv, wo_a, wo_b (+ q_norm, kv_norm, attn_sink are listed as "norm_hc")
    "compressor",  # attn.compressor.*
    "indexer",  # attn.indexer.* (including its own compressor)
    "router",  # ffn.gate.*
    "routed_experts",  # ffn.experts.E.*
    "shared_experts",  # ffn.shared_experts.*
    "norm_hc",  # RMSNorm weights, hyper-connection tensors, attention sinks
    "embed_head",  # embed, head
    "mtp_proj",  # mtp.i.e_proj / h_proj
)

# The one overlapping compression ratio (REF: ``overlap = compress_ratio == 4``); it also carries the indexer.
OVERLAP_RATIO = 4
FP8_BLOCK = 128
MX_GROUP = 32


def blocks_per_entry(compress_ratio: int) -> int:
    """Blocks one compressed entry pools: 2 for the overlapping ratio (the previous block's rows and its own),
    else 1; also the channel multiplier of that compressor's ``wkv`` / ``wgate`` projections."""
    return 2 if compress_ratio == OVERLAP_RATIO else 1


class ConfigError(ValueError):
    """A DeepSeek-V4 ``config.json`` is malformed; the message names the file and the field."""


# ---------------------------------------------------------------------------------------------------------
# Field table: name -> (python types accepted, required, default)
# ---------------------------------------------------------------------------------------------------------
_INT = (int,)
_NUM = (int, float)
_BOOL = (bool,)
_STR = (str,)

_REQUIRED: dict[str, tuple[type, ...]] = {
    "vocab_size": _INT,
    "hidden_size": _INT,
    "num_hidden_layers": _INT,
    "num_attention_heads": _INT,
    "head_dim": _INT,
    "qk_rope_head_dim": _INT,
    "q_lora_rank": _INT,
    "o_lora_rank": _INT,
    "o_groups": _INT,
    "sliding_window": _INT,
    "compress_ratios": (list,),
    "compress_rope_theta": _NUM,  # REF's dataclass default (40000) differs from the configs (160000): require it
    "index_n_heads": _INT,
    "index_head_dim": _INT,
    "index_topk": _INT,
    "num_hash_layers": _INT,
    "n_routed_experts": _INT,
    "num_experts_per_tok": _INT,
    "n_shared_experts": _INT,
    "moe_intermediate_size": _INT,
    "routed_scaling_factor": _NUM,  # 1.5 Flash, 2.5 Pro: no default is safe
    "swiglu_limit": _NUM,
    "hc_mult": _INT,
    "num_nextn_predict_layers": _INT,
}

# Optional fields whose defaults are the values every released DeepSeek-V4 config carries.
_OPTIONAL: dict[str, tuple[tuple[type, ...], Any]] = {
    "rope_theta": (_NUM, 10000.0),
    "rope_scaling": ((dict, type(None)), None),
    "max_position_embeddings": (_INT, 1048576),
    "num_key_value_heads": (_INT, 1),
    "scoring_func": (_STR, "sqrtsoftplus"),
    "topk_method": (_STR, "noaux_tc"),
    "norm_topk_prob": (_BOOL, True),
    "hidden_act": (_STR, "silu"),
    "hc_sinkhorn_iters": (_INT, 20),
    "hc_eps": (_NUM, 1e-6),
    "rms_norm_eps": (_NUM, 1e-6),
    "tie_word_embeddings": (_BOOL, False),
    "expert_dtype": ((str, type(None)), None),
    "bos_token_id": ((int, type(None)), 0),
    "eos_token_id": ((int, list, type(None)), 1),
    "torch_dtype": ((str, type(None)), None),
    "quantization_config": ((dict, type(None)), None),
}

_SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


def _type_name(types: tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        bool: "true/false",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    if types == _NUM:
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check_type(source: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    ok = isinstance(value, types)
    # bool is an int subclass in Python; a JSON true is never a valid width or count.
    if ok and isinstance(value, bool) and bool not in types:
        ok = False
    if not ok:
        raise ConfigError(f"{source}: field '{name}' must be {_type_name(types)}, got {value!r}")


@dataclass(frozen=True)
class DeepseekV4Spec:
    """The validated DeepSeek-V4 configuration (HF-style ``config.json`` field names).

    Layer ids: ``0 .. num_hidden_layers-1`` are the main decoder layers (native prefix ``layers.N.``);
    ``num_hidden_layers + i`` is MTP layer ``i`` (native prefix ``mtp.i.``).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_hash_layers: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    num_nextn_predict_layers: int
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 1048576
    num_key_value_heads: int = 1
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    expert_dtype: str | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    torch_dtype: str | None = None
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)
    source: str = field(default="config.json", compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> DeepseekV4Spec:
        """Parse and validate a config dict; ``source`` (a file name) prefixes every error message."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for name, types in _REQUIRED.items():
            if name not in d:
                hint = ""
                if name == "compress_ratios" and "layer_types" in d:
                    hint = " (HF's 'layer_types' is not enough: the native per-layer 'compress_ratios' is required)"
                raise ConfigError(f"{source}: missing required field '{name}'{hint}")
            _check_type(source, name, d[name], types)
            kwargs[name] = d[name]
        for name, (types, default) in _OPTIONAL.items():
            if name in d:
                _check_type(source, name, d[name], types)
                kwargs[name] = d[name]
            else:
                kwargs[name] = default
        if "torch_dtype" not in d and isinstance(d.get("dtype"), str):
            kwargs["torch_dtype"] = d["dtype"]
        ratios = kwargs["compress_ratios"]
        for i, r in enumerate(ratios):
            if isinstance(r, bool) or not isinstance(r, int):
                raise ConfigError(f"{source}: field 'compress_ratios[{i}]' must be an integer, got {r!r}")
        kwargs["compress_ratios"] = tuple(ratios)
        for name in (
            "compress_rope_theta",
            "routed_scaling_factor",
            "swiglu_limit",
            "rope_theta",
            "hc_eps",
            "rms_norm_eps",
        ):
            kwargs[name] = float(kwargs[name])
        spec = cls(**kwargs, source=source)
        spec._validate(d)
        return spec

    @classmethod
    def from_dir(cls, path: str | Path) -> DeepseekV4Spec:
        """Read ``<path>/config.json`` (or ``path`` itself when it is a file)."""
        p = Path(path)
        f = p if p.is_file() else p / "config.json"
        if not f.is_file():
            raise ConfigError(f"{f}: config.json not found")
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f}: not valid JSON: {e}") from None
        return cls.from_dict(d, source=str(f))

    def _err(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}")

    def _validate(self, raw: Mapping[str, Any]) -> None:
        self._validate_ranges()
        self._validate_architecture()
        self._validate_schedule()
        if self.rope_scaling is not None:
            self._validate_rope_scaling()
        self._validate_hf_layer_types(raw)

    def _validate_ranges(self) -> None:
        """Each number on its own: counts and widths > 0, epsilons and thetas > 0."""
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "qk_rope_head_dim",
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "sliding_window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "hc_mult",
            "hc_sinkhorn_iters",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise self._err(f"field '{name}' must be > 0, got {getattr(self, name)}")
        for name in ("num_hash_layers", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise self._err(f"field '{name}' must be >= 0, got {getattr(self, name)}")
        for name in ("compress_rope_theta", "rope_theta", "routed_scaling_factor", "hc_eps", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise self._err(f"field '{name}' must be > 0, got {getattr(self, name)}")
        if self.swiglu_limit < 0:
            raise self._err(f"field 'swiglu_limit' must be >= 0 (0 disables the clamp), got {self.swiglu_limit}")

    def _validate_architecture(self) -> None:
        """Fields that must agree with each other, and the choices DeepSeek-V4 fixes (one KV head, one shared
        expert, noaux_tc routing, SiLU, untied head)."""
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= self.head_dim:
            raise self._err(
                f"field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be even and smaller than "
                f"'head_dim' ({self.head_dim}): the rope part is the last qk_rope_head_dim dims of a head"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise self._err(
                f"field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be <= 'index_head_dim' "
                f"({self.index_head_dim}): the indexer ropes its last qk_rope_head_dim dims"
            )
        if self.num_attention_heads % self.o_groups:
            raise self._err(
                f"field 'num_attention_heads' ({self.num_attention_heads}) must be divisible by "
                f"'o_groups' ({self.o_groups})"
            )
        if self.num_key_value_heads != 1:
            raise self._err(
                f"field 'num_key_value_heads' must be 1 (one shared latent KV), got {self.num_key_value_heads}"
            )
        if self.n_shared_experts != 1:
            raise self._err(
                f"field 'n_shared_experts' must be 1 (DeepSeek-V4 has exactly one shared expert), got "
                f"{self.n_shared_experts}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise self._err(
                f"field 'num_experts_per_tok' ({self.num_experts_per_tok}) must be <= "
                f"'n_routed_experts' ({self.n_routed_experts})"
            )
        if self.num_hash_layers > self.num_hidden_layers:
            raise self._err(
                f"field 'num_hash_layers' ({self.num_hash_layers}) must be <= 'num_hidden_layers' "
                f"({self.num_hidden_layers})"
            )
        if self.scoring_func not in _SCORING_FUNCS:
            raise self._err(f"field 'scoring_func' must be one of {list(_SCORING_FUNCS)}, got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise self._err(
                f"field 'topk_method' must be 'noaux_tc' (score-routed layers carry ffn.gate.bias, "
                f"used for selection only), got {self.topk_method!r}"
            )
        if self.hidden_act != "silu":
            raise self._err(f"field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.tie_word_embeddings:
            raise self._err(
                "field 'tie_word_embeddings' must be false: DeepSeek-V4 stores embed.weight and head.weight separately"
            )
        if self.expert_dtype is not None and self.expert_dtype not in ("fp4", "fp8", "bf16"):
            raise self._err(f"field 'expert_dtype' must be 'fp4', 'fp8' or 'bf16', got {self.expert_dtype!r}")

    def _validate_schedule(self) -> None:
        """``compress_ratios``: one entry per main layer then per MTP layer; MTP layers are sliding-window only."""
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_total:
            raise self._err(
                f"field 'compress_ratios' has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"num_nextn_predict_layers = {self.num_hidden_layers} + {self.num_nextn_predict_layers} = {n_total} "
                f"(one per main layer, then one per MTP layer)"
            )
        for i, r in enumerate(self.compress_ratios):
            if r < 0 or r == 1:
                raise self._err(
                    f"field 'compress_ratios[{i}]' = {r}: must be 0 (sliding window only) or a compression ratio >= 2"
                )
            if i >= self.num_hidden_layers and r != 0:
                raise self._err(
                    f"field 'compress_ratios[{i}]' = {r} belongs to MTP layer "
                    f"{i - self.num_hidden_layers}, which is sliding-window only: it must be 0"
                )

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise self._err(f"field 'rope_scaling.type' must be 'yarn' (YaRN on compressed layers), got {kind!r}")
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if key not in rs:
                raise self._err(f"missing required field 'rope_scaling.{key}'")
            v = rs[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise self._err(f"field 'rope_scaling.{key}' must be a number > 0, got {v!r}")
        attention_factor = rs.get("attention_factor", 1.0)
        if attention_factor not in (None, 1.0):  # DeepSeek-V4's YaRN scales frequencies only
            raise self._err(
                f"field 'rope_scaling.attention_factor' must be 1.0 for DeepSeek-V4, got {attention_factor!r}"
            )

    def _validate_hf_layer_types(self, raw: Mapping[str, Any]) -> None:
        """An HF ``layer_types`` / ``compress_rates`` next to ``compress_ratios`` must say the same thing."""
        lt = raw.get("layer_types")
        if lt is None:
            return
        if not isinstance(lt, list) or len(lt) != self.num_hidden_layers:
            raise self._err(
                f"field 'layer_types' must be a list of {self.num_hidden_layers} names (one per main layer), got {lt!r}"
            )
        rates = raw.get("compress_rates")
        if rates is None:  # HF's default rates
            rates = {LAYER_TYPE_NAMES["overlap"]: 4, LAYER_TYPE_NAMES["dense"]: 128}
        elif not isinstance(rates, Mapping):
            raise self._err(f"field 'compress_rates' must be an object (layer type -> rate), got {rates!r}")
        for i, name in enumerate(lt):
            want = self.hf_layer_type(i)
            r = self.compress_ratios[i]
            if name != want or (r > 1 and rates.get(name) != r):
                raise self._err(
                    f"field 'layer_types[{i}]' = {name!r} (rate {rates.get(name)}) disagrees with "
                    f"'compress_ratios[{i}]' = {r}"
                )

    # ------------------------------------------------------------------ layer schedule
    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def num_layers_total(self) -> int:
        """Main layers + MTP layers (the length of ``compress_ratios``)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_mtp_layer(self, layer_id: int) -> bool:
        return layer_id >= self.num_hidden_layers

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.num_layers_total:
            raise IndexError(f"layer_id {layer_id} out of range 0..{self.num_layers_total - 1}")

    def compress_ratio(self, layer_id: int) -> int:
        """0 = sliding window only; r >= 2 = window + compressed entries, one per r tokens.

        MTP layers (``layer_id >= num_hidden_layers``) are always 0 (SWA), as in REF and vLLM.
        """
        self._check_layer(layer_id)
        if self.is_mtp_layer(layer_id):
            return 0
        return self.compress_ratios[layer_id]

    def is_overlapping(self, layer_id: int) -> bool:
        """Ratio 4 compresses overlapping blocks (2r rows, two channel halves) and has the lightning indexer."""
        return self.compress_ratio(layer_id) == OVERLAP_RATIO

    def has_compressor(self, layer_id: int) -> bool:
        return self.compress_ratio(layer_id) > 1

    def has_indexer(self, layer_id: int) -> bool:
        return self.is_overlapping(layer_id)

    def compressor_blocks_per_entry(self, layer_id: int) -> int:
        """Channel multiplier of the compressor projections: 2 when overlapping, else 1."""
        return blocks_per_entry(self.compress_ratio(layer_id))

    def is_hash_layer(self, layer_id: int) -> bool:
        """Hash-routed MoE (``gate.tid2eid``, no bias): the first ``num_hash_layers`` main layers; never MTP."""
        self._check_layer(layer_id)
        return layer_id < self.num_hash_layers and not self.is_mtp_layer(layer_id)

    def hf_layer_type(self, layer_id: int) -> str:
        """HF transformers' ``layer_types`` name for a main layer."""
        r = self.compress_ratio(layer_id)
        if r == 0:
            return LAYER_TYPE_NAMES["swa"]
        return LAYER_TYPE_NAMES["overlap" if r == OVERLAP_RATIO else "dense"]

    def hf_layer_schedule(self) -> dict[str, Any]:
        """``layer_types`` + ``compress_rates`` for HF transformers' ``DeepseekV4Config``.

        HF maps the legacy ``compress_ratios`` through a fixed {0, 4, 128} table, so a config with other
        ratios (e.g. [0, 4, 8, 0] in tests) loads in HF only with these keys passed as config overrides:
        ``AutoConfig.from_pretrained(dir, **spec.hf_layer_schedule())``. HF has one rate per layer type, so
        all non-overlapping compressed layers must share one ratio.
        """
        dense = sorted({r for r in self.compress_ratios[: self.num_hidden_layers] if r > 1 and r != OVERLAP_RATIO})
        if len(dense) > 1:
            raise self._err(
                f"field 'compress_ratios': HF transformers supports one heavily-compressed ratio, "
                f"this config has {dense}"
            )
        return {
            "layer_types": [self.hf_layer_type(i) for i in range(self.num_hidden_layers)],
            "compress_rates": {
                LAYER_TYPE_NAMES["overlap"]: OVERLAP_RATIO,
                LAYER_TYPE_NAMES["dense"]: dense[0] if dense else 128,
            },
        }

    def layer_prefix(self, layer_id: int) -> str:
        """Native tensor-name prefix: ``layers.N.`` or ``mtp.i.``."""
        self._check_layer(layer_id)
        if self.is_mtp_layer(layer_id):
            return f"mtp.{layer_id - self.num_hidden_layers}."
        return f"layers.{layer_id}."

    # ------------------------------------------------------------------ derived widths
    @property
    def hc_mix(self) -> int:
        """Rows of ``hc_{attn,ffn}_fn``: pre (hc) + post (hc) + comb (hc*hc) = (2+hc)*hc."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def hc_dim(self) -> int:
        """Width of the flattened residual streams, hc_mult * hidden_size."""
        return self.hc_mult * self.hidden_size

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def o_group_in_dim(self) -> int:
        """Input width of one output-projection group: (heads/o_groups) * head_dim."""
        return self.heads_per_group * self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def official_expert_dtype(self) -> str:
        """Routed-expert storage of an official (``quant_method: fp8``) release: ``expert_dtype``, which the
        published Pro/Flash configs omit and vLLM then takes as "fp4" (only -Base releases say "fp8")."""
        return self.expert_dtype or "fp4"

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def to_dict(self) -> dict[str, Any]:
        """The config.json fields (native names), ``quantization_config`` included when set."""
        out: dict[str, Any] = {}
        for name in list(_REQUIRED) + list(_OPTIONAL):
            v = getattr(self, name)
            if name == "compress_ratios":
                v = list(v)
            if v is None and name in ("rope_scaling", "quantization_config", "expert_dtype", "torch_dtype"):
                continue
            out[name] = v
        return out
