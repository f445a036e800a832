"""``lowdiff-store tune``: recommend ``snapshot_every`` and ``batch`` for a finished run."""

from __future__ import annotations

import argparse
from typing import Any

from .output import EXIT_OK, positive_seconds, print_json


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "tune", help="recommend snapshot_every and batch from the log's measured costs",
        description="Recommend snapshot_every (F) and batch (B) for this job from the costs "
                    "the log recorded (iteration time, diff bytes, append and fsync cost, "
                    "base stall, replay cost) and the job's mean time between failures, with "
                    "the expected overhead, lost work per failure and recovery time.")
    s.add_argument("path", help="log directory")
    s.add_argument("--mtbf", type=positive_seconds, required=True, metavar="SECONDS",
                   help="mean time between failures of the job, in seconds (> 0)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the recommendation."""
    from ..tuning_from_log import recommend_for_log

    rec = recommend_for_log(args.path, mtbf=args.mtbf)
    d = rec.to_dict()
    if args.json:
        print_json(d)
        return EXIT_OK
    print(f"snapshot_every  {d['snapshot_every']}")
    print(f"batch           {d['batch']}")
    print(f"overhead        {100 * d['expected_overhead']:.2f}% of training time")
    print(f"lost work       {d['expected_lost_work_s']:.1f} s per failure (expected)")
    print(f"recovery        {d['recovery_time_s']:.1f} s")
    if d.get("reason"):
        print(f"why             {d['reason']}")
    return EXIT_OK
