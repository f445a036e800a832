"""The report page: one self-contained HTML file (inline CSS, plots as base64 PNG, no
script, nothing fetched from the network).

Sections, in reading order: the summary cards, Health (what ``verify`` would say, each
problem with file, offset and reason), Timeline (record bytes per step, bases, the tuner's
decisions, synchronization events, the footprint of compactions), Recovery (the
saw-tooth), Bytes by tensor and by codec, Ranks (a sharded checkpoint), Metadata (the
torch layer's, the measured costs). Every number a plot shows is also in a table, so the
page reads without the ``report`` extra (matplotlib).
"""

from __future__ import annotations

import base64
import datetime
import html
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..progress import human_bytes
from ..torchmeta import BaseSlices
from . import plots
from .facts import FULL_CHECK_BYTES, FULL_CHECK_RECORDS, LogFacts, Report
from .series import Curve, binned, recovery_curve

#: What a cell shows for "no value" (an en dash).
DASH = "\u2013"
#: Rows of the bytes-by-tensor table (the largest first).
TOP_TENSORS = 25
#: Rows of the tuner's decisions and recovery tables (the newest are kept).
MAX_ROWS = 200
#: Bases listed per log: the oldest two and the newest, the others summed up in one row.
BASE_ROWS = 12

CSS = """
:root{--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--ok:#059669;--bad:#dc2626;
--warn:#d97706;--accent:#2563eb}
*{box-sizing:border-box}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
color:var(--fg);background:var(--bg)}
header{background:#0f172a;color:#f8fafc;padding:18px 32px}
header h1{margin:0;font-size:20px;font-weight:600}
header .path{font-family:ui-monospace,"DejaVu Sans Mono",monospace;color:#cbd5e1;
font-size:13px;word-break:break-all}
main{max-width:1180px;margin:0 auto;padding:16px 32px 40px}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:14px 20px;
margin:16px 0}
h2{font-size:17px;margin:2px 0 10px}
h3{font-size:14px;margin:14px 0 6px;color:#334155}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(128px,1fr));gap:12px}
.card{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 14px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:20px;font-weight:600;margin-top:2px}
.badge{display:inline-block;padding:2px 10px;border-radius:999px;font-weight:600;
font-size:13px;color:#fff}
.ok{background:var(--ok)}.corrupt,.unreadable{background:var(--bad)}.torn{background:var(--warn)}
table{border-collapse:collapse;width:100%;margin:6px 0;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:#334155;background:#f1f5f9;font-weight:600}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
img.plot{display:block;max-width:100%;height:auto;margin:6px 0}
.note{color:var(--muted);font-size:12.5px;margin:4px 0}
.problem{border-left:4px solid var(--bad);background:#fef2f2;padding:8px 12px;margin:6px 0}
.fine{border-left:4px solid var(--ok);background:#f0fdf4;padding:8px 12px;margin:6px 0}
.two{display:grid;grid-template-columns:minmax(0,3fr) minmax(0,2fr);gap:16px;align-items:start}
footer{color:var(--muted);font-size:12px;text-align:center;padding:12px}
"""


def esc(x: Any) -> str:
    """HTML-escaped text of ``x``."""
    return html.escape(str(x), quote=True)


def num(n: int | None) -> str:
    """``1234567`` -> ``1,234,567``; None -> an en dash."""
    return DASH if n is None else f"{n:,}"


def table(head: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[int] = ()
          ) -> str:
    """A table; cells are escaped unless wrapped in :class:`Raw`; ``numeric`` columns
    are right-aligned."""
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="n"' if i in numeric else ""
        return f"<{tag}{cls}>{v.html if isinstance(v, Raw) else esc(v)}</{tag}>"

    out = ["<table>"]
    if any(head):
        out.append("<tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>")
    out += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>"
            for r in rows]
    return "\n".join(out) + "</table>"


class Raw:
    """Markup a table cell holds as is."""

    def __init__(self, markup: str) -> None:
        self.html = markup


def img(png: bytes, alt: str) -> str:
    """An embedded PNG."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def location(p: dict[str, Any]) -> str:
    """``FILE:OFFSET`` of a problem."""
    off = p.get("offset")
    return f"{p.get('path')}:{off if off is not None else '-'}"


class Page:
    """Builds the HTML of one :class:`Report` (see the module docstring)."""

    def __init__(self, rep: Report, *, with_plots: bool | None = None) -> None:
        self.rep = rep
        self.plots = plots.available() if with_plots is None else with_plots
        self.logs = [f for f in rep.logs if f.opened]
        self.curves = [self._curve(f) for f in self.logs]
        self.meta = self.logs[0].torch if self.logs else None

    # ---------------------------------------------------------------- data

    def _curve(self, f: LogFacts) -> Curve:
        m = f.measurements
        replay = m.get("replay_cost")
        keep = ~np.isin(f.steps, f.damaged_steps)  # no restore goes through a bad record
        usable = [b for b in f.bases if b.error is None]
        return recovery_curve(f.steps[keep], f.lengths[keep],
                              [(b.step, b.bytes) for b in usable],
                              replay_cost=replay if replay else None,
                              base_load_time=m.get("base_load_time", 0.0),
                              starts=[b.first for b in usable])

    def label(self, f: LogFacts) -> str:
        """``rank 3`` or ``log``."""
        return f"rank {f.rank}" if f.rank is not None else "log"

    # ---------------------------------------------------------------- page

    def render(self) -> str:
        """The whole page."""
        rep = self.rep
        parts = [self._header(), "<main>", self._cards(), self._health()]
        if self.logs:
            parts += [self._timeline(), self._recovery(), self._bytes()]
            if rep.sharded:
                parts.append(self._ranks())
            parts.append(self._metadata())
        parts += ["</main>", self._footer()]
        title = f"lowdiff-store report: {rep.path}"
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
                + "\n".join(parts) + "\n</body></html>\n")

    def _header(self) -> str:
        rep = self.rep
        kind = (f"sharded checkpoint, {rep.world_size} ranks ({rep.layout})" if rep.sharded
                else "log")
        return (f"<header><h1>lowdiff-store report &middot; {esc(kind)}</h1>"
                f"<div class=\"path\">{esc(rep.path)}</div></header>")

    def _badge(self) -> str:
        h = self.rep.health
        torn = sum(f.torn_tail_bytes for f in self.rep.logs)
        if h == "ok" and torn:
            return '<span class="badge torn">ok (torn tail)</span>'
        return f'<span class="badge {h}">{esc(h)}</span>'

    def _cards(self) -> str:
        logs = self.logs
        records = sum(f.records for f in logs)
        rbytes = sum(f.record_bytes for f in logs)
        steps = max((f.records for f in logs), default=0)
        bases = sorted({b.step for f in logs for b in f.bases})
        cards = [
            ("health", self._badge()),
            ("durable step", num(self.rep.durable_step)),
            ("last step", num(max((f.last_step for f in logs if f.last_step is not None),
                                  default=None))),
            ("records", num(records)),
            ("bases", num(len(bases))),
            ("bytes on disk", human_bytes(sum(f.bytes_on_disk for f in logs))),
            ("bytes per step", human_bytes(rbytes / steps) if steps else DASH),
        ]
        body = "".join(f'<div class="card"><div class="k">{esc(k)}</div>'
                       f'<div class="v">{v}</div></div>' for k, v in cards)
        return f'<div class="cards" id="summary">{body}</div>'

    def _health(self) -> str:
        rep = self.rep
        out = ['<section id="health"><h2>Health</h2>']
        if rep.error is not None:
            out.append(f'<div class="problem"><b>Not readable as a lowdiff-store log.</b> '
                       f'<span class="mono">{esc(location(rep.error))}: '
                       f'{esc(rep.error.get("reason"))}: {esc(rep.error.get("detail"))}'
                       "</span></div>")
        problems = rep.all_problems()
        if problems:
            out.append(f'<div class="problem"><b>{len(problems)} problem(s) found.</b> '
                       "Each names its file, byte offset and reason code "
                       "(format_spec/log_format.md, &ldquo;Reason codes&rdquo;).</div>")
            out.append(table(["file", "offset", "reason", "detail"],
                             ([p.get("path"), num(p.get("offset")), p.get("reason"),
                               p.get("detail")] for p in problems), numeric=(1,)))
        elif rep.error is None:
            out.append('<div class="fine"><b>No problem found.</b></div>')
        torn = [(self.label(f), f.torn_tail_bytes) for f in rep.logs if f.torn_tail_bytes]
        for who, n in torn:
            out.append(f'<p class="note">{esc(who)}: a torn tail of {n:,} bytes (what a '
                       "crash leaves after the last complete record) is ignored: not a "
                       "problem.</p>")
        out.append(f'<p class="note">{self._checked_how()}</p>')
        notes = rep.notes + [f"{self.label(f)}: {n}" for f in rep.logs for n in f.notes]
        out += [f'<p class="note">note: {esc(n)}</p>' for n in notes]
        out.append("</section>")
        return "\n".join(out)

    def _checked_how(self) -> str:
        if self.rep.error is not None:
            return "Nothing else could be read."
        if self.rep.full_check:
            return ("Checked as <code>lowdiff-store verify</code> does: every byte, every "
                    "record checksum and index entry, every base tensor.")
        return (f"Checked at open (manifest, indexes, the unindexed tail) and on the records "
                f"read for this page; the full check runs up to {FULL_CHECK_RECORDS:,} records "
                f"and {human_bytes(FULL_CHECK_BYTES)}: run <code>lowdiff-store verify "
                f"{esc(self.rep.path)}</code> to read every byte.")

    def _footer(self) -> str:
        from .. import __version__

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        extra = "" if self.plots else (" Plots need the report extra: <code>pip install "
                                       "'lowdiff-store[report]'</code> (matplotlib).")
        return (f"<footer>lowdiff-store {esc(__version__)} &middot; {now} &middot; a "
                f"self-contained page (nothing loaded from the network).{extra}</footer>")

    def _no_plots(self) -> str:
        return ('<p class="note">(plot omitted: plots need the report extra, <code>pip '
                "install 'lowdiff-store[report]'</code>, which installs matplotlib; the "
                "tables below hold the same numbers)</p>")

    # ---------------------------------------------------------------- sections

    def _lines(self) -> list[plots.Line]:
        return [plots.Line(self.label(f), binned(f.steps, f.lengths), c,
                           [(b.step, b.bytes) for b in f.bases],
                           sorted({d.step for d in f.decisions}), f.syncs)
                for f, c in zip(self.logs, self.curves, strict=True)]

    def _timeline(self) -> str:
        out = ['<section id="timeline"><h2>Timeline</h2>']
        lines = self._lines()
        out.append(img(plots.timeline(lines), "record bytes per step") if self.plots
                   else self._no_plots())
        widths = {ln.records.width for ln in lines}
        if max(widths, default=1) > 1:
            out.append(f'<p class="note">Aggregated: {max(widths):,} consecutive steps per '
                       "point (the line is their mean, the band their min and max).</p>")
        out.append(self._bases_table())
        out.append(self._decisions())
        out.append(self._compactions())
        out.append("</section>")
        return "\n".join(out)

    def _bases_table(self) -> str:
        m = self.logs[0].measurements
        cost = m.get("base_cost")
        timing = (f"Each base stalled training {cost * 1e3:.2f} ms (median measured by the "
                  "checkpointer, <code>base_cost</code>); the log records no per-base time."
                  if cost else "The log records no base write time (a log not written by "
                  "the torch checkpointer, or one that closed before its first base).")
        rows: list[list[Any]] = []
        for f in self.logs:
            shown = f.bases if len(f.bases) <= BASE_ROWS else [*f.bases[:2],
                                                               *f.bases[2 - BASE_ROWS:]]
            for b in shown:
                step = num(b.step) if not b.slices else \
                    f"{num(b.step)} (streamed: slices {', '.join(map(str, b.slices))})"
                rows.append([self.label(f), step, human_bytes(b.bytes),
                             num(len(b.tensors)), b.error or "ok"])
                if len(shown) < len(f.bases) and b is shown[1]:
                    sizes = sorted(x.bytes for x in f.bases[2:2 - BASE_ROWS])
                    rows.append([self.label(f), f"… {len(sizes):,} more",
                                 f"{human_bytes(sizes[0])} to {human_bytes(sizes[-1])}", "", ""])
        head = ["log", "base step", "size", "tensors", "state"]
        return (f"<h3>Bases</h3><p class=\"note\">{timing}</p>"
                + table(head, rows, numeric=(1, 2, 3)))

    def _decisions(self) -> str:
        decisions = [(self.label(f), d) for f in self.logs for d in f.decisions]
        sampled = any(f.meta_sampled for f in self.logs)
        how = (" (from a sample of the records: this log is longer than the page reads in "
               "full)" if sampled else "")
        if not decisions:
            return (f"<h3>Tuner decisions</h3><p class=\"note\">No decision recorded{how}: "
                    "snapshot_every and batch kept their values (or were not "
                    "<code>auto</code>).</p>")
        rows = []
        for who, d in decisions[-MAX_ROWS:]:
            wb, wa = d.predicted_waste_before, d.predicted_waste_after
            waste = (f"{100 * wb:.2f}% → {100 * wa:.2f}%"
                     if wb is not None and wa is not None else DASH)
            rows.append([who, num(d.step), f"{d.previous_snapshot_every} → {d.snapshot_every}",
                         f"{d.previous_batch} → {d.batch}", waste, d.reason])
        return ("<h3>Tuner decisions</h3>" + table(
            ["log", "step", "snapshot_every", "batch", "predicted waste", "why"], rows,
            numeric=(1,)) + (f'<p class="note">{how.strip(" ()")}</p>' if sampled else ""))

    def _compactions(self) -> str:
        """Compactions leave no event in the log: their footprint is history that starts
        after step 0 and bases off the snapshot_every grid."""
        every = self.meta.snapshot_every if self.meta is not None else None
        retuned = any(d.snapshot_every != d.previous_snapshot_every
                      for f in self.logs for d in f.decisions)
        if retuned:
            every = None  # the tuner moved it: there is no one grid to be off
        rows = []
        for f in self.logs:
            first = int(f.steps[0]) if len(f.steps) else None
            start = min([b.step for b in f.bases] + ([first] if first is not None else []),
                        default=None)
            off = [b.step for b in f.bases if every and b.step % every]
            rows.append([self.label(f), num(start), ", ".join(map(str, off[-20:])) or "none",
                         num(f.manifest_generation)])
        grid = (f"bases off the snapshot_every grid (every {every} steps: made by a "
                "compaction or a restart)" if every else "bases off the snapshot_every grid "
                "(none here: the tuner changed snapshot_every)" if retuned else
                "bases off the snapshot_every grid (not known here: the log records no "
                "snapshot_every)")
        return ("<h3>Compactions</h3><p class=\"note\">The log records no compaction event; "
                "this is their footprint: history that starts after step 0 (older bases "
                f"and diffs removed by retention) and {grid}.</p>"
                + table(["log", "history starts at step", "bases off the grid",
                         "manifest generation"], rows, numeric=(1, 3)))

    def _recovery(self) -> str:
        out = ['<section id="recovery"><h2>Recovery</h2>',
               '<p class="note">For each step, what a restore reads (the newest base at or '
               "before it, plus every diff after that base; a streamed base's slices, and "
               "every diff after its first slice, from which it replays) and the diffs it "
               "replays: the saw-tooth falls back at each base.</p>"]
        seconds = any(c.seconds is not None for c in self.curves)
        if self.plots:
            out.append(img(plots.recovery(self._lines(), seconds), "recovery curve"))
        else:
            out.append(self._no_plots())
        if seconds:
            m = self.logs[0].measurements
            out.append(f'<p class="note">Time = base load '
                       f'{m.get("base_load_time", 0.0) * 1e3:.2f} ms + diffs replayed '
                       f'&times; {m.get("replay_cost", 0.0) * 1e3:.3f} ms per diff (the costs '
                       "the checkpointer measured and recorded).</p>")
        else:
            out.append('<p class="note">The log records no measured replay cost: time is '
                       "not estimated.</p>")
        damaged = [(self.label(f), f.damaged_steps) for f in self.logs if f.damaged_steps]
        out += [f'<p class="note">{esc(who)}: the records of step(s) '
                f"{esc(', '.join(map(str, steps[:20])))} are damaged (see Health): no "
                "restore goes through them, the curve leaves out the steps they cut off.</p>"
                for who, steps in damaged]
        rows = []
        intervals = 0
        for f, c in zip(self.logs, self.curves, strict=True):
            mine = self._recovery_rows(f, c, seconds)
            intervals = max(intervals, len(mine))
            rows += mine[-BASE_ROWS:]
        head = ["log", "restore of step", "from base", "diffs replayed", "bytes read",
                "estimated time"]
        newest = (f" (the newest {BASE_ROWS} of {intervals:,} intervals)"
                  if intervals > BASE_ROWS else "")
        out.append(f"<h3>Worst case per base interval{newest}</h3>"
                   + table(head, rows, numeric=(1, 2, 3, 4, 5)))
        out.append("</section>")
        return "\n".join(out)

    def _recovery_rows(self, f: LogFacts, c: Curve, seconds: bool) -> list[list[Any]]:
        """The last restorable step of each base interval (the tooth's top)."""
        if not len(c):
            return [[self.label(f), DASH, "no base: nothing restorable", "", "", ""]]
        last = np.flatnonzero(np.append(c.base[1:] != c.base[:-1], True))
        rows: list[list[Any]] = []
        for i in last:
            t = (f"{float(c.seconds[i]) * 1e3:.1f} ms" if seconds and c.seconds is not None
                 else DASH)
            b, start = int(c.base[i]), int(c.start[i])
            base = num(b) if start == b else f"{num(b)} (streamed: replays from {num(start)})"
            rows.append([self.label(f), num(int(c.steps[i])), base,
                         num(int(c.replayed[i])), human_bytes(int(c.bytes_read[i])), t])
        return rows

    def _bytes(self) -> str:
        by_tensor: dict[str, int] = {}
        by_codec: dict[str, int] = {}
        codec_of: dict[str, str] = {}
        read = 0
        for f in self.logs:
            read += f.meta_read
            for k, v in f.by_tensor.items():
                by_tensor[k] = by_tensor.get(k, 0) + v
            for k, v in f.by_codec.items():
                by_codec[k] = by_codec.get(k, 0) + v
            codec_of.update(f.tensor_codec)
        steps = max((f.meta_read for f in self.logs), default=0)
        out = ['<section id="bytes"><h2>Bytes by tensor and by codec</h2>']
        if not by_tensor:
            out.append('<p class="note">No diff record could be read.</p>')
            return "\n".join([*out, self._base_tensors(), "</section>"])
        total = sum(by_tensor.values())
        top = sorted(by_tensor.items(), key=lambda kv: (-kv[1], kv[0]))
        sampled = any(f.meta_sampled for f in self.logs)
        out.append(f'<p class="note">Stored bytes per step (mean over {read:,} records read'
                   f'{", an even sample of the log" if sampled else ", every record"}'
                   "), after each tensor's codec; the largest first.</p>")
        per = [(k, v / max(steps, 1)) for k, v in top[:TOP_TENSORS]]
        codecs = sorted(by_codec.items(), key=lambda kv: -kv[1])
        left = (img(plots.tensor_bars(per[:15], "Bytes per step by tensor"), "bytes by tensor")
                if self.plots else self._no_plots())
        codec_rows = [[k, human_bytes(v / max(steps, 1)), f"{100 * v / total:.1f}%"]
                      for k, v in codecs]
        out.append(f'<div class="two"><div>{left}</div><div><h3>By codec</h3>'
                   + table(["codec", "bytes per step", "share"], codec_rows, numeric=(1, 2))
                   + "</div></div>")
        rows = [[k, codec_of.get(k, ""), human_bytes(v), f"{100 * v * max(steps, 1) / total:.1f}%"]
                for k, v in per]
        out.append(f"<h3>By tensor (top {min(len(top), TOP_TENSORS)} of {len(top)})</h3>"
                   + table(["tensor", "codec", "bytes per step", "share"], rows,
                           numeric=(2, 3)))
        out += [self._base_tensors(), "</section>"]
        return "\n".join(out)

    def _base_tensors(self) -> str:
        """The newest base's largest tensors (rank 0's for a sharded checkpoint)."""
        f = self.logs[0]
        if not f.bases or not f.bases[-1].tensors:
            return ""
        b = f.bases[-1]
        top = sorted(b.tensors.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
        rows = [[k, human_bytes(v), f"{100 * v / max(sum(b.tensors.values()), 1):.1f}%"]
                for k, v in top]
        return (f"<h3>Newest base (step {b.step:,}, {self.label(f)}): largest tensors</h3>"
                + table(["tensor", "bytes", "share"], rows, numeric=(1, 2)))

    def _ranks(self) -> str:
        rep = self.rep
        out = [f'<section id="ranks"><h2>Ranks</h2><p class="note">{rep.world_size} ranks, '
               f"layout <code>{esc(rep.layout)}</code>; the checkpoint restores to the newest "
               f"step durable on every rank: <b>{num(rep.durable_step)}</b>.</p>"]
        if self.plots:
            out.append(img(plots.ranks([self.label(f) for f in rep.logs],
                                       [f.durable_step for f in rep.logs],
                                       [f.bytes_on_disk for f in rep.logs]), "per rank"))
        rows = []
        for f in rep.logs:
            per = f.record_bytes / f.records if f.records else 0
            rows.append([self.label(f), Raw(f'<span class="badge {f.health}">'
                                            f"{esc(f.health)}</span>"),
                         num(f.durable_step), num(f.last_step), num(f.records),
                         ", ".join(str(b.step) for b in f.bases[-8:]) or "none",
                         human_bytes(per), human_bytes(f.bytes_on_disk), num(len(f.syncs)) if
                         rep.layout == "local" else DASH])
        out.append(table(["rank", "health", "durable step", "last step", "records", "bases",
                          "bytes per step", "bytes on disk", "synchronizations"],
                         rows, numeric=(2, 3, 4, 6, 7, 8)))
        out.append("</section>")
        return "\n".join(out)

    def _metadata(self) -> str:
        out = ['<section id="metadata"><h2>Metadata</h2>']
        rows = self._meta_rows()
        out.append('<div class="two"><div><h3>The run</h3>'
                   + table(["", ""], rows) + "</div><div>" + self._costs() + "</div></div>")
        out.append("</section>")
        return "\n".join(out)

    def _meta_rows(self) -> list[list[Any]]:
        rep, f = self.rep, self.logs[0]
        rows: list[list[Any]] = []
        m = self.meta
        if m is not None:
            comp = m.compressor
            desc = "none"
            if comp is not None:
                opts = ", ".join(f"{k}={v}" for k, v in comp.config.items()
                                 if k not in ("kind", "error_feedback", "ef_state"))
                desc = (f"{comp.kind}({opts})" + (f", error feedback ({comp.ef_state})"
                                                  if comp.error_feedback else ""))
            rows += [["mode", m.mode], ["optimizer", m.optimizer], ["compressor", desc],
                     ["capture", m.capture or DASH],
                     ["declared codec", m.grad_codec or m.delta_codec or "raw"],
                     ["snapshot_every", m.snapshot_every],
                     ["base slices", _base_slices(m.base_slices)],
                     ["digest_every", m.digest_every],
                     ["scheduler", m.scheduler or "none"],
                     ["parameters", f"{len(m.params):,} in {len(m.groups)} group(s)"],
                     ["model tensors", f"{len(m.model):,}"],
                     ["torch, device", f"{m.torch_version}, {m.device}"]]
        elif "torch" in f.meta:
            rows.append(["writer", "the torch checkpointer, but its metadata does not parse "
                                   "(see Health)"])
        else:
            rows.append(["writer", "not the torch checkpointer (no torch metadata)"])
        rows += [["world size", rep.world_size if rep.sharded else 1],
                 ["layout", rep.layout if rep.sharded else "single log"],
                 ["record kinds", ", ".join(f"{k or '?'} \u00d7{v}" for k, v in
                                            sorted(f.kinds.items())) or DASH],
                 ["codecs in the records", ", ".join(sorted({c for g in self.logs
                                                             for c in g.by_codec})) or DASH],
                 ["digests (records read)", f"{sum(g.digests for g in self.logs):,}"],
                 ["segments", f"{sum(g.segments for g in self.logs):,}"]]
        if m is not None and m.shard is not None and m.shard.mesh is not None:
            mesh = m.shard.mesh
            rows.append(["device mesh", " \u00d7 ".join(
                f"{n}={s}" if n else str(s) for n, s in
                zip(mesh.dim_names or ("",) * len(mesh.shape), mesh.shape, strict=False))])
        return rows

    def _costs(self) -> str:
        m = self.logs[0].measurements
        if not m:
            return ('<h3>Measured costs</h3><p class="note">None recorded (the torch '
                    "checkpointer records them at each base and at close).</p>")
        unit = {"iteration_time": "s", "fsync_cost": "s", "base_cost": "s",
                "replay_cost": "s", "base_load_time": "s", "restart_cost": "s",
                "append_cost": "s", "mtbf": "s", "diff_bytes": "B", "write_bandwidth": "B/s"}
        rows = []
        for k, v in m.items():
            u = unit.get(k, "")
            text = (human_bytes(v) if u == "B" else human_bytes(v) + "/s" if u == "B/s"
                    else f"{v * 1e3:.3f} ms" if u == "s" and v < 1 else
                    f"{v:,.1f} s" if u == "s" else f"{v:.3g}")
            rows.append([k, text])
        return "<h3>Measured costs</h3>" + table(["", ""], rows, numeric=(1,))


def _base_slices(bs: BaseSlices | None) -> str:
    """What ``base_slices=k`` did: bases streamed in k slices, or consistent and why."""
    if bs is None:
        return "1 (consistent bases)"
    if bs.in_force > 1 and bs.k == "auto":
        return f"auto, {bs.in_force} at the start (streamed bases, chosen before each)"
    if bs.in_force > 1:
        return f"{bs.in_force} (streamed bases, spec section 7.2)"
    return f"asked {bs.k}; consistent bases taken instead: {bs.why}"


def render(rep: Report, *, with_plots: bool | None = None) -> str:
    """The page of ``rep`` (``with_plots`` None: plots when matplotlib is installed)."""
    return Page(rep, with_plots=with_plots).render()


__all__ = ["Page", "render"]
