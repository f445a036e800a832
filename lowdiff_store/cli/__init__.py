"""``lowdiff-store``: a thin command line over the public API.

One module per command (``inspect``, ``verify``, ``replay``, ``compact``, ``tune``,
``report``: each
parses its arguments and calls the library), :mod:`.output` for what they share (exit
codes, one-line errors, JSON, argument value types), :mod:`.main` for the parser and the
entry point. Nothing outside this package imports it.

Exit codes (also in ``lowdiff-store --help`` and the README):
  0   success (``verify``: the log is clean)
  1   error: bad or unreadable input, I/O failure; one line on stderr naming file, offset,
      reason
  2   usage error (bad arguments or values)
  3   ``verify`` (or ``report``) found problems (one line per problem on stdout)
  4   a needed optional dependency is missing (torch for ``replay``)
  130 interrupted (Ctrl-C)
Set ``LOWDIFF_DEBUG=1`` to get a traceback for unexpected internal errors.
"""

from .main import build_parser, main
from .output import (
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_MISSING_DEP,
    EXIT_OK,
    EXIT_USAGE,
)

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEP",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "main",
]
