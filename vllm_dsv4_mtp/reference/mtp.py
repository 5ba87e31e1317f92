"""Float32 reference of DeepSeek-V4's MTP layer, with vLLM's conventions.

The MTP block of https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/inference/model.py.

Written from the spec; the decoder block itself is transformers 5.19's public ``DeepseekV4DecoderLayer``
configured as a sliding-window (SWA), bias-routed MoE layer, so the maths of attention / MoE / mHC is an
oracle this project did not write. Used twice: as the MTP module trained in ``embedded/training/train.py`` and as
the standalone oracle the plugin's draft model is compared with.

One MTP step, for the token at position ``t`` (B = batch, T = tokens, hc = hc_mult, D = hidden)::

    e = enorm(embed[next_ids])            # [B, T, D]; zeroed where position == 0 (vLLM, inherited from V3)
    x = hnorm(H)                          # [B, T, hc, D]: H = target's last-layer streams BEFORE hc_head
    X = h_proj(x) + e_proj(e)[..., None, :]
    X = block(X)                          # hc_pre/SWA attention with sink/hc_post, hc_pre/MoE/hc_post
    logits = head(norm(hc_head(X)))       # predicts the token at t+2; head and embed are the target's

K > 1 re-applies the same layer: step k+1 takes step k's pre-``hc_head`` state ``X`` and the token just
drafted, at position + 1. Its attention sees what vLLM's MTP KV cache holds at that moment: step-1 entries
(computed from the target's states) for earlier positions and the later steps' own entries; this is what
:meth:`ReferenceMTP.draft` does with an HF cache, and :meth:`ReferenceMTP.forward` with ``context_kv``
reproduces for every position at once (used to train the recursion).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, DeepseekV4Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    eager_attention_forward,
)

from .names import block_native_to_hf, native_dtype

MTP_PREFIX = "mtp.0."
# the MTP layer's own tensors around its decoder block (native leaves under mtp.0.)
_MTP_OWN_LEAVES = (
    "e_proj.weight",
    "h_proj.weight",
    "enorm.weight",
    "hnorm.weight",
    "norm.weight",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
)
_ATTN_IMPL = "dsv4_reference_mtp"


def _mtp_attention(
    module, query, key, value, attention_mask, scaling, dropout=0.0, mtp_record_kv=None, mtp_context_kv=None, **kwargs
):
    """Eager attention with the sink (transformers' own), plus two hooks for the MTP recursion:
    ``mtp_record_kv`` (a list) receives this step's rope'd K=V ``[B, 1, T, d]``; ``mtp_context_kv`` is a
    ready ``(kv, mask)`` pair that replaces K=V and the mask (see :func:`recursion_context`)."""
    if mtp_record_kv is not None:
        mtp_record_kv.append(key)
    if mtp_context_kv is not None:
        ctx, attention_mask = mtp_context_kv
        key = value = torch.cat([ctx, key], dim=2)
    return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=dropout)


AttentionInterface.register(_ATTN_IMPL, _mtp_attention)


def sliding_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive mask ``[B, 1, Tq, Tk]``: key ``j`` visible to query ``i`` iff ``0 <= q_pos[i]-k_pos[j] < window``
    (the window ``{t-window+1 .. t}``, inclusive of ``t``)."""
    d = q_pos[:, :, None] - k_pos[:, None, :]
    ok = (d >= 0) & (d < window)
    return torch.zeros(ok.shape, dtype=torch.float32, device=q_pos.device).masked_fill(~ok, float("-inf"))[:, None]


def recursion_context(
    step_kvs: list[torch.Tensor], positions: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K=V and mask for recursion step ``k = len(step_kvs) + 1`` over all rows at once.

    Row ``i`` of every step belongs to base position ``t_i = positions[i]``; step ``m`` sits at position
    ``t_i + m - 1``. vLLM's MTP cache, when step ``k`` runs at ``t_i + k - 1``, holds step-1 entries for
    positions ``<= t_i`` (from rows ``j`` with ``t_j <= t_i``) and the entries steps ``2..k-1`` wrote for
    this row. So: step-1 block = causal sliding mask measured from the query position, later steps =
    the diagonal only, and the query's own entry (the diagonal of the current step, appended by
    :func:`_mtp_attention`).
    """
    k = len(step_kvs) + 1
    q_pos = positions + (k - 1)
    masks = [sliding_causal_mask(q_pos, positions, window)]
    # causal from t_i but measured from the query position: (q - t_j) < window and t_j <= t_i
    masks[0] = masks[0].masked_fill((positions[:, None, None, :] > positions[:, None, :, None]), float("-inf"))
    diag = torch.full(masks[0].shape, float("-inf"), dtype=torch.float32, device=positions.device)
    diag = diag.masked_fill(torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device), 0.0)
    masks += [diag] * (k - 1)  # steps 2..k-1, plus the current step's own entry
    return torch.cat(step_kvs, dim=2), torch.cat(masks, dim=-1)


def target_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run HF's ``DeepseekV4ForCausalLM`` on ``ids [B, L]``: logits ``[B, L, V]`` and the last layer's
    streams ``[B, L, hc, D]`` after its ``hc_post`` and before ``hc_head`` (what vLLM hands the MTP
    drafter), captured with a forward hook on the last decoder layer."""
    captured = []
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
    return logits, captured[0]


def mtp_block_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """The target's config narrowed to one SWA, bias-routed (non-hash) MoE layer: the MTP block."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["sliding_attention"]
    cfg.mlp_layer_types = ["moe"]
    cfg._attn_implementation = _ATTN_IMPL
    cfg._experts_implementation = "eager"  # the plain per-expert loop: the reference, not a fast kernel
    return cfg


class ReferenceMTP(nn.Module):
    """DeepSeek-V4's MTP layer in float32. ``embed`` / ``head`` are the target's modules (shared, not owned:
    they are not in this module's ``state_dict``)."""

    def __init__(self, config: DeepseekV4Config, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.config = mtp_block_config(config)
        d = config.hidden_size
        self.hc_mult = config.hc_mult
        self.window = config.sliding_window
        self.enorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = DeepseekV4DecoderLayer(self.config, layer_idx=0)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.norm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = DeepseekV4RotaryEmbedding(self.config)
        self._shared = (embed, head)  # a tuple keeps them out of parameters() / state_dict()

    @property
    def embed(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def head(self) -> nn.Linear:
        return self._shared[1]

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        past_key_values: DynamicCache | None = None,
        context_kv: list[torch.Tensor] | None = None,
        record_kv: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One MTP step.

        hidden_states: ``[B, T, hc, D]`` (or ``[T, hc, D]``): the target's pre-``hc_head`` streams at each
        position, or the previous step's returned state. next_ids: ``[B, T]``: the token one ahead of each
        position. positions: ``[B, T]``: the positions of this step's queries (contiguous per row).
        past_key_values: an HF cache of this layer (incremental drafting, see :meth:`draft`).
        context_kv / record_kv: recursion over all rows at once (see :func:`recursion_context`): K=V of
        the earlier steps, and a list that receives this step's K=V.
        Returns the pre-``hc_head`` state ``[B, T, hc, D]`` (feed :meth:`logits`, or the next step).
        """
        unbatched = hidden_states.dim() == 3
        if unbatched:
            hidden_states, next_ids, positions = hidden_states[None], next_ids[None], positions[None]
        if hidden_states.shape[-2] != self.hc_mult:
            raise ValueError(f"hidden_states must be [B, T, hc={self.hc_mult}, D], got {tuple(hidden_states.shape)}")
        e = self.embed(next_ids)
        e = e.masked_fill((positions == 0)[..., None], 0.0)  # vLLM zeroes the MTP input embedding at position 0
        x = self.h_proj(self.hnorm(hidden_states)) + self.e_proj(self.enorm(e))[..., None, :]

        if context_kv is not None:
            kv, mask = recursion_context(context_kv, positions - (len(context_kv)), self.window)
            attn_kwargs = {"attention_mask": None, "mtp_context_kv": (kv, mask)}
        else:
            n_old = 0  # entries the sliding cache still holds (it keeps the last window-1)
            if past_key_values is not None and past_key_values.layers[0].is_initialized:
                n_old = past_key_values.layers[0].keys.shape[-2]
            k_pos = torch.cat([positions[:, :1] - n_old + torch.arange(n_old, device=positions.device), positions], 1)
            attn_kwargs = {"attention_mask": sliding_causal_mask(positions, k_pos, self.window)}
        cos_sin = self.rotary_emb(x, position_ids=positions, layer_type="main")
        out = self.block(
            x,
            input_ids=next_ids,
            position_embeddings={"main": cos_sin},
            position_ids=positions,
            past_key_values=past_key_values,
            mtp_record_kv=record_kv,
            **attn_kwargs,
        )
        return out[0] if unbatched else out

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """``[..., hc, D]`` pre-``hc_head`` state -> ``[..., V]`` logits (the MTP's own hc_head and norm,
        the target's head)."""
        return self.head(self.norm(self.hc_head(state)))

    def forward_steps(self, target_hidden: torch.Tensor, ids: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """Teacher-forced recursion over whole sequences (training). target_hidden ``[B, L, hc, D]`` for
        ``ids [B, L]`` (positions 0..L-1). Step ``k`` (1-based) at row ``t`` reads ``ids[t+k]`` and predicts
        ``ids[t+k+1]``; returns per-step logits ``[B, L-k, V]`` (rows whose input token exists)."""
        B, L = ids.shape
        base = torch.arange(L, device=ids.device).expand(B, L)
        state, kvs, out = target_hidden, [], []
        for k in range(1, num_steps + 1):
            n = L - k
            rec: list[torch.Tensor] = []
            state = self(
                state[:, :n],
                ids[:, k : k + n],
                base[:, :n] + (k - 1),
                context_kv=[kv[:, :, :n] for kv in kvs] if kvs else None,
                record_kv=rec,
            )
            kvs.append(rec[0])
            out.append(self.logits(state))
        return out

    @torch.no_grad()
    def draft(self, target_hidden: torch.Tensor, ids: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Greedy drafting as vLLM does it, for one sequence: ``ids [n+1]`` = prompt plus the token the target
        just produced, ``target_hidden [n, hc, D]`` = the target's states at positions 0..n-1. Step 1 runs
        over every position (the catch-up that fills the MTP's own SWA cache); each later step runs one
        token at position +1 on its own previous state and its previous draft. Returns ``[num_steps]``."""
        cache = DynamicCache(config=self.config)
        n = target_hidden.shape[0]
        pos = torch.arange(n, device=ids.device)
        state = self(target_hidden[None], ids[None, 1 : n + 1], pos[None], past_key_values=cache)[:, -1:]
        drafts = []
        for k in range(num_steps):
            tok = self.logits(state)[0, -1].argmax()
            drafts.append(tok)
            if k + 1 < num_steps:
                state = self(state, tok.view(1, 1), torch.tensor([[n + k]], device=ids.device), past_key_values=cache)
        return torch.stack(drafts)

    # ------------------------------------------------------------------------------------------ weights

    def native_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's weights in native naming (``mtp.0.*``), float32 (no dtype policy applied)."""
        from .names import block_hf_to_native

        out = {
            MTP_PREFIX + "e_proj.weight": self.e_proj.weight,
            MTP_PREFIX + "h_proj.weight": self.h_proj.weight,
            MTP_PREFIX + "enorm.weight": self.enorm.weight,
            MTP_PREFIX + "hnorm.weight": self.hnorm.weight,
            MTP_PREFIX + "norm.weight": self.norm.weight,
            MTP_PREFIX + "hc_head_fn": self.hc_head.hc_fn,
            MTP_PREFIX + "hc_head_base": self.hc_head.hc_base,
            MTP_PREFIX + "hc_head_scale": self.hc_head.hc_scale,
        }
        out.update(block_hf_to_native(self.block.state_dict(), MTP_PREFIX))
        return {k: v.detach() for k, v in out.items()}

    def load_native(self, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Load ``mtp.0.*`` tensors (BF16/F32 as in the release; cast to float32). Every tensor of the layer
        must be present with the shape the config implies; a missing, mis-shaped, quantized or unexpected
        ``mtp.0.*`` tensor is a ValueError naming it and ``source``."""
        mine = {k: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)}
        if not mine:
            raise ValueError(f"{source}: no MTP weights ({MTP_PREFIX}*) found")
        expected = self.native_state_dict()
        missing = sorted(set(expected) - set(mine))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"{source}: missing MTP tensor {missing[0]!r}{more}")
        unexpected = sorted(set(mine) - set(expected))
        if unexpected:
            raise ValueError(
                f"{source}: unexpected MTP tensor {unexpected[0]!r} (the MTP layer is an SWA, "
                f"bias-routed block; quantized MTP weights are not accepted by the reference)"
            )
        for name, ref in expected.items():
            t = mine[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(ref.shape)}")
            if not (t.dtype.is_floating_point and t.element_size() >= 2):
                raise ValueError(
                    f"{source}: tensor {name!r} is {t.dtype}; the MTP layer must be BF16/F32 "
                    f"(expected {native_dtype(name)})"
                )
        with torch.no_grad():
            for attr, leaf in (
                ("e_proj", "e_proj.weight"),
                ("h_proj", "h_proj.weight"),
                ("enorm", "enorm.weight"),
                ("hnorm", "hnorm.weight"),
                ("norm", "norm.weight"),
            ):
                getattr(self, attr).weight.copy_(mine[MTP_PREFIX + leaf].float())
            self.hc_head.hc_fn.copy_(mine[MTP_PREFIX + "hc_head_fn"].float())
            self.hc_head.hc_base.copy_(mine[MTP_PREFIX + "hc_head_base"].float())
            self.hc_head.hc_scale.copy_(mine[MTP_PREFIX + "hc_head_scale"].float())
            own = {MTP_PREFIX + leaf for leaf in _MTP_OWN_LEAVES}
            block = block_native_to_hf(
                {k: v for k, v in mine.items() if k not in own}, MTP_PREFIX, self.config.n_routed_experts, source
            )
            self.block.load_state_dict({k: v.float() for k, v in block.items()}, strict=True)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> ReferenceMTP:
        """Build from a native-name checkpoint directory (config.json + safetensors): the MTP layer plus
        the target's ``embed.weight`` / ``head.weight`` it shares."""
        from safetensors import safe_open

        ckpt_dir = Path(ckpt_dir)
        config = DeepseekV4Config.from_dict(json.loads((ckpt_dir / "config.json").read_text()))
        tensors: dict[str, torch.Tensor] = {}
        files = sorted(ckpt_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors files")
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if name.startswith(MTP_PREFIX) or name in ("embed.weight", "head.weight"):
                        tensors[name] = sf.get_tensor(name)
        for shared in ("embed.weight", "head.weight"):
            if shared not in tensors:
                raise ValueError(f"{ckpt_dir}: missing tensor {shared!r} (the MTP layer shares it with the target)")
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            embed.weight.copy_(tensors["embed.weight"].float())
            head.weight.copy_(tensors["head.weight"].float())
        mtp = cls(config, embed, head)
        mtp.load_native(tensors, source=str(ckpt_dir))
        return mtp.eval()
