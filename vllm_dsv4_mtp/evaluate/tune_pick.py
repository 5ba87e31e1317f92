"""``dsv4-mtp tune``'s decisions, from measured output tokens/s alone (no server, no vLLM import: unit-testable).

Candidates per concurrency level C: ``k0`` (K = 0 *in a schedule*: vLLM still runs the draft's forward on every
step, so it is not MTP off), ``k1`` .. ``kKmax`` (static K). ``off`` (no speculative config) is measured beside them
but cannot be a schedule entry: it is only ever the whole server's alternative::

    pick(C)      = the lowest K whose tok/s >= (1 - tie) x max over k0..kKmax at C     # the lower K on a tie
    ranges       : levels C_1 < .. < C_n; level i's K holds from the batch size after level i-1's range up to
                   floor(sqrt(C_i x C_i+1)) (the geometric midpoint: levels are spaced geometrically), level n's up to
                   max_num_seqs; equal neighbours merge.  -> [[1, b_1, K_1], [b_1 + 1, b_2, K_2], ...]
    config       : every K equal and > 0 -> static K (no schedule: the schedule's own path costs a little, 8 % at one
                   request on CPU); else {num_speculative_tokens: max K, num_speculative_tokens_per_batch_size: ranges}
    thresholds   : each range's first batch size s after the first; checked at s-1, s, s+1 (vllm#49548's collapse)
    collapse at C: tuned tok/s(C) < (1 - drop) x max tuned tok/s at any smaller concurrency (throughput should not
                   fall when requests are added; #49548 fell from 232 to 24-157 tok/s)
    score(X)     = geometric mean over the load levels of X's tok/s
    recommend    : off if score(off) >= both score(tuned) and the best static score (no speculative config wins at
                   this load: K = 0 in a schedule is not off); else the tuned config unless the best static K beats
                   it by more than ``tie``; else that static K.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

OFF, K0, TUNED = "off", "k0", "tuned"


def cand(k: int) -> str:
    """The candidate name of K (``k0``: K = 0 in a schedule; ``k2``: static K = 2)."""
    return f"k{k}"


def label(config: str) -> str:
    """How the report names a config."""
    if config == OFF:
        return "off"
    if config == K0:
        return "K=0 (schedule)"
    if config == TUNED:
        return "tuned"
    return f"K={config.removeprefix('k')}"


#: measured output tokens/s: ``tok_s[config][concurrency]``
TokS = Mapping[str, Mapping[int, float]]


def tok_s_table(rows: Iterable[dict]) -> dict[str, dict[int, float]]:
    """``{config: {concurrency: output tok/s}}`` from measured rows."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        out.setdefault(r["config"], {})[int(r["concurrency"])] = float(r["output_tok_s"])
    return out


def pick(tok_s: TokS, levels: list[int], k_max: int, tie: float) -> list[dict]:
    """Per level: the chosen K (the module docstring's rule), the best candidate, and what off made there."""
    picks = []
    for c in levels:
        measured = {k: tok_s[cand(k)][c] for k in range(k_max + 1)}
        best_k = max(measured, key=lambda k: measured[k])
        k = min(k for k, v in measured.items() if v >= (1 - tie) * measured[best_k])
        statics = {kk: v for kk, v in measured.items() if kk > 0}
        best_static = max(statics, key=lambda kk: statics[kk])
        off = tok_s.get(OFF, {}).get(c)
        picks.append(
            {
                "concurrency": c,
                "k": k,
                "tok_s": measured[k],
                "best_k": best_k,
                "best_static_k": best_static,
                "off_tok_s": off,
                # does anything a schedule can hold at C beat serving without a speculative config?
                "beats_off": off is None or measured[k] > off,
            }
        )
    return picks


def ranges(levels: list[int], ks: list[int], max_num_seqs: int) -> list[list[int]]:
    """Batch-size ranges ``[[start, end, K], ...]`` (inclusive, from 1) from each level's K (module docstring)."""
    if sorted(levels) != list(levels) or len(set(levels)) != len(levels):
        raise ValueError(f"levels must be strictly increasing, got {levels}")
    if levels[-1] > max_num_seqs:
        raise ValueError(f"level {levels[-1]} exceeds max_num_seqs {max_num_seqs}")
    out: list[list[int]] = []
    start = 1
    for i, (c, k) in enumerate(zip(levels, ks)):
        end = max_num_seqs if i == len(levels) - 1 else math.isqrt(c * levels[i + 1])
        if out and out[-1][2] == k:
            out[-1][1] = end
        else:
            out.append([start, end, k])
        start = end + 1
    return out


def speculative_config(base: Mapping, schedule: list[list[int]], schedule_key: str) -> dict:
    """The config the schedule stands for: static K when every K is the same K > 0, else the schedule with its
    largest K as ``num_speculative_tokens`` (at least 1: vLLM needs one; a K = 0 everywhere schedule is served to be
    measured, never recommended, since off does the same without the draft's K = 0 forward)."""
    config = {k: v for k, v in base.items() if k != schedule_key}
    ks = {r[2] for r in schedule}
    if len(ks) == 1 and ks != {0}:
        return config | {"num_speculative_tokens": ks.pop()}
    return config | {"num_speculative_tokens": max(max(ks), 1), schedule_key: [list(r) for r in schedule]}


def all_k0(base: Mapping, max_num_seqs: int, schedule_key: str, num_speculative_tokens: int = 1) -> dict:
    """The config that runs K = 0 at every batch size up to ``max_num_seqs`` (each step the draft only writes its
    cache): one schedule range of K = 0, under ``num_speculative_tokens`` (vLLM needs at least 1; the tuner gives
    its Kmax, so that K = 0 runs on the server a schedule holding it would)."""
    config = {k: v for k, v in base.items() if k != schedule_key}
    return config | {"num_speculative_tokens": max(num_speculative_tokens, 1), schedule_key: [[1, max_num_seqs, 0]]}


def thresholds(schedule: list[list[int]] | None) -> list[int]:
    """The first batch size of each range after the first (where K changes)."""
    return [r[0] for r in (schedule or [])[1:]]


def check_levels(schedule: list[list[int]] | None, max_num_seqs: int) -> list[int]:
    """Each threshold and one either side, within 1..max_num_seqs."""
    return sorted({c for s in thresholds(schedule) for c in (s - 1, s, s + 1) if 1 <= c <= max_num_seqs})


def collapses(tuned: Mapping[int, float], schedule: list[list[int]] | None, drop: float) -> list[dict]:
    """One entry per threshold: its check levels' tok/s and whether any fell by more than ``drop`` below the best
    tuned tok/s at a smaller concurrency."""
    out = []
    for s in thresholds(schedule):
        checked = []
        for c in (s - 1, s, s + 1):
            if c not in tuned:
                continue
            below = [v for cc, v in tuned.items() if cc < c]
            floor = (1 - drop) * max(below) if below else None
            checked.append(
                {
                    "concurrency": c,
                    "tok_s": tuned[c],
                    "floor": floor,
                    "collapse": floor is not None and tuned[c] < floor,
                }
            )
        out.append({"threshold": s, "levels": checked, "collapse": any(x["collapse"] for x in checked)})
    return out


def score(tok_s: Mapping[int, float], load: list[int]) -> float:
    """Geometric mean of tok/s over the load levels (each level weighs the same, whatever its scale)."""
    return math.exp(sum(math.log(max(tok_s[c], 1e-9)) for c in load) / len(load))


def recommend(tok_s: TokS, load: list[int], k_max: int, tie: float, tuned_is_config: bool) -> dict:
    """Which server to run at this load: ``{"choice": "tuned" | "off" | "kN", "scores": ..., "reason": ...}``.
    ``tuned_is_config=False``: the tuned schedule holds K = 0 only, which is never chosen."""
    scores = {name: score(tok_s[name], load) for name in [OFF, *(cand(k) for k in range(1, k_max + 1)), TUNED]}
    best_static = max((cand(k) for k in range(1, k_max + 1)), key=lambda n: scores[n])
    tuned = scores[TUNED] if tuned_is_config else 0.0
    at = ", ".join(map(str, load))
    if scores[OFF] >= max(tuned, scores[best_static]):
        tuned_part = f"the tuned config makes {tuned / scores[OFF]:.2f}x off's tokens/s"
        made = tuned_part if tuned_is_config else "every level picked K=0"
        reason = (
            f"at your load (concurrency {at}) no speculative config beats serving without one: {made}, static "
            f"{label(best_static)} {scores[best_static] / scores[OFF]:.2f}x off's (geometric means). K=0 in a "
            "schedule is not MTP off: vLLM still runs the draft's forward at every step. Serve without "
            "--speculative-config"
        )
        choice = OFF
    elif tuned >= (1 - tie) * scores[best_static]:
        reason = (
            f"at your load (concurrency {at}) the tuned config makes {tuned / scores[OFF]:.2f}x off's tokens/s and "
            f"{tuned / scores[best_static]:.2f}x the best static choice, {label(best_static)} (geometric means)"
        )
        choice = TUNED
    else:
        reason = (
            f"at your load (concurrency {at}) static {label(best_static)} beats the tuned config by more than "
            f"{tie:.0%}: the tuned config makes {tuned / scores[best_static]:.2f}x its tokens/s (geometric means), so "
            "serve the static K"
        )
        choice = best_static
    return {"choice": choice, "scores": {k: round(v, 1) for k, v in scores.items()}, "reason": reason}
