"""``dsv4-mtp tune``'s outputs: ``tune.json`` (everything), ``tune.md`` (the table and the verdict), ``tune.png``
and ``speculative-config.json`` (the tuned config, as ``--speculative-config`` takes it).

The table has one row per concurrency (the sweep's levels, then the threshold checks, marked): each candidate's
output tokens/s, the K picked there, the tuned server's tokens/s (its acceptance length), and its ratio to off, to
K = 0 in a schedule and to each static K measured at that level.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dsv4_mtp.evaluate import tune_pick as tp
from vllm_dsv4_mtp.serve.profiles import SCHEDULE_KEY


def _num(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    statics = [tp.cand(k) for k in range(1, report["k_max"] + 1)]
    measured = [tp.OFF, tp.K0, *statics]
    picks = {p["concurrency"]: p["k"] for p in report["picks"]}
    acc = {r["concurrency"]: r["acceptance_length"] for r in report["rows"] if r["config"] == tp.TUNED}
    head = ["concurrency", *(f"{tp.label(n)} tok/s" for n in measured), "picked K", "tuned tok/s (acc. len.)"]
    head += [f"tuned / {tp.label(n)}" for n in measured]
    lines = [f"# {report['title']}", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in report["comparison"]:
        c = row["concurrency"]
        name = f"{c} (threshold check)" if row["threshold_check"] else str(c)
        tuned = _num(row["tuned"]) + (f" ({acc[c]:.2f})" if acc.get(c) else "")
        ratios = [_num(row[f"tuned/{n}"], "{:.2f}x") for n in measured]
        cells = [name, *(_num(row[n]) for n in measured), _num(picks.get(c)), tuned, *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    rec = report["recommendation"]
    swept = [r for r in report["comparison"] if not r["threshold_check"] and r["tuned/best_static"] is not None]
    worst = min(swept, key=lambda r: r["tuned/best_static"])
    lines += [
        "",
        f"- Tuned / the best static K at every level of the sweep: at least {worst['tuned/best_static']:.2f}x",
    ]
    lines[-1] += f" (at {worst['concurrency']})"
    lines += [f"- Schedule (each level's K up to the geometric midpoint to the next): `{report['schedule']}`"]
    lines += [f"- Tuned speculative config: `{json.dumps(report['tuned_config'], separators=(',', ':'))}`"]
    for t in report["collapse"]:
        seen = ", ".join(f"{x['concurrency']}: {x['tok_s']:.0f}" for x in t["levels"])
        verdict = "**collapse** (vllm#49548)" if t["collapse"] else "no collapse"
        lines.append(f"- Threshold at {t['threshold']} requests: {verdict} (tok/s {seen})")
    if not report["collapse"]:
        lines.append("- No threshold: the tuned config is one static K (or K=0 everywhere)")
    reason = rec["reason"][:1].upper() + rec["reason"][1:]
    lines += ["", f"**Recommendation: {_choice(rec['choice'])}.** {reason}.", "", "```bash", rec["command"], "```"]
    lines += [
        "",
        f"The tuned config as a profile entry (vllm_dsv4_mtp/serve/profiles.py): `{rec['profile_entry']}`",
        "",
    ]
    lines.append(f"{report['command']} ({report['wall_s']} s; {report['machine'].get('cpu', '')})")
    return "\n".join(lines) + "\n"


def _choice(choice: str) -> str:
    if choice == tp.OFF:
        return "serve without a speculative config"
    if choice == tp.TUNED:
        return "the tuned config"
    return f"static {tp.label(choice)}"


def plot(report: dict, path: Path) -> Path:
    """Output tokens/s of every config, and the tuned config's ratio to off and to each static K, against
    concurrency (log2); the thresholds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[str, dict[int, float]] = tp.tok_s_table(report["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, points in by.items():
        xs = sorted(points)
        style = {"lw": 2.5, "color": "black"} if name == tp.TUNED else {}
        axes[0].plot(xs, [points[c] for c in xs], marker="o", label=tp.label(name), **style)
    for name in [tp.OFF, *(tp.cand(k) for k in range(1, report["k_max"] + 1))]:
        rows = [r for r in report["comparison"] if r[f"tuned/{name}"] is not None]
        xs = [r["concurrency"] for r in rows]
        axes[1].plot(xs, [r[f"tuned/{name}"] for r in rows], marker="s", label=f"tuned / {tp.label(name)}")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].axhline(0.95, color="grey", lw=0.8, ls=":")
    levels = sorted({r["concurrency"] for r in report["comparison"]})
    for ax, title in zip(axes, ("output tokens/s", "tuned config's ratio")):
        for s in tp.thresholds(report["tuned_config"].get(SCHEDULE_KEY)):
            ax.axvline(s, color="red", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: dict, out: Path) -> dict:
    """The four files under ``out``; ``"text"``: what the command prints."""
    out = Path(out)
    paths = {n: out / n for n in ("tune.json", "tune.md", "tune.png", "speculative-config.json")}
    paths["tune.json"].write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    paths["tune.md"].write_text(text)
    paths["speculative-config.json"].write_text(json.dumps(report["tuned_config"]) + "\n")
    plot(report, paths["tune.png"])
    where = ", ".join(str(p) for p in paths.values())
    return {**paths, "text": f"{text}\nwritten: {where}"}
