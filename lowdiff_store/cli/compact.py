"""``lowdiff-store compact``: a new base and retention (see ``docs/compaction.md``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import ConfigError, LowdiffError
from .output import (
    EXIT_OK,
    EXIT_USAGE,
    error,
    human_bytes,
    positive_int,
    print_json,
    progress,
    rank_problem,
    rank_value,
    step_value,
)


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "compact", help="materialize a new base and delete what retention no longer needs",
        description="Materialize a base at a step (default: the newest durable step) by "
                    "replaying from the nearest base, publish it with the retention decision "
                    "in one manifest swap, then delete the bases and sealed segments no "
                    "longer needed. Safe beside a live writer and readers; killing it leaves "
                    "the old or the new state. A checkpoint of local-update training "
                    "(post-local SGD, DiLoCo: one replica per rank) is compacted per "
                    "replica, each from its own shard; every rank stays restorable at the "
                    "newest step durable on all ranks.")
    s.add_argument("path", help="log directory (or sharded checkpoint directory)")
    s.add_argument("--step", type=step_value, default=None, metavar="N",
                   help="step of the new base (default: the newest durable step)")
    s.add_argument("--keep-bases", type=positive_int, default=2, metavar="K",
                   help="keep the newest K >= 1 bases and every diff after the oldest "
                        "(default 2)")
    s.add_argument("--keep-history-from", type=step_value, default=None, metavar="STEP",
                   help="also keep time-travel history from STEP on")
    s.add_argument("--rank", type=rank_value, default=None, metavar="R",
                   help="local-update checkpoints only: compact replica R's shard alone "
                        "(default: every rank); a rank the checkpoint does not have, or "
                        "--rank with another log, is a usage error (exit 2)")
    s.add_argument("--dry-run", action="store_true",
                   help="print what would be written and deleted; change nothing")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def _materializer(path: str) -> Any:
    """The torch layer's base materializer for a log (or sharded checkpoint) written by it,
    when torch is installed; else None (compaction then applies retention only)."""
    from ..log.manifest import load_manifest
    from ..log.shards import log_paths

    try:
        if not isinstance(load_manifest(log_paths(path)[0]).meta.get("torch"), dict):
            return None
    except LowdiffError:
        return None  # compact() reports the problem with the path
    try:
        from ..torch import TorchMaterializer
    except ImportError:
        return None
    return TorchMaterializer(path)


def run(args: argparse.Namespace) -> int:
    """Compact and report."""
    from ..compaction import compact
    from ..log.shards import replay_source

    try:  # a rank directory: a local-update replica of its checkpoint, or refused
        path, rank = replay_source(args.path, args.rank, verb="compact")
    except ConfigError as e:
        error(str(e), command="compact")
        return EXIT_USAGE
    why = rank_problem(path, rank, needed=False)
    if why is not None:
        error(why, command="compact")
        return EXIT_USAGE
    with progress("compact", args) as bar:
        res = compact(path, step=args.step, keep_bases=args.keep_bases,
                      keep_history_from=args.keep_history_from, dry_run=args.dry_run,
                      materializer=_materializer(path), progress=bar, rank=rank)
    if args.json:
        print_json(res.to_dict())
        return EXIT_OK
    p = res.plan
    verb = "would delete" if args.dry_run else "deleted"
    if p.new_base is not None:
        print(f"{'would write' if args.dry_run else 'wrote'} base at step {p.new_base}"
              + ("" if args.dry_run else f" ({human_bytes(res.new_base_bytes)}, "
                 f"{res.materialize_s:.2f} s)"))
    print(f"keep bases: {', '.join(map(str, p.keep_bases))}")
    streamed = "".join(f", streamed base {c} (slices {', '.join(map(str, sl))})"
                       for c, sl in p.delete_streamed)
    print(f"{verb} {len(p.delete_bases)} base(s) {p.delete_bases}{streamed} and "
          f"{len(p.delete_segments)} segment(s), {human_bytes(p.bytes_freed)}")
    print(f"disk: {human_bytes(p.bytes_before)} -> {human_bytes(res.bytes_after)}")
    for n in p.notes:
        print(f"note: {n}", file=sys.stderr)
    return EXIT_OK
