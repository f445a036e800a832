"""``lowdiff-store report``: write the HTML page of a log (``lowdiff_store.report``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .output import (
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    error,
    output_problem,
    print_json,
    progress,
)


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "report", help="write a self-contained HTML page: timeline, recovery curve, bytes "
                       "by tensor and codec, health, metadata, ranks",
        description="Write one self-contained HTML page (plots embedded, nothing loaded "
                    "from the network) that shows the log at a glance: record bytes per "
                    "step, bases, tuner decisions, the recovery curve, bytes by tensor and "
                    "by codec, health (verify's findings) and metadata; for a sharded "
                    "checkpoint, every rank side by side. A log that cannot be read still "
                    "gets a page saying what is wrong. Prints the page's path; exit 3 when "
                    "the log has problems (one line each on stdout, FILE:OFFSET: REASON: "
                    "detail), 1 when the path is no log at all. Plots need the report "
                    "extra (pip install 'lowdiff-store[report]').")
    s.add_argument("path", help="log directory (or sharded checkpoint directory)")
    s.add_argument("-o", "--output", metavar="FILE",
                   help="the page to write (default: ./<log directory name>-report.html, or "
                        "beside the log when the current directory is inside it); a "
                        "page inside a log is refused (exit 2)")
    s.add_argument("--check", choices=("auto", "always", "never"), default="auto",
                   help="read every byte as verify does: auto (default) up to 20,000 "
                        "records and 512 MiB, always, or never")
    s.add_argument("--json", action="store_true",
                   help="print the page's summary numbers as one JSON object")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the page; report problems as ``verify`` does."""
    from ..report import default_output, report_log

    out = args.output or default_output(args.path)
    why = output_problem(out, args.path)
    if why is not None:
        error(why, command="report")
        return EXIT_USAGE
    with progress("report", args) as bar:
        rep = report_log(args.path, out, full_check=args.check, progress=bar)
    summary = rep.summary()
    summary["output"] = out
    problems = rep.all_problems()
    if args.json:
        print_json(summary)
    else:
        for p in problems:
            off = p.get("offset")
            print(f"{p.get('path')}:{off if off is not None else '-'}: {p.get('reason')}: "
                  f"{p.get('detail')}")
        print(f"report written to {out} (health {rep.health})", file=sys.stderr)
    if rep.error is not None:
        e = rep.error
        error(f"{e.get('path')}:{e.get('offset') if e.get('offset') is not None else '-'}: "
              f"{e.get('reason')}: {e.get('detail')}")
        return EXIT_ERROR
    return EXIT_OK if not problems else EXIT_CORRUPT
