"""Test helper: drive one plugin attention layer through its paged cache step by step, as vLLM's runner does.

:class:`PagedSequences` binds a NaN-filled cache (a read of a row no step wrote would poison the output; ``fill``
another value, for code that multiplies such rows by zero, as vLLM's CPU attention kernel does),
hands out shuffled blocks, and for each step builds the backend's metadata (``attention/metadata.py``) of a batch of
sequences (each with its new tokens), runs the layer over the whole batch at once and returns each sequence's
outputs. ``rewind`` drops a sequence's last rows from its length (rejected speculative drafts): their rows stay
in the cache beyond ``seq_len``, as in vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dsv4_mtp.attention.backend import step_plan
from vllm_dsv4_mtp.attention.metadata import build_step


class PagedSequences:
    def __init__(self, layer, *, block_size: int = 16, num_blocks: int = 96, seed: int = 0, fill: float = float("nan")):
        self.layer = layer
        self.bs = block_size
        layer.sparse_attn.bind_kv_cache(torch.full((num_blocks, 1, block_size, layer.sparse_attn.cache_width), fill))
        self.plan = step_plan([layer.sparse_attn])
        self.free = list(np.random.RandomState(seed).permutation(num_blocks))
        self.blocks: dict[object, list[int]] = {}
        self.length: dict[object, int] = {}

    def rewind(self, seq, n: int) -> None:
        self.length[seq] -= n

    def step(self, batch: list[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        """``batch``: (sequence id, ``x [n, D]`` of its new tokens) -> the layer's output ``[n, D]`` of each."""
        qsl, seq_lens, slots, positions = [0], [], [], []
        for seq, x in batch:
            start = self.length.setdefault(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            end = start + x.shape[0]
            while len(blocks) * self.bs < end:
                blocks.append(self.free.pop())
            positions += list(range(start, end))
            slots += [blocks[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
            qsl.append(qsl[-1] + x.shape[0])
            seq_lens.append(end)
            self.length[seq] = end
        width = max(len(self.blocks[s]) for s, _ in batch)
        table = np.array([self.blocks[s] + [0] * (width - len(self.blocks[s])) for s, _ in batch])
        md = build_step(
            self.plan,
            query_start_loc=np.array(qsl),
            seq_lens=np.array(seq_lens),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_actual_tokens=len(slots),
            block_size=self.bs,
        )
        with torch.no_grad():
            out = self.layer.forward_paged(md, torch.tensor(positions), torch.cat([x for _, x in batch]))
        return list(out.split([x.shape[0] for _, x in batch]))


def run_in_chunks(layer, x: torch.Tensor, chunks=None, **cache) -> torch.Tensor:
    """One sequence ``x [L, D]`` through a fresh paged cache (``cache``: :class:`PagedSequences`' options), its
    tokens in ``chunks`` ((start, end) steps)."""
    seqs = PagedSequences(layer, **cache)
    chunks = chunks or [(0, x.shape[0])]
    return torch.cat([seqs.step([("s", x[a:b])])[0] for a, b in chunks])
