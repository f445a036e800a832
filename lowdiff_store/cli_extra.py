"""CLI commands built on the higher layers: ``compact`` and ``tune``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .errors import LowdiffError
from .progress import Progress


def _materializer(path: str) -> Any:
    """The torch layer's base materializer for a log (or sharded checkpoint) written by it,
    when torch is installed; else None (compaction then applies retention only)."""
    from .log.manifest import load_manifest
    from .log.shards import log_paths

    try:
        if not isinstance(load_manifest(log_paths(path)[0]).meta.get("torch"), dict):
            return None
    except LowdiffError:
        return None  # compact() reports the problem with the path
    try:
        from .torch import TorchMaterializer
    except ImportError:
        return None
    return TorchMaterializer(path)


def cmd_compact(args: argparse.Namespace) -> int:
    from .cli import _human_bytes, _print_json
    from .compaction import compact

    with Progress("compact", 1, enabled=None if not args.json else False) as bar:
        res = compact(args.path, step=args.step, keep_bases=args.keep_bases,
                      keep_history_from=args.keep_history_from, dry_run=args.dry_run,
                      materializer=_materializer(args.path), progress=bar)
    if args.json:
        _print_json(res.to_dict())
        return 0
    p = res.plan
    verb = "would delete" if args.dry_run else "deleted"
    if p.new_base is not None:
        print(f"{'would write' if args.dry_run else 'wrote'} base at step {p.new_base}"
              + ("" if args.dry_run else f" ({_human_bytes(res.new_base_bytes)}, "
                 f"{res.materialize_s:.2f} s)"))
    print(f"keep bases: {', '.join(map(str, p.keep_bases))}")
    print(f"{verb} {len(p.delete_bases)} base(s) {p.delete_bases} and "
          f"{len(p.delete_segments)} segment(s), {_human_bytes(p.bytes_freed)}")
    print(f"disk: {_human_bytes(p.bytes_before)} -> {_human_bytes(res.bytes_after)}")
    for n in p.notes:
        print(f"note: {n}", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .cli import _print_json
    from .tuning_from_log import recommend_for_log

    rec = recommend_for_log(args.path, mtbf=args.mtbf)
    d = rec.to_dict()
    if args.json:
        _print_json(d)
        return 0
    print(f"snapshot_every  {d['snapshot_every']}")
    print(f"batch           {d['batch']}")
    print(f"overhead        {100 * d['expected_overhead']:.2f}% of training time")
    print(f"lost work       {d['expected_lost_work_s']:.1f} s per failure (expected)")
    print(f"recovery        {d['recovery_time_s']:.1f} s")
    if d.get("reason"):
        print(f"why             {d['reason']}")
    return 0


def register(sub: Any) -> None:
    """Add the commands to the CLI's subparsers."""
    s = sub.add_parser("compact", help="materialize a new base and delete what retention "
                                       "no longer needs")
    s.add_argument("path", help="log directory")
    s.add_argument("--step", type=int, default=None,
                   help="step of the new base (default: the newest durable step)")
    s.add_argument("--keep-bases", type=int, default=2, metavar="K",
                   help="keep the newest K bases and every diff after the oldest (default 2)")
    s.add_argument("--keep-history-from", type=int, default=None, metavar="STEP",
                   help="also keep time-travel history from STEP on")
    s.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_compact)

    s = sub.add_parser("tune", help="recommend snapshot_every and batch from the log's "
                                    "measured costs")
    s.add_argument("path", help="log directory")
    s.add_argument("--mtbf", type=float, required=True, metavar="SECONDS",
                   help="mean time between failures of the job, in seconds")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_tune)
