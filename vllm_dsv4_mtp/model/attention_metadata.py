"""Per-step addressing of the portable attention core, computed once on the host for all layers.

vLLM hands the builder one ``CommonAttentionMetadata`` per step (per KV-cache group: the whole model and its
MTP draft). From its host copies of ``query_start_loc``, ``seq_lens``, ``slot_mapping`` and the block table
this module derives, with numpy, every index the layers need, so no layer loops over requests:

* **positions** of the step's tokens: request ``r``'s tokens sit at ``seq_len - q_len .. seq_len - 1``;
* **segments**: each request's queries cut into runs of at most ``S = min(max_query_len, SEGMENT)``
  consecutive tokens, padded to ``S``; a decode is one segment of 1 token, a verify window one of ``K+1``,
  a prefill chunk ``ceil(q_len / S)`` of them. Layers compute ``[n_seg, S, ...]`` batches; queries are
  gathered into that layout with ``query_index`` and back with ``output_index`` (both None when the layout
  is the identity: no segment is padded, as in a step of decodes or of equal verify windows).
* on first use by a layer, kept for the others (:meth:`window`, :meth:`entries`, :meth:`completions`):
  the cache slots of each segment's window keys with the per-query mask; the slots of the rows that hold
  compressed entries (the row of the token completing each block, see ``model/paged_rows.py``) with
  the per-query visibility; and the slots of the rows of every block this step completes.

Those, and what layers derive from them (rotations, cache-piece indices, the shared key sets, vLLM's kernel
schedule), live in the named fields of :class:`StepDerived`, one per quantity, made by the first layer that needs
them and reused by every other layer of the step.

Positions outside a sequence are clamped into ``[0, last position of the segment]`` for addressing (and
masked), so every gathered row was written by this sequence (finite values; rows beyond ``seq_len``, e.g. of
rejected drafts, are never addressed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# queries per segment: bounds the window-key overhang of a prefill segment (S + window - 1 keys per S queries)
SEGMENT = 32


@dataclass
class Window:
    """Window keys of each segment: ``slots [n_seg, K]`` int64, ``masked [n_seg, S, K]`` bool (True = masked)."""

    slots: torch.Tensor
    masked: torch.Tensor


@dataclass
class Entries:
    """Compressed entries ``j < (last position + 1) // ratio`` of each segment, padded to ``n = max``.

    ``slots [n_seg, n]`` int64 (rows of positions ``ratio * j + ratio - 1``); ``masked [n_seg, S, n]`` bool
    (True where ``j >= (query position + 1) // ratio``: not complete for that query); ``limit [n_seg, S, 1]``
    int64 (that bound).
    """

    slots: torch.Tensor
    masked: torch.Tensor
    limit: torch.Tensor
    count: int


@dataclass
class Completions:
    """Blocks completed by this step's tokens (``position % ratio == ratio - 1``), ``M`` of them.

    ``row_slots [M, span]`` int64: rows of positions ``p - span + 1 .. p``; ``row_valid [M, span, 1]`` bool
    (position >= 0); ``dst [M]`` int64: the completing token's slot; ``block_pos [M]`` int64: ``ratio * j``.
    """

    row_slots: torch.Tensor
    row_valid: torch.Tensor
    dst: torch.Tensor
    block_pos: torch.Tensor


@dataclass
class SharedKeys:
    """The keys every query of a segment may see on one kind of layer (``model/attention.py``): ``index [n_seg, K]``
    cache-piece indices (the window, then the complete C128-style entries: one gather reads both), ``masked
    [n_seg, S, K]`` bool (True = masked) and, once a layer asks for it, ``additive``: that mask as 0 / -inf in
    the cache dtype."""

    index: torch.Tensor
    masked: torch.Tensor
    additive: torch.Tensor | None = None


@dataclass
class KernelSchedule:
    """The step's arguments of vLLM's CPU attention kernel (``cpu/paged_window.py``): int32 host copies of
    ``query_start_loc [R + 1]``, ``seq_lens [R]`` and the block table, and the kernel's scheduler metadata."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler: torch.Tensor


@dataclass
class StepDerived:
    """What the layers derive from one step's metadata, made by the first layer that needs it and reused by every
    other layer of the step. Each field maps what tells layers apart (the key, in the comment) to the value."""

    windows: dict[int, Window] = field(default_factory=dict)  # window size
    entries: dict[int, Entries] = field(default_factory=dict)  # compress ratio
    # (compress ratio, rows pooled per entry); None: no block completes in this step
    completions: dict[tuple[int, int], Completions | None] = field(default_factory=dict)
    # (the rope's frequencies, what the positions are, inverse) -> complex64 rotation (``model/rope.py``)
    rotations: dict[tuple[tuple, str, bool], torch.Tensor] = field(default_factory=dict)
    # (pieces a cache row, piece width, pieces a layer writes) -> cache-piece index of the step's written rows
    write_pieces: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    # (window size, compress ratio of the entries every query sees, 0 for none: SWA and C4 layers)
    shared_keys: dict[tuple[int, int], SharedKeys] = field(default_factory=dict)
    # (window size, query heads, query dtype)
    kernel_schedules: dict[tuple[int, int, torch.dtype], KernelSchedule] = field(default_factory=dict)


@dataclass
class PortableAttentionMetadata:
    """One step's addressing, shared by every layer of the KV-cache group (see the module docstring)."""

    num_actual_tokens: int  # tokens of the step's tensors (may include padding tokens)
    num_tokens: int  # real tokens: query_start_loc[num_reqs]
    block_size: int
    device: torch.device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    write_index: torch.Tensor | None  # tokens with a slot (None: all num_actual_tokens of them)
    write_slots: torch.Tensor  # their slots
    positions: torch.Tensor  # [num_tokens] int64
    seg_len: int  # S
    num_segments: int
    query_index: torch.Tensor | None  # [n_seg * S] token of each padded query (None: identity layout)
    output_index: torch.Tensor | None  # [num_tokens] padded index of each token (None: identity layout)
    # host arrays the lazy tables are built from
    _bt: np.ndarray = field(repr=False)  # [num_reqs, max_blocks] block table
    _pos: np.ndarray = field(repr=False)  # [num_tokens]
    _tok_req: np.ndarray = field(repr=False)  # [num_tokens]
    _tok_slot: np.ndarray = field(repr=False)  # [num_tokens] slot, -1 = not written
    _seg_req: np.ndarray = field(repr=False)  # [n_seg]
    _seg_last: np.ndarray = field(repr=False)  # [n_seg] last query position of the segment
    _qpos: np.ndarray = field(repr=False)  # [n_seg, S] query positions, -1 = padding
    _qsl: np.ndarray = field(repr=False)  # [num_reqs + 1] query_start_loc
    _seq_lens: np.ndarray = field(repr=False)  # [num_reqs]
    derived: StepDerived = field(default_factory=StepDerived, repr=False)  # made by layers, shared by them
    positions_checked: bool = False

    @property
    def num_reqs(self) -> int:
        return len(self._qsl) - 1

    # ------------------------------------------------------------------------------------------ build
    @classmethod
    def create(
        cls,
        *,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        slot_mapping: torch.Tensor,
        num_actual_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> PortableAttentionMetadata:
        """``query_start_loc [R + 1]``, ``seq_lens [R]``, ``block_table [R, max_blocks]``: host copies."""
        qsl = query_start_loc.astype(np.int64)
        q_lens = np.diff(qsl)
        n_tok = int(qsl[-1])
        if n_tok > num_actual_tokens:
            raise ValueError(f"query_start_loc ends at {n_tok} > num_actual_tokens={num_actual_tokens}")
        tok_req = np.repeat(np.arange(q_lens.shape[0]), q_lens)
        pos = np.arange(n_tok) - qsl[tok_req] + (seq_lens.astype(np.int64) - q_lens)[tok_req]
        sm_np = slot_mapping[:num_actual_tokens].detach().cpu().numpy().astype(np.int64)
        keep = sm_np >= 0
        keep[n_tok:] = False  # padding tokens are never stored
        all_kept = bool(keep.all())
        tok_slot = np.where(keep[:n_tok], sm_np[:n_tok], -1)

        s = max(1, min(int(q_lens.max(initial=0)), SEGMENT))
        n_seg_r = -(-q_lens // s)
        seg_req = np.repeat(np.arange(q_lens.shape[0]), n_seg_r)
        seg_k = np.arange(seg_req.shape[0]) - np.repeat(np.cumsum(n_seg_r) - n_seg_r, n_seg_r)
        seg_tok = qsl[seg_req] + seg_k * s  # first token of each segment
        seg_cnt = np.minimum(s, qsl[seg_req + 1] - seg_tok)
        offs = np.arange(s)
        valid = offs[None, :] < seg_cnt[:, None]
        qidx = np.where(valid, seg_tok[:, None] + offs[None, :], 0)
        qpos = np.where(valid, pos[np.minimum(qidx, max(n_tok - 1, 0))] if n_tok else -1, -1)
        identity = bool((seg_cnt == s).all()) and seg_req.shape[0] * s == n_tok  # no padded query
        if identity:
            query_index = output_index = None
        else:
            query_index = _dev(qidx.reshape(-1), device)
            tok_seg = np.repeat(np.arange(seg_req.shape[0]), seg_cnt)
            output_index = _dev(tok_seg * s + (np.arange(n_tok) - seg_tok[tok_seg]), device)
        sm = slot_mapping[:num_actual_tokens].long()
        return cls(
            num_actual_tokens=num_actual_tokens,
            num_tokens=n_tok,
            block_size=block_size,
            device=device,
            slot_mapping=sm,
            write_index=None if all_kept else _dev(np.nonzero(keep)[0], device),
            write_slots=sm if all_kept else _dev(sm_np[keep], device),
            positions=_dev(pos, device),
            seg_len=s,
            num_segments=int(seg_req.shape[0]),
            query_index=query_index,
            output_index=output_index,
            _bt=block_table,
            _pos=pos,
            _tok_req=tok_req,
            _tok_slot=tok_slot,
            _seg_req=seg_req,
            _seg_last=qpos.max(axis=1) if qpos.size else np.zeros(0, np.int64),
            _qpos=qpos,
            _qsl=qsl,
            _seq_lens=seq_lens.astype(np.int64),
        )

    def slot(self, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Cache slot of position ``pos`` (>= 0) of request ``req`` (broadcast), through the block table."""
        bs = self.block_size
        return self._bt[req, pos // bs].astype(np.int64) * bs + pos % bs

    # ------------------------------------------------------------------------------------------ lazy tables
    def window(self, size: int) -> Window:
        """Window keys ``{q - size + 1 .. q}`` of every query, as one key range per segment."""
        if size not in self.derived.windows:
            last = self._seg_last
            first = np.maximum(self._qpos[:, 0] - size + 1, 0)
            k = int((last - first + 1).max(initial=1))
            kpos = first[:, None] + np.arange(k)[None, :]  # [n_seg, K]
            q = self._qpos[:, :, None]
            kp = kpos[:, None, :]
            masked = (kp > q) | (kp <= q - size) | (q < 0)
            slots = self.slot(self._seg_req[:, None], np.minimum(kpos, last[:, None]))
            self.derived.windows[size] = Window(_dev(slots, self.device), _dev(masked, self.device))
        return self.derived.windows[size]

    def entries(self, ratio: int) -> Entries:
        """Rows of the compressed entries each segment may see (``j < (last + 1) // ratio``)."""
        if ratio not in self.derived.entries:
            n_seg = (self._seg_last + 1) // ratio
            n = int(n_seg.max(initial=0))
            j = np.arange(n)[None, :]
            jpos = np.where(j < n_seg[:, None], ratio * j + ratio - 1, 0)
            slots = self.slot(self._seg_req[:, None], jpos)
            limit = (self._qpos + 1) // ratio  # [n_seg, S]; padding queries (-1) see none
            masked = j[None] >= limit[:, :, None]
            self.derived.entries[ratio] = Entries(
                _dev(slots, self.device), _dev(masked, self.device), _dev(limit[:, :, None], self.device), n
            )
        return self.derived.entries[ratio]

    def completions(self, ratio: int, span: int) -> Completions | None:
        """Blocks completed in this step, with the ``span`` rows ending at the completing token; None if none."""
        done_blocks = self.derived.completions
        key = (ratio, span)
        if key not in done_blocks:
            done = np.nonzero((self._pos % ratio == ratio - 1) & (self._tok_slot >= 0))[0]
            if done.shape[0] == 0:
                done_blocks[key] = None
            else:
                p = self._pos[done]
                rows = p[:, None] - span + 1 + np.arange(span)[None, :]
                slots = self.slot(self._tok_req[done][:, None], np.maximum(rows, 0))
                done_blocks[key] = Completions(
                    _dev(slots, self.device),
                    _dev((rows >= 0)[:, :, None], self.device),
                    _dev(self._tok_slot[done], self.device),
                    _dev(p - ratio + 1, self.device),
                )
        return done_blocks[key]

    def segment_groups(self, elems_per_segment: int, budget: int) -> list[tuple[int, int]]:
        """Consecutive segment ranges whose ``elems_per_segment`` intermediates stay under ``budget``."""
        per = max(1, budget // max(elems_per_segment, 1))
        return [(a, min(a + per, self.num_segments)) for a in range(0, self.num_segments, per)]

    def check_positions(self, positions: torch.Tensor) -> None:
        """Once per step: the model's ``positions`` equal ``seq_len - q_len + i`` (what addressing assumes)."""
        if self.positions_checked:
            return
        given = positions[: self.num_tokens].to(self.positions.dtype)
        if not torch.equal(given, self.positions):
            t = int((given != self.positions).nonzero()[0, 0])
            r = int(self._tok_req[t])
            raise ValueError(
                "portable attention: the step's positions differ from seq_lens - query_lens + i "
                "(the addressing of the paged rows assumes each request's tokens are its last "
                f"query_len positions): token {t} (request {r}) is at position {int(given[t])}, "
                f"its seq_len and query_len put it at {int(self.positions[t])}"
            )
        self.positions_checked = True


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
