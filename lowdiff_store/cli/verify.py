"""``lowdiff-store verify``: read every byte; exit 3 when the log has problems."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .output import EXIT_CORRUPT, EXIT_OK, human_bytes, print_json, progress


def register(sub: Any) -> None:
    """Add the command to the CLI's subparsers."""
    s = sub.add_parser(
        "verify", help="read every byte: check every CRC, index entry and base",
        description="Read every byte of the log: every segment header and record checksum, "
                    "every record's metadata, every index entry against the data, every "
                    "tensor of every base and of every slice of a streamed base. One line "
                    "per problem on stdout (FILE:OFFSET: REASON: detail), a summary on "
                    "stderr; exit 3 when a problem was found. "
                    "A torn tail left by a crash is not a problem.")
    s.add_argument("path", help="log directory (or sharded checkpoint directory)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Verify and report."""
    from ..log.manifest import load_manifest
    from ..log.shards import is_sharded, read_shards_manifest
    from ..verify import verify_log

    # A path that is no log at all (missing, not a directory, unreadable or newer-version
    # manifest) is bad input, exit 1 with one line on stderr; exit 3 is for a log whose
    # contents have problems.
    if is_sharded(args.path):
        read_shards_manifest(args.path)
    else:
        load_manifest(args.path)
    with progress("verify", args, unit="B") as bar:
        rep = verify_log(args.path, progress=bar)
    if args.json:
        print_json(rep.to_dict())
    else:
        for p in rep.problems:
            print(f"{p.path}:{p.offset if p.offset is not None else '-'}: "
                  f"{p.reason.value}: {p.detail}")
        for n in rep.notes:
            print(f"note: {n}", file=sys.stderr)
        status = "ok" if rep.ok else f"{len(rep.problems)} problem(s)"
        tail = f", torn tail of {rep.torn_tail_bytes} bytes ignored" if rep.torn_tail_bytes \
            else ""
        streamed = f" and {rep.streamed} streamed" if rep.streamed else ""
        print(f"{status}: {rep.records} records, {rep.bases} bases{streamed}, "
              f"{human_bytes(rep.bytes_checked)} checked{tail}", file=sys.stderr)
    return EXIT_OK if rep.ok else EXIT_CORRUPT
