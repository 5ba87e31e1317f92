"""Train the embedded tiny DeepSeek-V4 (target + MTP layer) on CPU, then export it.

The target is HF transformers' ``DeepseekV4ForCausalLM`` (every V4 feature: mHC, SWA / C4 with indexer /
C128 attention, a hash-routed and bias-routed MoE layers); the MTP layer is
:class:`vllm_dsv4_mtp.reference.mtp.ReferenceMTP`, trained jointly (DeepSeek-V3 style: its loss flows into
the shared trunk, embedding and head) on the token after next, and on the recursion step K=2 exactly as
vLLM drafts it. Data: few-shot-packed sequences of synthetic GSM8K-style problems (``embedded/data.py``) in
lm-eval's ``Question: ...\\nAnswer: ...`` layout, long enough (512 tokens) that the 128-token window wraps
and the C128 compressor emits entries.

    python -m vllm_dsv4_mtp.embedded.training.train --seed 0 --steps 1500 --out /tmp/dsv4-train

writes ``state.pt`` there every ``--save-every`` steps (``--resume`` continues from it) and, at the end,
the native BF16 checkpoint into ``--export`` (default ``embedded/assets/tiny-dsv4-bf16``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ...reference.mtp import target_forward
from .. import ASSETS_DIR, BF16_CHECKPOINT_DIR
from .. import data as gsm
from .export import export_checkpoint
from .recipe import MODEL_CONFIG, build_models


class BiasBalancer:
    """DeepSeek's auxiliary-loss-free load balancing: after each step, every bias-routed gate's
    ``e_score_correction_bias`` moves by ``rate`` towards under-loaded experts (selection only; the
    routing weights still come from the unbiased scores)."""

    def __init__(self, gates: list, rate: float = 1e-3):
        self.gates, self.rate = gates, rate
        self.counts = {id(g): torch.zeros(g.num_experts) for g in gates}
        self.handles = [g.register_forward_hook(self._hook) for g in gates]

    def _hook(self, gate, args, out):
        idx = out[2]
        self.counts[id(gate)] += torch.bincount(idx.reshape(-1).detach(), minlength=gate.num_experts).float()

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; returns the worst max/mean load ratio seen since the last step."""
        worst = 0.0
        for g in self.gates:
            c = self.counts[id(g)]
            if c.sum() > 0:
                worst = max(worst, (c.max() / c.mean()).item())
                g.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            c.zero_()
        return worst


def packed_sequences(tok, seed: int, seq_len: int, n_problems: int) -> Iterator[list[int]]:
    """Endless stream of ``seq_len + 0`` token sequences: BOS then whole problems in lm-eval's layout joined by
    ``\\n\\n`` (so the model sees 0..k-shot contexts), cut at ``seq_len``."""
    train, _ = gsm.make_splits(seed, n_train=n_problems)
    encoded = [tok.encode(gsm.format_example(p) + "\n\n", add_special_tokens=False).ids for p in train]
    rng = random.Random(seed + 7)
    while True:
        seq = [0]
        while len(seq) < seq_len:
            seq += encoded[rng.randrange(len(encoded))]
        yield seq[:seq_len]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_state(path: Path, model, mtp, opt, step: int, args) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "mtp": mtp.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "args": vars(args),
            "config": MODEL_CONFIG,
        },
        tmp,
    )
    tmp.replace(path)  # never leave a half-written state behind


def load_tokenizer(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Train the embedded tiny DeepSeek-V4 with its MTP layer (CPU).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="loss weight of MTP step 1 (step 2 gets half)")
    ap.add_argument("--mtp-steps", type=int, default=2, help="recursion steps the MTP is trained on")
    ap.add_argument("--n-problems", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="working dir: state.pt and log")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", type=Path, default=BF16_CHECKPOINT_DIR)
    ap.add_argument("--assets", type=Path, default=ASSETS_DIR, help="where data.py wrote the tokenizer")
    ap.add_argument("--no-export", action="store_true")
    return ap


def _optimizer(params: list, lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )


def _resume(state_path: Path, model, mtp, opt) -> int:
    """Load a saved state; returns the step it was saved at."""
    st = torch.load(state_path, weights_only=False)
    model.load_state_dict(st["model"])
    mtp.load_state_dict(st["mtp"])
    opt.load_state_dict(st["opt"])
    print(f"resumed from {state_path} at step {st['step']}", flush=True)
    return st["step"]


def _losses(model, mtp, ids: torch.Tensor, mtp_steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Next-token loss of the target and, per MTP recursion step k, the loss of predicting ``ids[t+k+1]``."""
    logits, hidden = target_forward(model, ids)
    loss_main = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    mtp_losses = []
    for k, lg in enumerate(mtp.forward_steps(hidden, ids, mtp_steps), start=1):
        # step k at row t predicts ids[t+k+1]; the last row has no target
        mtp_losses.append(F.cross_entropy(lg[:, :-1].flatten(0, 1), ids[:, k + 1 :].flatten()))
    return loss_main, mtp_losses


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.assets / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        gsm.build_assets(args.assets, seed=args.seed)
    tok = load_tokenizer(tok_dir)
    if tok.get_vocab_size() > MODEL_CONFIG["vocab_size"]:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {MODEL_CONFIG['vocab_size']}")

    model, mtp = build_models(MODEL_CONFIG, args.seed)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = _optimizer(params, args.lr)
    state_path = args.out / "state.pt"
    start = _resume(state_path, model, mtp, opt) if args.resume and state_path.exists() else 0
    gates = [l.mlp.gate for l in model.model.layers if not l.mlp.is_hash] + [mtp.block.mlp.gate]
    balancer = BiasBalancer(gates)

    stream = packed_sequences(tok, args.seed, args.seq_len + 1, args.n_problems)
    for _ in range(start * args.batch):  # same data order after a resume
        next(stream)
    print(
        f"params {sum(p.numel() for p in params) / 1e6:.2f}M, steps {start}..{args.steps}, batch "
        f"{args.batch}x{args.seq_len}",
        flush=True,
    )
    model.train()
    mtp.train()
    t0, tokens = time.time(), 0
    for step in range(start, args.steps):
        ids = torch.tensor([next(stream)[: args.seq_len] for _ in range(args.batch)])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss_main, mtp_losses = _losses(model, mtp, ids, args.mtp_steps)
        loss = loss_main + args.mtp_weight * sum(l / (2**i) for i, l in enumerate(mtp_losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = balancer.step()
        tokens += ids.numel()
        if (step + 1) % args.log_every == 0 or step == start:
            dt = time.time() - t0
            print(
                json.dumps(
                    {
                        "step": step + 1,
                        "loss": round(loss_main.item(), 4),
                        "mtp": [round(l.item(), 4) for l in mtp_losses],
                        "lr": round(opt.param_groups[0]["lr"], 6),
                        "max_load": round(imbalance, 2),
                        "tok_s": round(tokens / dt, 1),
                        "elapsed_s": round(dt, 1),
                    }
                ),
                flush=True,
            )
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_state(state_path, model, mtp, opt, step + 1, args)
    if not args.no_export:
        export_checkpoint(model, mtp, MODEL_CONFIG, tok_dir, args.export)
        print(f"exported {args.export}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
