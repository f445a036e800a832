"""What every command shares: exit codes, one-line errors, JSON and size printing, the
argument types that turn bad values into usage errors (exit 2), the progress bar choice."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..progress import Progress, human_bytes

#: Exit codes, documented in ``lowdiff-store --help`` and the README.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CORRUPT, EXIT_MISSING_DEP = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130

PROG = "lowdiff-store"


def error(message: str, *, command: str | None = None) -> None:
    """Print ``lowdiff-store[ COMMAND]: error: MESSAGE`` as one line on stderr."""
    prog = f"{PROG} {command}" if command else PROG
    one_line = " ".join(str(message).split())
    print(f"{prog}: error: {one_line}", file=sys.stderr)


def print_json(obj: Any) -> None:
    """One JSON object on one line of stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")


def progress(label: str, args: argparse.Namespace, unit: str = "it") -> Progress:
    """The bar of a long command: drawn on a terminal, never with ``--json``."""
    return Progress(label, 0, enabled=False if getattr(args, "json", False) else None,
                    unit=unit)


# ---------------------------------------------------------------- argument value types


def _count(text: str, what: str) -> int:
    """``text`` as an integer >= 0, else an argparse error naming ``what`` it should be."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what} (an integer >= 0)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a {what} (an integer >= 0)")
    return n


def step_value(text: str) -> int:
    """A step number: an integer >= 0."""
    return _count(text, "step")


def rank_value(text: str) -> int:
    """A rank: an integer >= 0."""
    return _count(text, "rank")


def rank_problem(path: str, rank: int | None, *, needed: bool) -> str | None:
    """Why ``--rank`` (``rank``, None: not given) does not fit the checkpoint at ``path``,
    or None when it does: a checkpoint of local-update training (``SHARDS`` of layout
    ``"local"``, one replica per rank) takes a rank of its own (``needed``: one must be
    given); any other log or checkpoint takes none."""
    from ..log.shards import is_sharded, read_shards_manifest

    body = read_shards_manifest(path) if is_sharded(path) else None
    if body is None or body.get("layout") != "local":
        if rank is None:
            return None
        what = f"a sharded checkpoint of layout {body.get('layout')!r}" if body else "one log"
        return (f"--rank applies to checkpoints of local-update training (one replica per "
                f"rank); {path} is {what}")
    world = int(body["world_size"])
    if rank is None:
        return (f"{path} holds {world} divergent replicas (local-update training): pass "
                f"--rank R (0..{world - 1})") if needed else None
    if rank >= world:
        return f"--rank {rank}: {path} has ranks 0..{world - 1}"
    return None


def output_problem(out: str, log: str) -> str | None:
    """Why the output ``out`` of a command reading ``log`` is refused, or None: it is a log
    or lies inside one (:func:`lowdiff_store.outputs.check_output`); a usage error
    (exit 2), said before any work."""
    from ..errors import ConfigError
    from ..outputs import check_output

    try:
        check_output(out, [log])
    except ConfigError as e:
        return str(e)
    return None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return n


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds > 0")
    return x


__all__ = [
    "EXIT_CORRUPT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEP",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "error",
    "human_bytes",
    "output_problem",
    "positive_int",
    "positive_seconds",
    "print_json",
    "progress",
    "rank_problem",
    "rank_value",
    "step_value",
]
