"""The page's plots, drawn with matplotlib (Agg) into PNG bytes.

matplotlib is an optional extra (``pip install lowdiff-store[report]``): it is imported
inside :func:`available` and the drawing functions, never at import time of the package.
Each function takes the already reduced series (:mod:`.series`), so a plot of a
1,000,000-step log draws at most a few thousand points.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..progress import human_bytes
from .series import Binned, Curve, binned

#: Colours of the ranks' lines (and of the single log), base markers, tuner decisions.
PALETTE = ("#2563eb", "#ea580c", "#059669", "#9333ea", "#dc2626", "#0891b2", "#ca8a04",
           "#db2777")
BASE_COLOUR = "#64748b"
DECISION_COLOUR = "#dc2626"
SYNC_COLOUR = "#059669"
#: Ranks drawn one line each; more are drawn as their min-max band and mean.
MAX_LINES = 8
WIDTH_IN = 11.0
DPI = 100


@dataclass
class Line:
    """One log's series for the timeline and recovery plots."""

    label: str
    records: Binned
    curve: Curve
    bases: list[tuple[int, int]]
    decisions: list[int]
    syncs: list[int]


def available() -> bool:
    """matplotlib can be imported (the ``report`` extra is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
        "axes.grid": True, "axes.axisbelow": True, "grid.color": "#e2e8f0", "grid.linewidth": 0.8,
        "axes.edgecolor": "#94a3b8", "axes.titleweight": "bold", "axes.titlesize": 11,
        "legend.frameon": False, "legend.fontsize": 9,
    })
    return plt


def _png(plt: Any, fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return buf.getvalue()


def _bytes_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: human_bytes(v, ".3g")))


def timeline(lines: Sequence[Line]) -> bytes:
    """Record bytes per step (a band from min to max when binned), the bases as vertical
    lines, the tuner's decisions and the synchronization events as markers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.4))
    for i, ln in enumerate(lines[:MAX_LINES]):
        colour = PALETTE[i % len(PALETTE)]
        r = ln.records
        if r.width > 1:
            ax.fill_between(r.x, r.lo, r.hi, color=colour, alpha=0.18, linewidth=0)
        ax.plot(r.x, r.mean, color=colour, linewidth=1.4, label=ln.label,
                marker="o" if len(r.x) <= 60 else None, markersize=3)
    top = max((float(ln.records.hi.max()) for ln in lines if len(ln.records.x)), default=1.0)
    bases = [b for b, _n in (lines[0].bases if lines else [])]
    if bases:  # one collection, however many bases (1,000 axvline calls take seconds)
        many = len(bases) > 100
        ax.vlines(bases, 0, 1, transform=ax.get_xaxis_transform(), colors=BASE_COLOUR,
                  linestyles="solid" if many else "dashed", linewidth=0.5 if many else 1,
                  alpha=0.5 if many else 1.0, label="base")
    seen: set[str] = set()
    for ln in lines[:MAX_LINES]:
        for kind, xs, colour, mark in (("tuner decision", ln.decisions, DECISION_COLOUR, "v"),
                                       ("synchronization", ln.syncs, SYNC_COLOUR, "|")):
            if xs:
                ax.scatter(xs, [top * 1.04] * len(xs), color=colour, marker=mark, s=40,
                           zorder=3, label=None if kind in seen else kind)
                seen.add(kind)
    ax.set_ylim(0, top * 1.12 if top > 0 else 1)
    ax.set_xlabel("step")
    ax.set_ylabel("record bytes")
    _bytes_axis(ax)
    ax.set_title("Record bytes per step")
    ax.legend(loc="lower right", ncol=4)
    return _png(plt, fig)


def recovery(lines: Sequence[Line], seconds_known: bool) -> bytes:
    """What a restore of each step reads and replays: the saw-tooth between bases."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH_IN, 3.4))
    for i, ln in enumerate(lines[:MAX_LINES]):
        colour = PALETTE[i % len(PALETTE)]
        c = ln.curve
        if not len(c):
            continue
        read = binned(c.steps, c.bytes_read)
        ax1.plot(read.x, read.hi, color=colour, linewidth=1.4, label=ln.label,
                 drawstyle="steps-post")
        if seconds_known and c.seconds is not None:
            y = binned(c.steps, c.seconds)
        else:
            y = binned(c.steps, c.replayed)
        ax2.plot(y.x, y.hi, color=colour, linewidth=1.4, label=ln.label,
                 drawstyle="steps-post")
    ax1.set_title("Bytes a restore reads (base + diffs)")
    ax1.set_xlabel("restored step")
    ax1.set_ylim(bottom=0)
    _bytes_axis(ax1)
    if seconds_known:
        ax2.set_title("Estimated restore time (measured costs)")
        ax2.set_ylabel("seconds")
    else:
        ax2.set_title("Diffs a restore replays")
        ax2.set_ylabel("diffs")
    ax2.set_xlabel("restored step")
    ax2.set_ylim(bottom=0)
    if len(lines) > 1:
        ax1.legend(loc="upper left")
    fig.tight_layout()
    return _png(plt, fig)


def tensor_bars(items: Sequence[tuple[str, float]], title: str) -> bytes:
    """Horizontal bars, the largest on top (bytes by tensor or by codec)."""
    plt = _pyplot()
    height = 0.9 + 0.28 * max(len(items), 1)
    fig, ax = plt.subplots(figsize=(WIDTH_IN * 0.62, height))
    names = [_clip(n) for n, _v in items][::-1]
    values = [v for _n, v in items][::-1]
    ax.barh(names, values, color=PALETTE[0], height=0.65)
    ax.grid(axis="y", visible=False)
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: human_bytes(v, ".3g")))
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    return _png(plt, fig)


def ranks(labels: Sequence[str], durable: Sequence[int | None], disk: Sequence[int]
          ) -> bytes:
    """Per rank, side by side: the durable step and the bytes on disk."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH_IN, 2.2 + 0.05 * len(labels)))
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(labels))]
    ax1.bar(labels, [d if d is not None else 0 for d in durable], color=colours)
    ax1.set_title("Durable step per rank")
    ax2.bar(labels, list(disk), color=colours)
    ax2.set_title("Bytes on disk per rank")
    _bytes_axis(ax2)
    for ax in (ax1, ax2):
        ax.grid(axis="x", visible=False)
        if len(labels) > 12:
            ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    fig.tight_layout()
    return _png(plt, fig)


def _clip(name: str, width: int = 48) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


__all__ = ["Line", "available", "ranks", "recovery", "tensor_bars",
           "timeline"]
