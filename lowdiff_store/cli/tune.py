"""``lowdiff-store tune``: recommend ``snapshot_every`` and ``batch`` for a finished run."""

from __future__ import annotations

import argparse
import math
from typing import Any

from .output import EXIT_OK, positive_seconds, print_json


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds >= 0")
    return x


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "tune", help="recommend snapshot_every and batch from the log's measured costs",
        description="Recommend snapshot_every (F) and batch (B) for this job from the costs "
                    "the log recorded (iteration time, diff bytes, append and fsync cost, "
                    "base stall, base load, replay cost) and the job's mean time between "
                    "failures, with the expected overhead, lost work per failure and "
                    "recovery time (restart + base read + replay).")
    s.add_argument("path", help="log directory")
    s.add_argument("--mtbf", type=positive_seconds, required=True, metavar="SECONDS",
                   help="mean time between failures of the job, in seconds (> 0)")
    s.add_argument("--restart-cost", type=_seconds, metavar="SECONDS",
                   help="time to restart the job before it loads the base (scheduler, "
                        "process start, distributed init), in seconds (>= 0); no log can "
                        "measure it: 60 s is assumed when not given")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def _secs(x: float) -> str:
    """Seconds with one decimal, or two significant digits below 0.1 s (a base read of
    12 ms is not "0.0 s")."""
    return f"{x:.1f} s" if x >= 0.1 or x == 0 else f"{x:.2g} s"


def recovery_line(rec: dict[str, Any], *, restart_assumed: bool) -> str:
    """``63.9 s = restart 60.0 s (assumed, --restart-cost) + base read 0.012 s + replay
    3.9 s (175.0 diffs)``: the mean recovery time per failure and its parts."""
    p = rec["recovery"]
    restart = "assumed, --restart-cost" if restart_assumed else "given"
    base = "" if p["base_read_s"] > 0 else " (not measured)"
    return (f"{_secs(p['total_s'])} = restart {_secs(p['restart_s'])} ({restart}) + base "
            f"read {_secs(p['base_read_s'])}{base} + replay {_secs(p['replay_s'])} "
            f"({p['replay_diffs']:.1f} diffs)")


def run(args: argparse.Namespace) -> int:
    """Print the recommendation."""
    from ..tuning_from_log import recommend_for_log

    rec = recommend_for_log(args.path, mtbf=args.mtbf, restart_cost=args.restart_cost)
    d = rec.to_dict()
    assumed = args.restart_cost is None
    d["recovery"]["restart_assumed"] = assumed
    if args.json:
        print_json(d)
        return EXIT_OK
    print(f"snapshot_every  {d['snapshot_every']}")
    print(f"batch           {d['batch']}")
    print(f"overhead        {100 * d['expected_overhead']:.2f}% of training time")
    print(f"lost work       {d['expected_lost_work_s']:.1f} s per failure (expected)")
    print(f"recovery        {recovery_line(d, restart_assumed=assumed)}")
    if d["base_slices"] > 1:
        print(f"base_slices     {d['base_slices']} (streamed bases: a restore replays "
              f"{d['base_slices'] - 1} more diffs, in the recovery figures)")
    if d.get("reason"):
        print(f"why             {d['reason']}")
    return EXIT_OK
