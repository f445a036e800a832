"""``lowdiff-store report``: one self-contained HTML page that shows a log at a glance.

:func:`report_log` reads a log (or a sharded checkpoint) through the log layer
(:mod:`.facts`), reduces its per-step series (:mod:`.series`) and writes the page
(:mod:`.html`), with plots (:mod:`.plots`) when matplotlib is installed (the ``report``
extra). Torch-free: a torch log's metadata is read through :mod:`lowdiff_store.torchmeta`.
A log that cannot be read still gets a page that says what is wrong (file, offset,
reason). See ``docs/report.md``.
"""

from __future__ import annotations

import os

from ..outputs import check_output, enclosing_log, publish_output
from ..progress import ProgressFn
from .facts import (
    FULL_CHECK_BYTES,
    FULL_CHECK_RECORDS,
    META_READ_ALL,
    META_SAMPLE,
    FullCheck,
    LogFacts,
    Report,
    collect,
)
from .html import render
from .series import MAX_POINTS


def default_output(path: str | os.PathLike[str]) -> str:
    """Where the page goes when no output is named: ``<log directory name>-report.html``
    in the current directory, or, when the current directory is inside a log (``report .``
    run in the log's own directory, or in a rank of a sharded checkpoint), beside the
    outermost log directory: never inside a log, whose directory holds only the log's own
    files (:func:`~lowdiff_store.outputs.enclosing_log`)."""
    name = os.path.basename(os.path.abspath(os.fspath(path)).rstrip(os.sep))
    page = f"{name or 'log'}-report.html"
    here = enclosing_log(os.getcwd(), [path])
    return page if here is None else os.path.join(os.path.dirname(here), page)


def report_log(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
               full_check: FullCheck = "auto", plots: bool | None = None,
               progress: ProgressFn | None = None) -> Report:
    """Write the report page of the log (or sharded checkpoint) at ``path`` to ``out``
    (default: :func:`default_output`) and return what it shows. The page is published
    like every output (:func:`~lowdiff_store.outputs.publish_output`): atomically,
    through a unique temp name, and never inside a log.

    Never raises for bad data: a log that cannot be read, or read only in part, gets a
    page saying what is wrong (``Report.health``, ``Report.all_problems()``). Raises
    :class:`~lowdiff_store.errors.StorageError` when ``out`` cannot be written, and
    :class:`~lowdiff_store.errors.ConfigError` (``not_allowed``) before reading anything
    when ``out`` is a log or lies inside one (this log or any other).
    ``full_check``: ``"auto"`` runs ``verify``'s every-byte check on logs up to
    :data:`FULL_CHECK_RECORDS` records and :data:`FULL_CHECK_BYTES` bytes; ``"always"``
    or ``"never"`` decide. ``plots``: None draws them when matplotlib is installed.
    """
    target = os.fspath(out) if out is not None else default_output(path)
    check_output(target, [path])  # before the work: a refusal costs nothing
    rep = collect(path, full_check=full_check, progress=progress)
    page = render(rep, with_plots=plots).encode("utf-8")
    publish_output(target, lambda f: f.write(page), logs=[path])
    return rep


__all__ = ["FULL_CHECK_BYTES", "FULL_CHECK_RECORDS", "MAX_POINTS", "META_READ_ALL",
           "META_SAMPLE", "FullCheck", "LogFacts", "Report", "collect", "default_output",
           "render", "report_log"]
