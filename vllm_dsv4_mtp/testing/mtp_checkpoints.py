"""Tiny DeepSeek-V4 checkpoints with a known MTP behaviour, for tests and benchmarks of the draft.

* :func:`scale_head` sharpens a random checkpoint's logits (greedy decoding becomes stable under rounding
  and batch-shape changes, so "MTP on == MTP off" can be asserted token for token).
* :func:`make_permutation_model` turns a random checkpoint into one whose behaviour is known in closed form:
  the target's next token is ``perm[current token]`` and, with ``agreeing_mtp=True``, the MTP layer predicts
  exactly what the target will say, so speculative decoding must accept (nearly) every draft.

How the permutation model works (every sub-layer writes zero into the residual streams: ``attn.wo_b``,
``ffn.experts.*.w2`` and ``ffn.shared_experts.w2`` are 0, so only hyper-connection mixing remains, and it
keeps all streams positive multiples of the input)::

    target:  X = repeat(embed[t]) -> streams a_i * embed[t] -> norm(hc_head(X)) = sqrt(D) * unit(embed[t])
             head[v] = alpha * unit(embed[perm^-1[v]])  =>  argmax = perm[t]  (cosine 1 vs ~N(0, 1/D))
    MTP:     h_proj = 0, e_proj = I, enorm = norm = 1  =>  X = repeat(enorm(embed[t+1])) -> same head
             =>  the draft at position p predicts perm[token at p+1] = the target's token at p+2.

Final and MTP norms are set to 1 so the argument holds exactly. With ``agreeing_mtp=False`` the MTP layer
keeps its random weights (acceptance near zero).
"""

from __future__ import annotations

from pathlib import Path

import torch


def rewrite_tensors(ckpt: str | Path, edit) -> None:
    """Apply ``edit(name, tensor) -> tensor | None`` to every tensor of a checkpoint's safetensors, in place."""
    from safetensors.torch import load_file, save_file

    files = sorted(Path(ckpt).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no *.safetensors files")
    for f in files:
        tensors = load_file(str(f))
        changed = False
        for name, t in list(tensors.items()):
            new = edit(name, t)
            if new is not None:
                if tuple(new.shape) != tuple(t.shape):
                    raise ValueError(f"{f}: {name}: edit changed the shape {tuple(t.shape)} -> {tuple(new.shape)}")
                tensors[name] = new.to(t.dtype).contiguous()
                changed = True
        if changed:
            save_file(tensors, str(f), metadata={"format": "pt"})


def scale_head(ckpt: str | Path, factor: float) -> None:
    """Multiply ``head.weight`` by ``factor`` in place (peaked logits; the argmax is unchanged)."""
    rewrite_tensors(ckpt, lambda name, t: t.float() * factor if name == "head.weight" else None)


def make_permutation_model(
    ckpt: str | Path, *, seed: int = 0, alpha: float = 3.0, agreeing_mtp: bool = True
) -> list[int]:
    """Rewrite a BF16 tiny checkpoint in place into the permutation model; returns ``perm`` (``perm[t]`` is the
    target's next token after ``t``)."""
    import json

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{ckpt}: make_permutation_model needs a BF16 checkpoint")
    vocab, d = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    embed = torch.randn(vocab, d, generator=g)
    unit = embed / embed.norm(dim=-1, keepdim=True)
    head = torch.empty(vocab, d)
    head[perm] = alpha * unit  # head[perm[t]] = alpha * unit(embed[t])

    def edit(name: str, t: torch.Tensor) -> torch.Tensor | None:
        in_mtp = name.startswith("mtp.")
        if name == "embed.weight":
            return embed
        if name == "head.weight":
            return head
        if name == "norm.weight":
            return torch.ones_like(t, dtype=torch.float32)
        if in_mtp and not agreeing_mtp:
            return None
        leaf = name.split(".", 2)[-1] if in_mtp else name
        if name.endswith((".attn.wo_b.weight", ".shared_experts.w2.weight")) or (
            ".ffn.experts." in name and name.endswith(".w2.weight")
        ):
            return torch.zeros_like(t, dtype=torch.float32)
        if in_mtp and leaf == "h_proj.weight":
            return torch.zeros_like(t, dtype=torch.float32)
        if in_mtp and leaf == "e_proj.weight":
            return torch.eye(d)
        if in_mtp and leaf in ("enorm.weight", "norm.weight"):
            return torch.ones_like(t, dtype=torch.float32)
        return None

    rewrite_tensors(ckpt, edit)
    return perm.tolist()


def permutation_chain(perm: list[int], start: int, n: int) -> list[int]:
    """The ``n`` tokens the permutation model generates after ``start``: perm[start], perm[perm[start]], ..."""
    out, t = [], start
    for _ in range(n):
        t = perm[t]
        out.append(t)
    return out


def engage_mtp(ckpt: str | Path, *, preact_std: float = 12.0) -> float:
    """Rewrite a BF16 tiny checkpoint's MTP experts in place so that their SwiGLU clamp engages.

    A random checkpoint's expert inputs (RMS-normalised) give pre-activations ``w1 x`` / ``w3 x`` with a standard
    deviation near the rows' norm, far below ``swiglu_limit`` (10), so a kernel that drops or misplaces the clamp
    computes the same numbers. Every MTP routed and shared expert's ``w1`` / ``w3`` is scaled so that its rows'
    mean norm is ``preact_std`` (12: about 30 % of the gate and up entries pass the limit); the down projections
    are divided by the gain squared (SwiGLU's growth), so the experts' outputs stay comparable to attention's and
    every part of the layer moves the result (measure with :func:`mtp_activity`). Returns the gain."""
    import json

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{ckpt}: engage_mtp needs a BF16 checkpoint")
    from safetensors import safe_open

    norms = []
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            norms += [
                h.get_tensor(n).float().norm(dim=1).mean().item()
                for n in h.keys()
                if n.startswith("mtp.") and ".ffn." in n and n.endswith((".w1.weight", ".w3.weight"))
            ]
    if not norms:
        raise ValueError(f"{ckpt}: no MTP expert weights")
    gain = preact_std / (sum(norms) / len(norms))

    def edit(name: str, t: torch.Tensor) -> torch.Tensor | None:
        if not (name.startswith("mtp.") and ".ffn." in name):
            return None
        if name.endswith((".w1.weight", ".w3.weight")):
            return t.float() * gain
        if name.endswith(".w2.weight"):
            return t.float() / gain**2
        return None

    rewrite_tensors(ckpt, edit)
    return gain


def mtp_activity(ref, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> dict[str, float]:
    """How much each part of the reference MTP layer (``reference.mtp.ReferenceMTP``) moves its output on these
    inputs, and how often the SwiGLU clamp engages: ``attention`` / ``routed`` / ``shared``: the RMS of each
    part's output over the RMS of the block's input streams; ``routed_clamped`` / ``shared_clamped``: the fraction
    of gate entries above ``swiglu_limit`` (up entries outside it count too)."""
    import torch.nn.functional as F

    block, limit = ref.block, ref.config.swiglu_limit
    out: dict[str, float] = {}
    clamp = {"routed": [0, 0], "shared": [0, 0]}

    def count(kind: str, gate: torch.Tensor, up: torch.Tensor) -> None:
        clamp[kind][0] += int((gate > limit).sum()) + int((up.abs() > limit).sum())
        clamp[kind][1] += gate.numel() + up.numel()

    def on_experts(module, args, output):
        x, top_k_index = args[0], args[1]
        for e in range(module.num_experts):
            rows = (top_k_index == e).any(-1)
            if rows.any():
                gate, up = F.linear(x[rows], module.gate_up_proj[e]).chunk(2, dim=-1)
                count("routed", gate, up)
        out["routed"] = output.float().pow(2).mean().sqrt().item()

    def on_shared(module, args, output):
        count("shared", module.gate_proj(args[0]), module.up_proj(args[0]))
        out["shared"] = output.float().pow(2).mean().sqrt().item()

    def on_attn(module, args, kwargs, output):
        out["attention"] = output[0].float().pow(2).mean().sqrt().item()

    def on_block(module, args, kwargs):
        out["input"] = (args[0] if args else kwargs["hidden_states"]).float().pow(2).mean().sqrt().item()

    handles = [
        block.mlp.experts.register_forward_hook(on_experts),
        block.mlp.shared_experts.register_forward_hook(on_shared),
        block.self_attn.register_forward_hook(on_attn, with_kwargs=True),
        block.register_forward_pre_hook(on_block, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            ref(hidden, ids, positions)
    finally:
        for h in handles:
            h.remove()
    scale = out.pop("input")
    result = {k: out[k] / scale for k in ("attention", "routed", "shared")}
    result.update({f"{k}_clamped": n / max(total, 1) for k, (n, total) in clamp.items()})
    return result
