"""The plugin's ``DeepseekV4ForCausalLM``: DeepSeek-V4 target model on vLLM's building blocks.

::

    X = repeat(embed[ids], hc)                        # [T, hc, D] residual streams
    for block in layers: X = block(positions, X, ids)
    H = X.flatten(1)                                  # [T, hc*D]: what the MTP draft consumes
    logits = head(norm(hc_head(X)))

The model runs eagerly: the class is deliberately not ``@support_torch_compile``-decorated (the portable
attention touches the paged cache from Python; see ``kernels/attention_core.py``). When a speculative config
that feeds hidden states to a drafter is present, the pre-``hc_head`` state ``H`` of the last step is kept in
a buffer returned by :meth:`DeepseekV4ForCausalLM.get_mtp_target_hidden_states`, as vLLM's in-tree model does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
from vllm_dsv4_mtp.formats.checkpoint import validate_shard_headers
from vllm_dsv4_mtp.model.decoder_layer import DeepseekV4DecoderLayer
from vllm_dsv4_mtp.model.hyper_connection import HyperHead
from vllm_dsv4_mtp.model.weights import Target, map_native_name

logger = init_logger("vllm.dsv4_mtp.model")


def spec_from_hf_config(hf_config) -> DeepseekV4Spec:
    """The validated :class:`DeepseekV4Spec` of vLLM's ``hf_config`` (errors name the config field)."""
    d = hf_config.to_dict()
    if d.get("rope_scaling") is None and isinstance(d.get("rope_parameters"), dict):
        rp = d["rope_parameters"]
        if rp.get("rope_type", rp.get("type")) == "yarn":
            d["rope_scaling"] = rp
    d.pop("layer_types", None)
    return DeepseekV4Spec.from_dict(d, source=f"{getattr(hf_config, 'name_or_path', '') or 'hf_config'}/config.json")


def routed_expert_quant(hf_config, layer_prefix: str) -> tuple[str, bool]:
    """``(format, activation_quant)`` of a layer's routed experts from the checkpoint's quantization config.

    * no quantization_config: ("bf16", False);
    * Quark (AMD export): "mxfp4" when the experts' weight spec is OCP MXFP4; activations are rounded to MXFP4
      (W4A4) when the matching ``input_tensors`` spec is FP4, else weight-only;
    * official FP8 release (``quant_method: fp8``) with ``expert_dtype: fp4``: "mxfp4" weight-only.
    """
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return "bf16", False
    method = qc.get("quant_method")
    name = f"{layer_prefix}ffn.experts.0.w1"
    if method == "quark":
        from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

        quark = QuarkQuantConfig.from_dict(qc, source="config.json:quantization_config")
        kind = quark.spec_for(name)
        if kind is None:
            return "bf16", False
        if kind != "mxfp4":
            raise ValueError(f"config.json:quantization_config: routed experts {name} are '{kind}'; the plugin "
                             "serves BF16 or MXFP4 routed experts")
        # W4A4 when the matching layer config rounds the experts' inputs to (dynamic) FP4, else weight-only
        inputs = (quark.layer_config_for(name) or {}).get("input_tensors") or {}
        return "mxfp4", inputs.get("dtype") == "fp4"
    if method in ("fp8", "deepseek_v4_fp8"):  # vLLM renames the official "fp8" for this architecture
        expert_dtype = getattr(hf_config, "expert_dtype", None)
        if expert_dtype == "fp4":
            return "mxfp4", False
        raise ValueError(f"config.json: FP8 routed experts (expert_dtype={expert_dtype!r}) are not supported; "
                         "the plugin serves BF16 or MXFP4 routed experts")
    raise ValueError(f"config.json:quantization_config.quant_method={method!r} is not supported "
                     "(expected 'quark' or 'fp8')")


def shared_expert_format(hf_config, layer_prefix: str) -> str:
    """Storage of a layer's shared expert: "mxfp4" when the Quark config quantizes it so (the AMD export's
    main layers), else "bf16" (BF16, or FP8 block-scaled decoded at load)."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc or qc.get("quant_method") != "quark":
        return "bf16"
    from vllm_dsv4_mtp.formats.quark_config import QuarkQuantConfig

    kind = QuarkQuantConfig.from_dict(qc, source="config.json:quantization_config").spec_for(
        f"{layer_prefix}ffn.shared_experts.w1")
    return "mxfp4" if kind == "mxfp4" else "bf16"


class DeepseekV4Model(nn.Module):
    """Embedding, decoder blocks, ``hc_head`` and final norm (native ``embed``, ``layers.*``, ``hc_head_*``,
    ``norm``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.spec = spec = spec_from_hf_config(config)
        self.hc_mult = spec.hc_mult
        self.hidden_size = spec.hidden_size
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, prefix=f"{prefix}.embed_tokens")
        layers = []
        for i in range(spec.num_hidden_layers):
            expert_format, act_quant = routed_expert_quant(config, spec.layer_prefix(i))
            layers.append(DeepseekV4DecoderLayer(
                vllm_config, compress_ratio=spec.compress_ratio(i), is_hash=spec.is_hash_layer(i),
                expert_format=expert_format, activation_quant=act_quant, prefix=f"{prefix}.layers.{i}",
                shared_format=shared_expert_format(config, spec.layer_prefix(i)),
            ))
        self.layers = nn.ModuleList(layers)
        self.hc_head = HyperHead(spec.hidden_size, spec.hc_mult, spec.hc_eps, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        # pre-hc_head residual streams for an MTP drafter, [max_num_batched_tokens, hc*D]
        self._mtp_hidden_buffer: torch.Tensor | None = None
        sc = vllm_config.speculative_config
        if sc is not None and (sc.use_eagle() or sc.uses_draft_model()):
            self._mtp_hidden_buffer = torch.zeros(
                vllm_config.scheduler_config.max_num_batched_tokens, spec.hc_mult * spec.hidden_size,
                dtype=vllm_config.model_config.dtype,
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> final hidden ``[T, D]`` (after ``hc_head`` and ``norm``)."""
        if input_ids is None:
            raise ValueError("DeepSeek-V4 needs input_ids (hash-routed MoE layers); inputs_embeds alone is not enough")
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = h.unsqueeze(1).repeat(1, self.hc_mult, 1)  # [T, hc, D]
        for layer in self.layers:
            x = layer(positions, x, input_ids)
        if self._mtp_hidden_buffer is not None:
            self._mtp_hidden_buffer[: x.shape[0]].copy_(x.flatten(1))
        return self.norm(self.hc_head(x))


class DeepseekV4ForCausalLM(nn.Module):
    """vLLM model class registered for architecture ``DeepseekV4ForCausalLM`` by the plugin."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        validate_shard_headers(vllm_config.model_config.model)  # a truncated/missing shard named before vLLM reads it
        self.config = vllm_config.model_config.hf_config
        self.vllm_config = vllm_config
        self.model = DeepseekV4Model(vllm_config=vllm_config, prefix="model")
        spec = self.model.spec
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(spec.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """The pre-``hc_head`` streams ``[max_num_batched_tokens, hc*D]`` of the last forward (rows ``[:T]``
        are valid), or None when no drafter consumes them."""
        return self.model._mtp_hidden_buffer

    def describe(self) -> dict:
        """What this instance runs (for logs and tests): class, per-layer attention / expert implementation."""
        layers = self.model.layers
        return {
            "class": f"{type(self).__module__}.{type(self).__name__}",
            "dtype": str(self.lm_head.weight.dtype),
            "attention": "portable",
            "compress_ratios": [layer.attn.compress_ratio for layer in layers],
            "hash_layers": [i for i, layer in enumerate(layers) if layer.ffn.gate.is_hash],
            "experts": [layer.ffn.experts_impl for layer in layers],
            "shared_experts": [layer.ffn.shared_experts.fmt for layer in layers],
            "expert_activation_quant": [getattr(layer.ffn.experts, "activation_quant", None) for layer in layers],
            "row_widths": [layer.attn.row_width for layer in layers],
            "cache_row_width": layers[0].attn.cache.cache_width,
            "mtp_hidden_buffer": None if self.model._mtp_hidden_buffer is None
            else list(self.model._mtp_hidden_buffer.shape),
        }

    def expert_bytes(self, layer: int, expert: int) -> dict:
        """The stored MXFP4 bytes of one routed expert, per native shard (``w1``/``w2``/``w3``) (for tests).

        Only for TP=1 portable MXFP4 experts; ``weight`` = packed E2M1, ``weight_scale`` = raw E8M0 bytes.
        """
        ex = self.model.layers[layer].ffn.experts
        i = ex.local_intermediate
        return {
            "w1": {"weight": ex.w13_weight[expert, :i].clone(), "weight_scale": ex.w13_weight_scale[expert, :i].clone()},
            "w3": {"weight": ex.w13_weight[expert, i:].clone(), "weight_scale": ex.w13_weight_scale[expert, i:].clone()},
            "w2": {"weight": ex.w2_weight[expert].clone(), "weight_scale": ex.w2_weight_scale[expert].clone()},
        }

    # ---------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load native-named tensors (see ``model/weights.py``); every tensor is loaded or skipped on purpose.

        Raises ``ValueError`` naming the tensor for an unknown, missing or mis-shaped tensor, an FP8 weight
        without its scale (or the reverse), or an expert tensor in an unexpected format.
        """
        return WeightLoader(self).load(weights)


class WeightLoader:
    """One pass over a checkpoint's tensors into a :class:`DeepseekV4ForCausalLM`."""

    def __init__(self, model: DeepseekV4ForCausalLM):
        self.model = model
        self.spec: DeepseekV4Spec = model.model.spec
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.slots = weight_slots(self.spec, mtp=False)
        self.seen: set[str] = set()
        self.loaded: set[str] = set()
        self.expert_scales_needed: set[str] = set()
        self.expert_scales_seen: set[str] = set()
        self.pending_fp8: dict[str, tuple] = {}  # native weight name -> (tensor | None, scale | None, target)
        self.skipped = 0

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.one(name, tensor)
        self.finish()
        return self.loaded

    def one(self, name: str, t: torch.Tensor) -> None:
        target = map_native_name(name, num_hidden_layers=self.spec.num_hidden_layers)
        if target.kind == "skip":
            self.skipped += 1
            return
        if target.kind == "expert":
            self._expert(name, target, t)
            return
        shared = self._mxfp4_shared_expert(name)
        if shared is not None:
            self._shared_mxfp4(name, shared, t)
            return
        if target.kind == "scale":
            weight_name = name.rsplit(".", 1)[0] + ".weight"
            self._fp8_part(weight_name, target, scale=t)
            return
        if t.dtype == torch.float8_e4m3fn:
            self._fp8_part(name, target, weight=t)
            return
        self._store(name, target, t)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise ValueError(f"{name}: unexpected tensor for this config (no such tensor in the DeepSeek-V4 layout)")
        if tuple(shape) != slot.shape:
            raise ValueError(f"{name}: expected shape {slot.shape}, got {tuple(shape)}")

    def _param(self, name: str, param_name: str) -> nn.Parameter:
        if param_name not in self.params:
            raise ValueError(f"{name}: maps to {param_name}, which this model does not have")
        return self.params[param_name]

    def _store(self, name: str, target, t: torch.Tensor) -> None:
        self._check_shape(name, t.shape)
        if name.endswith(".gate.tid2eid"):
            if int(t.min()) < 0 or int(t.max()) >= self.spec.n_routed_experts:
                raise ValueError(f"{name}: expert ids must lie in [0, {self.spec.n_routed_experts})")
        param = self._param(name, target.param)
        loader = getattr(param, "weight_loader", default_weight_loader)
        if target.shard is not None:
            loader(param, t.to(param.dtype), target.shard)
        else:
            loader(param, t if t.dtype == param.dtype else t.to(param.dtype))
        self.seen.add(name)
        self.loaded.add(target.param)

    def _fp8_part(self, weight_name: str, target, *, weight=None, scale=None) -> None:
        w, s, _ = self.pending_fp8.get(weight_name, (None, None, None))
        w = weight if weight is not None else w
        s = scale if scale is not None else s
        if w is None or s is None:
            self.pending_fp8[weight_name] = (w, s, target)
            return
        del self.pending_fp8[weight_name]
        from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

        self._check_shape(weight_name, w.shape)
        param = self._param(weight_name, target.param)
        decoded = dequantize_block_fp8(w, s, dtype=param.dtype)
        self._store(weight_name, Target("param", target.param, shard=target.shard), decoded)

    def _mxfp4_shared_expert(self, name: str):
        """The MXFP4 shared-expert module a native ``layers.N.ffn.shared_experts.*`` tensor belongs to, if any."""
        if ".ffn.shared_experts." not in name:
            return None
        module = self.modules.get("model." + name.split(".ffn.shared_experts.")[0] + ".ffn.shared_experts")
        return module if getattr(module, "fmt", None) == "mxfp4" else None

    def _shared_mxfp4(self, name: str, module, t: torch.Tensor) -> None:
        shard, part = name.rsplit(".", 2)[-2:]
        module.load(name, shard, part, t)
        if part == "weight":
            self.seen.add(name)
            self.expert_scales_needed.add(name)
        else:
            self.expert_scales_seen.add(name.rsplit(".", 1)[0] + ".weight")
        prefix = [k for k, v in self.modules.items() if v is module][0]
        self.loaded.update(f"{prefix}.{p}" for p, _ in module.named_parameters())

    def _expert(self, name: str, target, t: torch.Tensor) -> None:
        experts = self.modules.get(target.param)
        if experts is None or not hasattr(experts, "load"):
            raise ValueError(f"{name}: maps to {target.param}, which this model does not have")
        if target.expert >= self.spec.n_routed_experts:
            raise ValueError(f"{name}: expert {target.expert} >= n_routed_experts={self.spec.n_routed_experts}")
        experts.load(name, target.expert, target.shard, target.part, t)
        if target.part == "weight":
            self.seen.add(name)
            if t.dtype in (torch.uint8, torch.int8):
                self.expert_scales_needed.add(name)
        else:
            self.expert_scales_seen.add(name.rsplit(".", 1)[0] + ".weight")
        self.loaded.update(f"{target.param}.{p}" for p, _ in experts.named_parameters())

    def finish(self) -> None:
        if self.pending_fp8:
            name, (w, s, _) = next(iter(self.pending_fp8.items()))
            what = "its block scale (.scale / .weight_scale)" if s is None else "the FP8 weight"
            raise ValueError(f"{name}: {what} is missing from the checkpoint "
                             f"({len(self.pending_fp8)} FP8 tensor(s) unpaired)")
        no_scale = sorted(self.expert_scales_needed - self.expert_scales_seen)
        if no_scale:
            raise ValueError(f"{no_scale[0]}: MXFP4 expert weight without its E8M0 scale "
                             f"(.weight_scale / .scale); {len(no_scale)} such tensor(s)")
        missing = sorted(set(self.slots) - self.seen)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"{missing[0]}: tensor missing from the checkpoint{more}")
        logger.info("DeepSeek-V4 weights loaded: %d tensors (+%d mtp.* skipped: they belong to the draft)",
                    len(self.seen), self.skipped)
