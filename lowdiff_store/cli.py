"""``lowdiff-store``: a thin command line over the public API.

Exit codes (also in the README):
  0  success (``verify``: the log is clean)
  1  error: bad or unreadable input, I/O failure; one line on stderr naming file, offset, reason
  2  usage error (bad arguments)
  3  ``verify`` found problems (one line per problem on stdout)
  4  a needed optional dependency is missing (torch for ``replay``)
  130 interrupted (Ctrl-C)
Set ``LOWDIFF_DEBUG=1`` to get a traceback for unexpected internal errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .errors import LowdiffError
from .progress import Progress

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CORRUPT, EXIT_MISSING_DEP = 0, 1, 2, 3, 4


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def cmd_inspect(args: argparse.Namespace) -> int:
    from .verify import inspect_log

    info = inspect_log(args.path)
    torch_info = _torch_describe(args.path)
    if torch_info is not None:
        info["torch"] = torch_info
    if args.json:
        _print_json(info)
        return EXIT_OK
    if info["sharded"]:
        print(f"sharded checkpoint: {info['world_size']} ranks ({info['layout']}), "
              f"durable step {info['durable_step']}, {info['records']} records, "
              f"{_human_bytes(info['bytes_on_disk'])}, health {info['health']}")
        for i, sh in enumerate(info["shards"]):
            print(f"  rank {i}: {sh['records']} records, bases {sh['bases']}, durable "
                  f"{sh['durable_step']}, {_human_bytes(sh['bytes_per_step'])}/step, "
                  f"health {sh['health']}")
        return EXIT_OK
    ratio = info["ratio_to_dense_fp32"]
    rows = [
        ("log", info["path"]),
        ("log id", info["log_id"]),
        ("health", info["health"] + (f" (torn tail of {info['torn_tail_bytes']} bytes "
                                     "ignored)" if info["torn_tail_bytes"] else "")),
        ("records", info["records"]),
        ("bases at steps", ", ".join(map(str, info["bases"])) or "none"),
        ("first / last / durable step",
         f"{info['first_step']} / {info['last_step']} / {info['durable_step']}"),
        ("segments", info["segments"]),
        ("bytes on disk", _human_bytes(info["bytes_on_disk"])
         + f" (segments {_human_bytes(info['segment_bytes'])}, bases "
           f"{_human_bytes(info['base_bytes'])})"),
        ("bytes per step", _human_bytes(info["bytes_per_step"])),
        ("codecs", ", ".join(f"{k} x{v}" for k, v in sorted(info["codecs"].items())) or "-"),
        ("ratio to dense fp32", f"{ratio:.4f}" if ratio is not None else "-"),
    ]
    if torch_info:
        if "num_tensors" in torch_info:
            rows.append(("model tensors", f"{torch_info['num_tensors']} "
                         f"({torch_info.get('num_elements', 0):,} elements)"))
        keys = ("mode", "optimizer", "snapshot_every", "compressor")
        rows.extend((k.replace("_", " "), torch_info[k]) for k in keys if k in torch_info)
    width = max(len(k) for k, _v in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for p in info["problems"]:
        print(f"problem: {p['path']}:{p['offset']}: {p['reason']}: {p['detail']}")
    return EXIT_OK


def _torch_describe(path: str) -> dict[str, Any] | None:
    try:
        from .torch import describe_log  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        out: dict[str, Any] | None = describe_log(path)
        return out
    except LowdiffError:
        return None


def cmd_verify(args: argparse.Namespace) -> int:
    from .log.manifest import load_manifest
    from .log.shards import is_sharded, read_shards_manifest
    from .verify import verify_log

    # A path that is no log at all (missing, not a directory, unreadable or newer-version
    # manifest) is bad input, exit 1 with one line on stderr; exit 3 is for a log whose
    # contents have problems.
    if is_sharded(args.path):
        read_shards_manifest(args.path)
    else:
        load_manifest(args.path)
    with Progress("verify", 1, enabled=None if not args.json else False) as bar:
        rep = verify_log(args.path, progress=bar)
    if args.json:
        _print_json(rep.to_dict())
    else:
        for p in rep.problems:
            print(f"{p.path}:{p.offset if p.offset is not None else '-'}: "
                  f"{p.reason.value}: {p.detail}")
        for n in rep.notes:
            print(f"note: {n}", file=sys.stderr)
        status = "ok" if rep.ok else f"{len(rep.problems)} problem(s)"
        tail = f", torn tail of {rep.torn_tail_bytes} bytes ignored" if rep.torn_tail_bytes \
            else ""
        print(f"{status}: {rep.records} records, {rep.bases} bases, "
              f"{_human_bytes(rep.bytes_checked)} checked{tail}", file=sys.stderr)
    return EXIT_OK if rep.ok else EXIT_CORRUPT


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        from .torch import export_state, replay_state  # type: ignore[attr-defined]
    except ImportError as e:
        print(f"lowdiff-store: error: replay needs torch ({e}); install lowdiff-store[torch]",
              file=sys.stderr)
        return EXIT_MISSING_DEP
    with Progress("replay", 1, enabled=None if not args.json else False) as bar:
        model_state, opt_state = replay_state(args.path, args.to_step,
                                              with_optimizer=args.with_optimizer,
                                              progress=bar)
    export_state(model_state, args.out, format=args.format, optimizer_state=opt_state)
    summary = {"step": args.to_step, "out": args.out, "format": args.format,
               "tensors": len(model_state), "with_optimizer": bool(args.with_optimizer)}
    if args.json:
        _print_json(summary)
    else:
        print(f"wrote {len(model_state)} tensors at step {args.to_step} to {args.out} "
              f"({args.format})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation tests)."""
    p = _Parser(prog="lowdiff-store",
                description="Inspect, verify and replay lowdiff-store checkpoint logs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("inspect", help="summarize a log: steps, bases, sizes, codecs, health")
    s.add_argument("path", help="log directory")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="read every byte and check every CRC and index entry")
    s.add_argument("path", help="log directory")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("replay", help="materialize the model state at a step into a file")
    s.add_argument("path", help="log directory")
    s.add_argument("--to-step", type=int, required=True, metavar="N", help="step to rebuild")
    s.add_argument("--out", required=True, help="output file")
    s.add_argument("--format", choices=["pt", "safetensors", "hdf5"], default="safetensors",
                   help="output format (default: safetensors)")
    s.add_argument("--with-optimizer", action="store_true",
                   help="also write the optimizer state (names prefixed 'optimizer/')")
    s.add_argument("--json", action="store_true", help="print a JSON summary")
    s.set_defaults(func=cmd_replay)

    _register_optional(sub)
    return p


def _register_optional(sub: Any) -> None:
    """Commands whose modules are optional in a build (compaction, tuning)."""
    try:
        from . import cli_extra
    except ImportError:
        return
    cli_extra.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
        return rc
    except LowdiffError as e:
        print(f"lowdiff-store: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("lowdiff-store: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("LOWDIFF_DEBUG"):
            raise
        print(f"lowdiff-store: error: internal error: {type(e).__name__}: {e} "
              "(set LOWDIFF_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
