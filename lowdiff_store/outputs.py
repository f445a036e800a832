"""Outputs: the files the CLI and the library write for readers outside the log (the report
page, replay's exported file or checkpoint directory), published by one helper,
:func:`publish_output`.

Two promises, in one place:

- **Atomic, and never through a planted name.** The content goes to a new temp file (or
  directory) beside the destination, created exclusively under a unique name
  (``O_CREAT|O_EXCL|O_NOFOLLOW``; :func:`~lowdiff_store.storage.atomic_publish`,
  :func:`~lowdiff_store.storage.atomic_publish_dir`), then fsync, rename, fsync of the
  directory. A symlink or file already at a temp name is never opened.
- **Never onto a log.** A destination that is a log directory, or lies inside one, is
  refused (``ConfigError``, reason ``not_allowed``) before anything is written: a log's
  directory holds only the log's own files, and an output there could replace its
  ``MANIFEST``, a segment or a base. Paths are compared resolved (``.``, ``..``, relative
  paths, symlinks). A directory is a log when it holds a ``MANIFEST`` or a ``SHARDS`` file
  starting with its magic, at any level above the destination, so every rank of a sharded
  checkpoint counts as part of it; the logs an output is made from (``logs=``) count even
  when their manifest is missing or damaged, and so do their rank directories wherever
  their links point.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from typing import BinaryIO, Literal, overload

from .errors import ConfigError, Reason
from .format.constants import MANIFEST_MAGIC, MANIFEST_NAME, SHARDS_MAGIC, SHARDS_NAME
from .storage import atomic_publish, atomic_publish_dir

PathLike = str | os.PathLike[str]

#: The files whose magic marks a directory as a log (one log, or a sharded checkpoint).
_MARKERS = ((MANIFEST_NAME, MANIFEST_MAGIC), (SHARDS_NAME, SHARDS_MAGIC))


def _is_log_dir(d: str) -> bool:
    """Whether ``d`` holds a ``MANIFEST`` or ``SHARDS`` file that starts with its magic (a
    distutils ``MANIFEST`` does not make a log). Never blocks on a FIFO there."""
    for name, magic in _MARKERS:
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(magic)) == magic:
                return True
        except OSError:
            pass
        finally:
            os.close(fd)
    return False


def _source_roots(logs: Iterable[PathLike]) -> dict[str, str]:
    """Resolved directory -> the log it belongs to (as given), for the logs an output is
    made from: each log, and each ``rank-*`` entry of a sharded one wherever it points.
    URLs (object stores) hold no local files and are skipped."""
    roots: dict[str, str] = {}
    for log in logs:
        given = os.fspath(log)
        if "://" in given:
            continue
        real = os.path.realpath(given)
        roots[real] = os.path.abspath(given)
        try:
            with os.scandir(real) as it:
                ranks = [e.path for e in it if e.name.startswith("rank-")]
        except OSError:
            continue
        for r in ranks:
            roots.setdefault(os.path.realpath(r), os.path.abspath(given))
    return roots


def enclosing_log(path: PathLike, logs: Iterable[PathLike] = ()) -> str | None:
    """The outermost log directory that ``path`` is, or lies inside (a sharded
    checkpoint's root for a path in any of its ranks), or None. ``path`` need not exist;
    it is resolved (``.``, ``..``, symlinks: its directory's, and its own when it is a
    link). ``logs``: logs that count as such even without a readable ``MANIFEST``."""
    roots = _source_roots(logs)
    absolute = os.path.abspath(os.fspath(path))
    found: str | None = None
    # the name as rename will see it (its directory resolved), and the file a link names
    for real in dict.fromkeys([os.path.join(os.path.realpath(os.path.dirname(absolute)),
                                            os.path.basename(absolute)),
                               os.path.realpath(absolute)]):
        d = real
        while True:
            if d in roots:
                found = roots[d]
            elif _is_log_dir(d):
                found = os.path.realpath(d)  # ``d`` itself may be a link to a log
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        if found is not None:
            return found
    return None


def check_output(dest: PathLike, logs: Iterable[PathLike] = ()) -> None:
    """Refuse an output at ``dest`` that is a log or lies inside one (:func:`enclosing_log`;
    ``logs``: the logs it is made from): :class:`ConfigError` with reason ``not_allowed``
    naming ``dest`` and the log."""
    root = enclosing_log(dest, logs)
    if root is not None:
        raise ConfigError(f"refused: the output would be inside the log {root} (a log's "
                          f"directory holds only the log's own files); write it elsewhere",
                          reason=Reason.NOT_ALLOWED, path=os.fspath(dest))


@overload
def publish_output(dest: PathLike, fill: Callable[[BinaryIO], object], *,
                   logs: Iterable[PathLike] = (), directory: Literal[False] = False) -> int: ...


@overload
def publish_output(dest: PathLike, fill: Callable[[str], object], *,
                   logs: Iterable[PathLike] = (), directory: Literal[True]) -> int: ...


def publish_output(dest: PathLike, fill: Callable[[BinaryIO], object] | Callable[[str], object],
                   *, logs: Iterable[PathLike] = (), directory: bool = False) -> int:
    """Publish an output at ``dest``, the one way every output is written: refused inside a
    log (:func:`check_output`), then published atomically through a unique temp name.
    ``fill`` writes the content: to a file object, or (``directory``) into the temp
    directory whose path it gets, for a checkpoint directory (``dest`` must not exist, or
    be an empty directory). Returns the bytes published; :class:`StorageError` when
    ``dest`` cannot be written, ``dest`` then untouched and no temp left."""
    check_output(dest, logs)
    if directory:
        return atomic_publish_dir(dest, fill)  # type: ignore[arg-type]
    return atomic_publish(dest, fill)  # type: ignore[arg-type]


__all__ = ["check_output", "enclosing_log", "publish_output"]
