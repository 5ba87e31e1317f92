"""The AMD Quark ``quantization_config`` of a checkpoint's ``config.json``: parse, match names, write.

Structure (Quark 0.13 ``QConfig.to_dict()`` plus the ``export`` block its exporters add)::

    {"global_quant_config": LAYER, "exclude": [names], "algo_config": null, "softmax_quant_spec": null,
     "quant_method": "quark", "layer_type_quant_config": {type: LAYER}, "layer_quant_config": {pattern: LAYER},
     "kv_cache_quant_config": {}, "kv_cache_post_rope": false, "quant_mode": "eager_mode", "version": "0.13",
     "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                "weight_format": "real_quantized", "weight_merge_groups": null}}
    LAYER = {"input_tensors": TENSOR|null, "output_tensors": TENSOR|null, "weight": TENSOR|null,
             "bias": TENSOR|null, "target_device": null}

Names are NATIVE DeepSeek-V4 module names (``layers.3.ffn.experts.7.w1``, ``mtp.0.e_proj``, ``head``), the
names the AMD export uses; vLLM maps them to its own at load time. A pattern (an ``exclude`` entry or a
``layer_quant_config`` key) matches a name when it is equal to it, or is an fnmatch glob (``*``, ``?``,
``[``) that matches it (Quark's own rule), or is ``re:<regex>`` and the regex matches at the start of the name
(``re.match``, vLLM's rule).
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

QUARK_VERSION = "0.13"
MX_GROUP = 32
FP8_BLOCK = [128, 128]

_LAYER_KEYS = ("input_tensors", "output_tensors", "weight", "bias")
_QSCHEMES = ("per_tensor", "per_channel", "per_group", "per_block")
_TENSOR_DTYPES = (
    "int2",
    "int3",
    "int4",
    "uint4",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_e5m3",
    "fp4",
    "fp6_e2m3",
    "fp6_e3m2",
    "mx",
    "mx6",
    "mx9",
    "bfp16",
    "bfloat16",
    "float16",
)
# Module-name suffixes of the tensors a module owns; `is_excluded` / `spec_for` accept tensor names too.
_TENSOR_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".weight", ".scale", ".bias")


class QuarkConfigError(ValueError):
    """A malformed Quark ``quantization_config``; the message names the file and the field."""


# ----------------------------------------------------------------------------------------------------------
# Tensor specs exactly as Quark 0.13 serialises them
# ----------------------------------------------------------------------------------------------------------


def _tensor_spec(**fields: Any) -> dict[str, Any]:
    """One Quark ``QTensorConfig.to_dict()``: every field, in Quark's order, defaults as Quark writes them."""
    spec = {
        "dtype": None,
        "is_dynamic": None,
        "qscheme": None,
        "ch_axis": None,
        "group_size": None,
        "block_size": None,
        "symmetric": None,
        "round_method": None,
        "scale_type": None,
        "zero_point_type": "int32",
        "scale_format": None,
        "scale_calculation_mode": None,
        "mx_element_dtype": None,
        "observer_cls": None,
        "is_scale_quant": False,
        "enable_buffer_reuse": False,
        "max_input_numel": 4194304,
    }
    unknown = set(fields) - set(spec)
    if unknown:
        raise KeyError(f"not Quark tensor-spec fields: {sorted(unknown)}")
    spec.update(fields)
    return spec


def ocp_mxfp4_spec(is_dynamic: bool) -> dict[str, Any]:
    """``OCP_MXFP4Spec(ch_axis=-1, is_dynamic=...)``: fp4 E2M1, groups of 32 along K, E8M0 "even" scales."""
    return _tensor_spec(
        dtype="fp4",
        is_dynamic=is_dynamic,
        qscheme="per_group",
        ch_axis=-1,
        group_size=MX_GROUP,
        round_method="half_even",
        scale_type="float",
        scale_format="e8m0",
        scale_calculation_mode="even",
        observer_cls="PerBlockMXObserver",
    )


def _layer(weight: dict | None, input_tensors: dict | None) -> dict[str, Any]:
    return {
        "input_tensors": input_tensors,
        "output_tensors": None,
        "weight": weight,
        "bias": None,
        "target_device": None,
    }


def mxfp4_layer_config() -> dict[str, Any]:
    """W4A4 OCP MXFP4: weights static MXFP4, activations dynamic MXFP4 (the AMD DeepSeek-V4 export)."""
    return _layer(ocp_mxfp4_spec(False), ocp_mxfp4_spec(True))


def fp8_block_layer_config(scale_type: str = "float8_e8m0fnu") -> dict[str, Any]:
    """FP8 e4m3 weights in 128x128 blocks with dynamic 1x128 activations, as Quark's file-to-file flow describes
    an FP8 layer it keeps from the source (``keep_excluded_layers_as_original_model_state=True``).
    ``scale_type``: "float8_e8m0fnu" (the DeepSeek-V4 release's ue8m0 scales) or "float32"."""
    weight = _tensor_spec(
        dtype="fp8_e4m3",
        is_dynamic=False,
        qscheme="per_block",
        block_size=list(FP8_BLOCK),
        symmetric=True,
        round_method="half_even",
        scale_type=scale_type,
        observer_cls="PerBlock2DMinMaxObserver",
    )
    inputs = _tensor_spec(
        dtype="fp8_e4m3",
        is_dynamic=True,
        qscheme="per_group",
        ch_axis=-1,
        group_size=FP8_BLOCK[1],
        symmetric=True,
        round_method="half_even",
        observer_cls="PerGroupMinMaxObserver",
    )
    return _layer(weight, inputs)


def mxfp4_experts_config(
    exclude: list[str], *, layer_quant_config: Mapping[str, dict] | None = None, version: str = QUARK_VERSION
) -> dict[str, Any]:
    """The ``quantization_config`` dict exactly as AMD Quark's export writes it for MXFP4 experts.

    Global scheme: weights static MXFP4, activations dynamic MXFP4, group 32, e8m0, "even", half_even
    (``LLMTemplate.get("deepseek_v4").get_config("mxfp4")``). ``exclude``: the native module names left
    unquantized (written sorted, as Quark resolves its patterns to exact names). ``layer_quant_config``:
    per-module overrides, e.g. :func:`fp8_block_layer_config` for FP8 layers kept from an FP8 source.
    """
    if isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude):
        raise TypeError("exclude must be a list of module-name strings")
    return {
        "global_quant_config": mxfp4_layer_config(),
        "exclude": sorted(exclude),
        "algo_config": None,
        "softmax_quant_spec": None,
        "quant_method": "quark",
        "layer_type_quant_config": {},
        "layer_quant_config": {k: copy.deepcopy(dict(v)) for k, v in (layer_quant_config or {}).items()},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "quant_mode": "eager_mode",
        "version": version,
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
    }


# ----------------------------------------------------------------------------------------------------------
# Matching
# ----------------------------------------------------------------------------------------------------------


def module_name(name: str) -> str:
    """``layers.3.ffn.experts.7.w1.weight_scale`` -> ``layers.3.ffn.experts.7.w1``; other names unchanged."""
    for suffix in _TENSOR_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def pattern_matches(pattern: str, name: str) -> bool:
    """Exact name, fnmatch glob, or ``re:`` regex matched at the start of ``name``."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern == name


def classify_weight_spec(weight: Any) -> str | None:
    """A Quark weight ``TENSOR`` spec -> "mxfp4" | "fp8-block" | None (None: no weight quantization).

    Raises :class:`ValueError` for schemes this project cannot serve (with the offending values)."""
    if weight is None:
        return None
    if isinstance(weight, list):  # one-entry lists are the same spec (multi-entry = two-level, e.g. NVFP4)
        if len(weight) != 1:
            raise ValueError(f"multi-entry weight spec (two-level scheme) is not supported: {weight!r}")
        weight = weight[0]
    dtype, qscheme = weight.get("dtype"), weight.get("qscheme")
    if dtype == "fp4" and qscheme == "per_group":
        if weight.get("group_size") != MX_GROUP or weight.get("scale_format") != "e8m0":
            raise ValueError(
                f"fp4 per_group weights need group_size {MX_GROUP} and scale_format 'e8m0' to be "
                f"OCP MXFP4, got group_size={weight.get('group_size')!r}, "
                f"scale_format={weight.get('scale_format')!r}"
            )
        return "mxfp4"
    if dtype == "fp8_e4m3" and qscheme == "per_block":
        if list(weight.get("block_size") or []) != FP8_BLOCK:
            raise ValueError(
                f"fp8_e4m3 per_block weights need block_size {FP8_BLOCK}, got {weight.get('block_size')!r}"
            )
        return "fp8-block"
    raise ValueError(f"weight scheme dtype={dtype!r} qscheme={qscheme!r} is not MXFP4 or FP8 128x128 blocks")


@dataclass
class QuarkQuantConfig:
    """A parsed, validated Quark ``quantization_config``. Build it with :meth:`from_dict`."""

    global_quant_config: dict[str, Any] | None
    layer_quant_config: dict[str, dict[str, Any]]
    layer_type_quant_config: dict[str, dict[str, Any]]
    exclude: list[str]
    export: dict[str, Any]
    raw: dict[str, Any] = field(repr=False)
    source: str = "config.json"

    # -------------------------------------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, d: Any, source: str = "config.json") -> QuarkQuantConfig:
        """Validate ``d`` (the ``quantization_config`` object); errors read
        ``<source>: quantization_config.<field>: ...``."""

        def err(path: str, msg: str) -> QuarkConfigError:
            return QuarkConfigError(f"{source}: quantization_config{'.' + path if path else ''}: {msg}")

        if not isinstance(d, Mapping):
            raise err("", f"expected an object, got {type(d).__name__}")
        if d.get("quant_method") != "quark":
            raise err("quant_method", f"expected 'quark', got {d.get('quant_method')!r}")
        export = d.get("export")
        if not isinstance(export, Mapping):
            raise err(
                "export",
                "missing (vLLM's QuarkConfig requires the export block)"
                if export is None
                else f"expected an object, got {type(export).__name__}",
            )
        if not isinstance(export.get("pack_method"), str):
            raise err("export.pack_method", f"expected a string, got {export.get('pack_method')!r}")
        if not isinstance(export.get("kv_cache_group", []), list):
            raise err("export.kv_cache_group", f"expected a list, got {export.get('kv_cache_group')!r}")

        global_cfg = d.get("global_quant_config")
        if global_cfg is not None:
            _check_layer(global_cfg, "global_quant_config", err)
        layer_cfg = _or_default(d, "layer_quant_config", {})
        if not isinstance(layer_cfg, Mapping):
            raise err("layer_quant_config", f"expected an object, got {type(layer_cfg).__name__}")
        for key, value in layer_cfg.items():
            _check_pattern(key, f"layer_quant_config[{key!r}]", err)
            _check_layer(value, f"layer_quant_config[{key!r}]", err)
        type_cfg = _or_default(d, "layer_type_quant_config", {})
        if not isinstance(type_cfg, Mapping):
            raise err("layer_type_quant_config", f"expected an object, got {type(type_cfg).__name__}")
        for key, value in type_cfg.items():
            _check_layer(value, f"layer_type_quant_config[{key!r}]", err)
        exclude = _or_default(d, "exclude", [])
        if not isinstance(exclude, list):
            raise err("exclude", f"expected a list of names, got {type(exclude).__name__}")
        for i, entry in enumerate(exclude):
            if not isinstance(entry, str):
                raise err(f"exclude[{i}]", f"expected a string, got {entry!r}")
            _check_pattern(entry, f"exclude[{i}]", err)
        return cls(
            global_quant_config=copy.deepcopy(dict(global_cfg)) if global_cfg is not None else None,
            layer_quant_config={k: copy.deepcopy(dict(v)) for k, v in layer_cfg.items()},
            layer_type_quant_config={k: copy.deepcopy(dict(v)) for k, v in type_cfg.items()},
            exclude=list(exclude),
            export=dict(export),
            raw=copy.deepcopy(dict(d)),
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The dict it was parsed from (a copy)."""
        return copy.deepcopy(self.raw)

    # -------------------------------------------------------------------------------------------- lookups
    def is_excluded(self, native_name: str) -> bool:
        """Is this module (or a tensor of it, e.g. ``...w1.weight``) listed in ``exclude``?"""
        names = {native_name, module_name(native_name)}
        return any(pattern_matches(p, n) for p in self.exclude for n in names)

    def layer_config_for(self, native_name: str) -> dict[str, Any] | None:
        """The LAYER config that applies: the first matching ``layer_quant_config`` key, else the global one.

        ``layer_type_quant_config`` is keyed by module class, which a checkpoint name does not carry; it is
        validated but not consulted here. Excluded names still get their config; see :meth:`spec_for`.
        """
        return self.layer_entry(native_name)[1]

    def layer_entry(self, native_name: str) -> tuple[str, dict[str, Any] | None]:
        """``(field path for messages, LAYER config)`` of :meth:`layer_config_for`."""
        mod = module_name(native_name)
        for pattern, cfg in self.layer_quant_config.items():
            if pattern_matches(pattern, mod) or pattern_matches(pattern, native_name):
                return f"layer_quant_config[{pattern!r}]", cfg
        return "global_quant_config", self.global_quant_config

    def spec_for(self, native_name: str) -> str | None:
        """Storage precision Quark declares for a module: "mxfp4" | "fp8-block" | None (unquantized/excluded)."""
        if self.is_excluded(native_name):
            return None
        path, cfg = self.layer_entry(native_name)
        if cfg is None:
            return None
        try:
            return classify_weight_spec(cfg.get("weight"))
        except ValueError as e:
            raise QuarkConfigError(
                f"{self.source}: quantization_config.{path}.weight (for {native_name}): {e}"
            ) from None


def _or_default(d: Mapping[str, Any], key: str, default: Any) -> Any:
    """``d[key]``, or ``default`` when absent or null (a present but wrong-typed value is kept, to be reported)."""
    value = d.get(key)
    return default if value is None else value


def _check_pattern(pattern: str, path: str, err) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise err(path, f"invalid regular expression {pattern[3:]!r}: {e}") from None


def _check_layer(cfg: Any, path: str, err) -> None:
    if not isinstance(cfg, Mapping):
        raise err(path, f"expected an object with {list(_LAYER_KEYS)}, got {type(cfg).__name__}")
    for key in _LAYER_KEYS:
        value = cfg.get(key)
        specs = value if isinstance(value, list) else [value]
        for i, spec in enumerate(specs):
            sub = f"{path}.{key}" + (f"[{i}]" if isinstance(value, list) else "")
            if spec is not None:
                _check_tensor_spec(spec, sub, err)


def _check_tensor_spec(spec: Any, path: str, err) -> None:
    if not isinstance(spec, Mapping):
        raise err(path, f"expected an object or null, got {type(spec).__name__}")
    dtype = spec.get("dtype")
    if dtype not in _TENSOR_DTYPES:
        raise err(f"{path}.dtype", f"unknown dtype {dtype!r}")
    qscheme = spec.get("qscheme")
    if qscheme is not None and qscheme not in _QSCHEMES:
        raise err(f"{path}.qscheme", f"expected one of {list(_QSCHEMES)}, got {qscheme!r}")
    if not isinstance(spec.get("is_dynamic", False), (bool, type(None))):
        raise err(f"{path}.is_dynamic", f"expected true/false, got {spec.get('is_dynamic')!r}")
    if qscheme == "per_group":
        g = spec.get("group_size")
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
            raise err(f"{path}.group_size", f"per_group needs a positive integer group_size, got {g!r}")
    if qscheme == "per_block":
        b = spec.get("block_size")
        if not (isinstance(b, list) and b and all(isinstance(x, int) and x > 0 for x in b)):
            raise err(f"{path}.block_size", f"per_block needs a list of positive block sizes, got {b!r}")
    ch_axis = spec.get("ch_axis")
    if ch_axis is not None and (not isinstance(ch_axis, int) or isinstance(ch_axis, bool)):
        raise err(f"{path}.ch_axis", f"expected an integer or null, got {ch_axis!r}")
    if (
        dtype == "fp4"
        and qscheme == "per_group"
        and spec.get("scale_format") == "e8m0"
        and spec.get("group_size") != MX_GROUP
    ):
        raise err(
            f"{path}.group_size",
            f"OCP MXFP4 (fp4, e8m0 scales) uses groups of {MX_GROUP}, got {spec.get('group_size')!r}",
        )
