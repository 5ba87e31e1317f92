"""DeepSeek-V4 model configuration: the fields of the HF-style ``config.json``, validated.

:class:`DeepseekV4Spec` is the one parsed, checked view of a DeepSeek-V4 ``config.json`` that the model, the
draft, the quantizer and ``dsv4-mtp inspect`` share. Every error names the file and the field.

:func:`expected_tensors` lists every tensor of the native DeepSeek release layout (``embed.weight``,
``layers.N.attn.wq_a.weight``, ``mtp.0.e_proj.weight``, ...) for a config, with shape and dtype, in a chosen
storage precision. :func:`weight_slots` is the precision-independent table it is built from: one row per
logical tensor, with its logical (unquantized) shape.

No torch import here: this module is imported by ``--help`` paths and by vLLM's plugin loader.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "ConfigError",
    "DeepseekV4Spec",
    "TensorExpectation",
    "WeightSlot",
    "weight_slots",
    "expected_tensors",
    "packed_fp4_shape",
    "mx_scale_shape",
    "fp8_block_scale_shape",
    "parameter_count",
    "quantized_expectations",
    "scale_name",
    "PRECISIONS",
    "LAYER_TYPE_NAMES",
    "MODULE_KINDS",
]

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
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
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
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "DeepseekV4Spec":
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
        for name in ("compress_rope_theta", "routed_scaling_factor", "swiglu_limit", "rope_theta", "hc_eps",
                     "rms_norm_eps"):
            kwargs[name] = float(kwargs[name])
        spec = cls(**kwargs, source=source)
        spec._validate(d)
        return spec

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "DeepseekV4Spec":
        """The spec of the config object vLLM hands a model.

        vLLM 0.32 passes its own ``DeepseekV4Config`` (the ``config.json`` fields as they are); vLLM 0.33
        passes transformers' ``DeepseekV4Config``, which rewrites the native schedule into ``layer_types`` +
        ``compress_rates`` (MTP layers dropped), ``num_hash_layers`` into ``mlp_layer_types``, YaRN into
        ``rope_parameters["compress"]``, and drops ``expert_dtype``. Both give the same spec.
        """
        d = dict(hf_config.to_dict())
        source = f"{getattr(hf_config, 'name_or_path', '') or 'hf_config'}/config.json"
        if "compress_ratios" in d:
            d.pop("layer_types", None)  # vLLM's copy may carry HF's names next to the native list
        else:
            d.update(_native_schedule(d, source))
        rp = d.get("rope_parameters")
        if d.get("rope_scaling") is None and isinstance(rp, Mapping):
            nested = rp.get("compress") if isinstance(rp.get("compress"), Mapping) else rp
            if nested.get("rope_type", nested.get("type")) == "yarn":
                d["rope_scaling"] = dict(nested)
            main = rp.get("main")
            if isinstance(main, Mapping) and "rope_theta" in main:
                d["rope_theta"] = main["rope_theta"]
        return cls.from_dict(d, source=source)

    @classmethod
    def from_dir(cls, path: str | Path) -> "DeepseekV4Spec":
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
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
                    "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
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
            raise self._err(f"field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be even and smaller than "
                            f"'head_dim' ({self.head_dim}): the rope part is the last qk_rope_head_dim dims of a head")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise self._err(f"field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be <= 'index_head_dim' "
                            f"({self.index_head_dim}): the indexer ropes its last qk_rope_head_dim dims")
        if self.num_attention_heads % self.o_groups:
            raise self._err(f"field 'num_attention_heads' ({self.num_attention_heads}) must be divisible by "
                            f"'o_groups' ({self.o_groups})")
        if self.num_key_value_heads != 1:
            raise self._err(f"field 'num_key_value_heads' must be 1 (one shared latent KV), got "
                            f"{self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            raise self._err(f"field 'n_shared_experts' must be 1 (DeepSeek-V4 has exactly one shared expert), got "
                            f"{self.n_shared_experts}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise self._err(f"field 'num_experts_per_tok' ({self.num_experts_per_tok}) must be <= "
                            f"'n_routed_experts' ({self.n_routed_experts})")
        if self.num_hash_layers > self.num_hidden_layers:
            raise self._err(f"field 'num_hash_layers' ({self.num_hash_layers}) must be <= 'num_hidden_layers' "
                            f"({self.num_hidden_layers})")
        if self.scoring_func not in _SCORING_FUNCS:
            raise self._err(f"field 'scoring_func' must be one of {list(_SCORING_FUNCS)}, got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise self._err(f"field 'topk_method' must be 'noaux_tc' (score-routed layers carry ffn.gate.bias, "
                            f"used for selection only), got {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise self._err(f"field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.tie_word_embeddings:
            raise self._err("field 'tie_word_embeddings' must be false: DeepSeek-V4 stores embed.weight and "
                            "head.weight separately")
        if self.expert_dtype is not None and self.expert_dtype not in ("fp4", "fp8", "bf16"):
            raise self._err(f"field 'expert_dtype' must be 'fp4', 'fp8' or 'bf16', got {self.expert_dtype!r}")

    def _validate_schedule(self) -> None:
        """``compress_ratios``: one entry per main layer then per MTP layer; MTP layers are sliding-window only."""
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_total:
            raise self._err(
                f"field 'compress_ratios' has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"num_nextn_predict_layers = {self.num_hidden_layers} + {self.num_nextn_predict_layers} = {n_total} "
                f"(one per main layer, then one per MTP layer)")
        for i, r in enumerate(self.compress_ratios):
            if r < 0 or r == 1:
                raise self._err(f"field 'compress_ratios[{i}]' = {r}: must be 0 (sliding window only) or a "
                                f"compression ratio >= 2")
            if i >= self.num_hidden_layers and r != 0:
                raise self._err(f"field 'compress_ratios[{i}]' = {r} belongs to MTP layer "
                                f"{i - self.num_hidden_layers}, which is sliding-window only: it must be 0")

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

    def _validate_hf_layer_types(self, raw: Mapping[str, Any]) -> None:
        """An HF ``layer_types`` / ``compress_rates`` next to ``compress_ratios`` must say the same thing."""
        lt = raw.get("layer_types")
        if lt is None:
            return
        if not isinstance(lt, list) or len(lt) != self.num_hidden_layers:
            raise self._err(f"field 'layer_types' must be a list of {self.num_hidden_layers} names (one per main "
                            f"layer), got {lt!r}")
        rates = raw.get("compress_rates")
        if rates is None:  # HF's default rates
            rates = {LAYER_TYPE_NAMES["overlap"]: 4, LAYER_TYPE_NAMES["dense"]: 128}
        elif not isinstance(rates, Mapping):
            raise self._err(f"field 'compress_rates' must be an object (layer type -> rate), got {rates!r}")
        for i, name in enumerate(lt):
            want = self.hf_layer_type(i)
            r = self.compress_ratios[i]
            if name != want or (r > 1 and rates.get(name) != r):
                raise self._err(f"field 'layer_types[{i}]' = {name!r} (rate {rates.get(name)}) disagrees with "
                                f"'compress_ratios[{i}]' = {r}")

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

    def compressor_coff(self, layer_id: int) -> int:
        """Channel multiplier of the compressor projections: 2 when overlapping, else 1."""
        return 2 if self.is_overlapping(layer_id) else 1

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
            raise self._err(f"field 'compress_ratios': HF transformers supports one heavily-compressed ratio, "
                            f"this config has {dense}")
        return {
            "layer_types": [self.hf_layer_type(i) for i in range(self.num_hidden_layers)],
            "compress_rates": {LAYER_TYPE_NAMES["overlap"]: OVERLAP_RATIO,
                               LAYER_TYPE_NAMES["dense"]: dense[0] if dense else 128},
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
        return self.head_dim ** -0.5

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


def _native_schedule(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``compress_ratios`` and ``num_hash_layers`` from transformers' ``layer_types`` / ``compress_rates`` /
    ``mlp_layer_types`` (MTP layers, which transformers drops, are sliding-window only)."""
    lt, rates = d.get("layer_types"), d.get("compress_rates")
    if not isinstance(lt, list) or not isinstance(rates, Mapping):
        raise ConfigError(f"{source}: missing required field 'compress_ratios' (nor HF's 'layer_types' + "
                          f"'compress_rates' to derive it from)")
    ratios = []
    for i, name in enumerate(lt):
        if name == LAYER_TYPE_NAMES["swa"]:
            ratios.append(0)
        elif name in rates:
            ratios.append(rates[name])
        else:
            raise ConfigError(f"{source}: field 'layer_types[{i}]' = {name!r} has no entry in 'compress_rates'")
    out: dict[str, Any] = {"compress_ratios": ratios + [0] * int(d.get("num_nextn_predict_layers") or 0)}
    mlp = d.get("mlp_layer_types")
    if "num_hash_layers" not in d and isinstance(mlp, list):
        n_hash = 0
        while n_hash < len(mlp) and mlp[n_hash] == "hash_moe":
            n_hash += 1
        if "hash_moe" in mlp[n_hash:]:
            raise ConfigError(f"{source}: field 'mlp_layer_types': hash-routed layers must come first, got {mlp}")
        out["num_hash_layers"] = n_hash
    return out


# ---------------------------------------------------------------------------------------------------------
# Tensor tables
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSlot:
    """One logical tensor of the native layout.

    ``shape`` is the logical (unquantized) shape. ``linear`` slots are ``[out, in]`` matrices of a linear layer
    and may be stored quantized (``quantizable`` lists the storage precisions the model accepts); the others
    are stored in exactly ``dtypes``.
    """

    name: str  # full tensor name, e.g. "layers.3.attn.wq_a.weight"
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # safetensors dtypes when stored unquantized
    kind: str  # one of MODULE_KINDS
    layer: int | None  # layer id (MTP layers >= num_hidden_layers), None for model-level tensors
    quantizable: tuple[str, ...] = ()  # storage precisions besides "bf16" for linear weights

    @property
    def module(self) -> str:
        """Module name (tensor name without ``.weight``)."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name

    @property
    def is_mtp(self) -> bool:
        return self.name.startswith("mtp.")


@dataclass(frozen=True)
class TensorExpectation:
    """What one stored tensor must look like: shape, accepted safetensors dtypes, module kind."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    kind: str
    role: str = "weight"  # "weight" | "scale"
    precision: str = "bf16"  # the precision of the weight this tensor belongs to


BF16 = ("BF16",)
F32 = ("F32",)
TID2EID = ("I64", "I32")
# Quantized storage: (weight dtypes, scale dtypes)
FP8_WEIGHT = ("F8_E4M3",)
FP8_SCALE = ("F8_E8M0", "U8", "F32")  # official ue8m0; a Quark export may store raw uint8; old FP8 used F32
MXFP4_WEIGHT = ("U8",)
MXFP4_SCALE = ("U8", "F8_E8M0")
FP4_OFFICIAL_WEIGHT = ("I8",)
FP4_OFFICIAL_SCALE = ("F8_E8M0",)

PRECISIONS = ("bf16", "fp8-block", "mxfp4", "fp4-official")

_ATTN_Q = ("fp8-block",)
_EXPERT_Q = ("fp8-block", "mxfp4", "fp4-official")
_SHARED_Q = ("fp8-block", "mxfp4")


def fp8_block_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))


def packed_fp4_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (out, inp // 2)


def mx_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (out, inp // MX_GROUP)


def weight_slots(spec: DeepseekV4Spec, *, mtp: bool = True) -> dict[str, WeightSlot]:
    """Every logical tensor of the native release layout, in file order (model-level, layers, MTP)."""
    D, V, hc = spec.hidden_size, spec.vocab_size, spec.hc_mult
    slots: dict[str, WeightSlot] = {}

    def add(name, shape, kind, layer, dtypes=BF16, quantizable=()):
        slots[name] = WeightSlot(name, tuple(int(s) for s in shape), dtypes, kind, layer, quantizable)

    add("embed.weight", (V, D), "embed_head", None)
    for lid in range(spec.num_hidden_layers):
        _block_slots(spec, lid, add)
    add("norm.weight", (D,), "norm_hc", None)
    add("head.weight", (V, D), "embed_head", None)
    add("hc_head_fn", (hc, hc * D), "norm_hc", None, F32)
    add("hc_head_base", (hc,), "norm_hc", None, F32)
    add("hc_head_scale", (1,), "norm_hc", None, F32)
    if mtp:
        for i in range(spec.num_nextn_predict_layers):
            lid = spec.num_hidden_layers + i
            p = spec.layer_prefix(lid)
            add(p + "e_proj.weight", (D, D), "mtp_proj", lid, quantizable=_ATTN_Q)
            add(p + "h_proj.weight", (D, D), "mtp_proj", lid, quantizable=_ATTN_Q)
            add(p + "enorm.weight", (D,), "norm_hc", lid)
            add(p + "hnorm.weight", (D,), "norm_hc", lid)
            _block_slots(spec, lid, add)
            add(p + "norm.weight", (D,), "norm_hc", lid)
            add(p + "hc_head_fn", (hc, hc * D), "norm_hc", lid, F32)
            add(p + "hc_head_base", (hc,), "norm_hc", lid, F32)
            add(p + "hc_head_scale", (1,), "norm_hc", lid, F32)
    return slots


def _block_slots(spec: DeepseekV4Spec, lid: int, add) -> None:
    """One decoder block (main layer or the MTP layer's block) in the native naming."""
    D, hc, H, hd = spec.hidden_size, spec.hc_mult, spec.num_attention_heads, spec.head_dim
    p = spec.layer_prefix(lid)
    add(p + "attn_norm.weight", (D,), "norm_hc", lid)
    add(p + "ffn_norm.weight", (D,), "norm_hc", lid)
    for site in ("attn", "ffn"):
        add(f"{p}hc_{site}_fn", (spec.hc_mix, hc * D), "norm_hc", lid, F32)
        add(f"{p}hc_{site}_base", (spec.hc_mix,), "norm_hc", lid, F32)
        add(f"{p}hc_{site}_scale", (3,), "norm_hc", lid, F32)
    a = p + "attn."
    add(a + "attn_sink", (H,), "norm_hc", lid, F32)
    add(a + "wq_a.weight", (spec.q_lora_rank, D), "attention", lid, quantizable=_ATTN_Q)
    add(a + "q_norm.weight", (spec.q_lora_rank,), "norm_hc", lid)
    add(a + "wq_b.weight", (H * hd, spec.q_lora_rank), "attention", lid, quantizable=_ATTN_Q)
    add(a + "wkv.weight", (hd, D), "attention", lid, quantizable=_ATTN_Q)
    add(a + "kv_norm.weight", (hd,), "norm_hc", lid)
    add(a + "wo_a.weight", (spec.o_groups * spec.o_lora_rank, spec.o_group_in_dim), "attention", lid,
        quantizable=_ATTN_Q)
    add(a + "wo_b.weight", (D, spec.o_groups * spec.o_lora_rank), "attention", lid, quantizable=_ATTN_Q)
    r = spec.compress_ratio(lid)
    if r > 1:
        coff = spec.compressor_coff(lid)
        _compressor_slots(a + "compressor.", r, coff, hd, D, "compressor", lid, add)
    if spec.has_indexer(lid):
        ix = a + "indexer."
        nI, dI = spec.index_n_heads, spec.index_head_dim
        add(ix + "wq_b.weight", (nI * dI, spec.q_lora_rank), "indexer", lid, quantizable=_ATTN_Q)
        add(ix + "weights_proj.weight", (nI, D), "indexer", lid)
        _compressor_slots(ix + "compressor.", r, 2, dI, D, "indexer", lid, add)
    f = p + "ffn."
    E, I = spec.n_routed_experts, spec.moe_intermediate_size
    add(f + "gate.weight", (E, D), "router", lid)
    if spec.is_hash_layer(lid):
        add(f + "gate.tid2eid", (spec.vocab_size, spec.num_experts_per_tok), "router", lid, TID2EID)
    else:
        add(f + "gate.bias", (E,), "router", lid, F32)
    for e in range(E):
        add(f"{f}experts.{e}.w1.weight", (I, D), "routed_experts", lid, quantizable=_EXPERT_Q)
        add(f"{f}experts.{e}.w2.weight", (D, I), "routed_experts", lid, quantizable=_EXPERT_Q)
        add(f"{f}experts.{e}.w3.weight", (I, D), "routed_experts", lid, quantizable=_EXPERT_Q)
    Is = spec.shared_intermediate_size
    add(f + "shared_experts.w1.weight", (Is, D), "shared_experts", lid, quantizable=_SHARED_Q)
    add(f + "shared_experts.w2.weight", (D, Is), "shared_experts", lid, quantizable=_SHARED_Q)
    add(f + "shared_experts.w3.weight", (Is, D), "shared_experts", lid, quantizable=_SHARED_Q)


def _compressor_slots(c: str, ratio: int, coff: int, hd: int, D: int, kind: str, lid: int, add) -> None:
    add(c + "ape", (ratio, coff * hd), kind, lid, F32)
    add(c + "wkv.weight", (coff * hd, D), kind, lid)
    add(c + "wgate.weight", (coff * hd, D), kind, lid)
    add(c + "norm.weight", (hd,), kind, lid)


def scale_name(weight_name: str, precision: str) -> str:
    """Name of the scale tensor that goes with a quantized ``<module>.weight``.

    Quark exports (mxfp4, and fp8 in a Quark checkpoint) use ``<module>.weight_scale``; the official DeepSeek
    release (fp4-official, and fp8-block there) uses ``<module>.scale``.
    """
    module = weight_name[: -len(".weight")]
    return module + (".weight_scale" if precision in ("mxfp4", "fp8-quark") else ".scale")


def quantized_expectations(slot: WeightSlot, precision: str) -> dict[str, TensorExpectation]:
    """The stored tensors for one linear weight in a storage precision.

    ``precision``: "bf16", "fp8-block" (official ``.scale``), "fp8-quark" (``.weight_scale``), "mxfp4" (Quark:
    uint8 packed + uint8 E8M0 ``.weight_scale``) or "fp4-official" (int8 packed + F8_E8M0 ``.scale``).
    """
    kind = slot.kind
    if precision == "bf16":
        return {slot.name: TensorExpectation(slot.shape, slot.dtypes, kind)}
    if precision in ("fp8-block", "fp8-quark"):
        return {
            slot.name: TensorExpectation(slot.shape, FP8_WEIGHT, kind, "weight", "fp8-block"),
            scale_name(slot.name, precision): TensorExpectation(
                fp8_block_scale_shape(slot.shape), FP8_SCALE, kind, "scale", "fp8-block"),
        }
    if precision in ("mxfp4", "fp4-official"):
        if slot.shape[1] % MX_GROUP:
            raise ValueError(f"{slot.name}: input width {slot.shape[1]} is not a multiple of {MX_GROUP}; "
                             f"it cannot be stored as {precision}")
        wd, sd = (MXFP4_WEIGHT, MXFP4_SCALE) if precision == "mxfp4" else (FP4_OFFICIAL_WEIGHT, FP4_OFFICIAL_SCALE)
        return {
            slot.name: TensorExpectation(packed_fp4_shape(slot.shape), wd, kind, "weight", precision),
            scale_name(slot.name, precision): TensorExpectation(mx_scale_shape(slot.shape), sd, kind, "scale",
                                                                precision),
        }
    raise ValueError(f"unknown storage precision {precision!r}")


def expected_tensors(
    spec: DeepseekV4Spec,
    experts: str = "bf16",
    *,
    mtp: bool = True,
    linears: str = "bf16",
    shared_experts: str | None = None,
    mtp_experts: str | None = None,
    mtp_linears: str | None = None,
) -> dict[str, TensorExpectation]:
    """Every stored tensor of the native release layout: ``{name: TensorExpectation(shape, dtypes, kind)}``.

    experts: routed-expert storage, "bf16" | "mxfp4" (Quark: ``.weight`` U8 ``[out, in/2]`` + ``.weight_scale``
        U8 E8M0 ``[out, in/32]``) | "fp4-official" (``.weight`` I8 packed + ``.scale`` F8_E8M0) | "fp8-block".
    linears: attention projections, ``indexer.wq_b``, ``e_proj``/``h_proj`` and shared experts: "bf16" | "fp8"
        (F8_E4M3 ``[out, in]`` + a 128x128 block scale: ``.scale`` in the official layout, ``.weight_scale``
        when the experts are Quark "mxfp4").
    shared_experts: override for the shared experts ("bf16" | "fp8" | "mxfp4"; default: same as ``linears``).
    mtp_experts / mtp_linears: the MTP layer's precision (default: same as the main layers).
    mtp: include the ``mtp.*`` tensors.
    """
    quark = experts == "mxfp4"

    def lin(p: str) -> str:
        if p == "fp8":
            return "fp8-quark" if quark else "fp8-block"
        if p in ("bf16", "mxfp4"):
            return p
        raise ValueError(f"linears/shared_experts must be 'bf16', 'fp8' (or 'mxfp4' for shared), got {p!r}")

    if experts not in ("bf16", "mxfp4", "fp4-official", "fp8-block"):
        raise ValueError(f"experts must be 'bf16', 'mxfp4', 'fp4-official' or 'fp8-block', got {experts!r}")
    out: dict[str, TensorExpectation] = {}
    for slot in weight_slots(spec, mtp=mtp).values():
        if not slot.quantizable:
            out[slot.name] = TensorExpectation(slot.shape, slot.dtypes, slot.kind)
            continue
        in_mtp = slot.is_mtp
        if slot.kind == "routed_experts":
            p = (mtp_experts or experts) if in_mtp else experts
            if p == "fp8-block" and quark:
                p = "fp8-quark"
        elif slot.kind == "shared_experts":
            p = lin((mtp_linears or shared_experts or linears) if in_mtp else (shared_experts or linears))
        else:
            p = lin((mtp_linears or linears) if in_mtp else linears)
        out.update(quantized_expectations(slot, p))
    return out


def parameter_count(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)
