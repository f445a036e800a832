"""The parser and the entry point: every library error becomes one line and an exit code."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from . import compact, inspect, replay, report, tune, verify
from .output import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    error,
)

#: The commands, in the order ``--help`` lists them.
COMMANDS = (inspect, verify, replay, compact, tune, report)

EXIT_CODES = """\
exit codes:
  0    success (verify: the log is clean; a torn tail left by a crash is not a problem)
  1    error: bad or unreadable input, I/O failure (full disk, read-only place); one line
       on stderr naming file, offset and reason
  2    usage error (bad arguments or values; an output inside a log: refused, nothing
       written)
  3    verify or report found problems (one line each on stdout: FILE:OFFSET: REASON:
       detail)
  4    a needed optional dependency is missing (torch for replay)
  130  interrupted (Ctrl-C)

No command prints a traceback; LOWDIFF_DEBUG=1 shows one for internal errors.
Long commands draw a progress bar (rate, ETA) on a terminal, none when piped."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation tests)."""
    from .. import __version__
    from ..format.constants import FORMAT_MAJOR, FORMAT_MINOR

    p = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Inspect, verify, replay, compact, tune and report on "
                            "lowdiff-store checkpoint logs.",
                epilog=EXIT_CODES)
    p.add_argument("--version", action="version",
                   version=f"{PROG} {__version__} (log format {FORMAT_MAJOR}.{FORMAT_MINOR})")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser,
                           title="commands", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # `lowdiff-store inspect ... | head`
        _quiet_stdout()
        return EXIT_OK
    except Exception as e:
        return _failed(e)


def _failed(e: Exception) -> int:
    from ..errors import LowdiffError

    if isinstance(e, LowdiffError):
        error(str(e))
        return EXIT_ERROR
    if isinstance(e, OSError) and e.errno is not None:
        # an I/O failure the library did not wrap: still bad luck with the disk, not a bug
        where = f"{e.filename}: " if e.filename is not None else ""
        error(f"{where}io_error: {e.strerror or e} (errno {e.errno})")
        return EXIT_ERROR
    if os.environ.get("LOWDIFF_DEBUG"):  # a bug, not bad input: still one line unless so
        raise e
    error(f"internal error: {type(e).__name__}: {e} (set LOWDIFF_DEBUG=1 for a traceback)")
    return EXIT_ERROR


def _interrupted() -> int:
    # A second Ctrl-C while we print and unwind ends the process at once (no traceback).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        print(f"{PROG}: interrupted", file=sys.stderr)
    except OSError:
        pass
    return EXIT_INTERRUPTED


def _quiet_stdout() -> None:
    # stdout's reader is gone: point it at /dev/null so the final flush does not fail
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
