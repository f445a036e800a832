"""The seam between the torch adapters and the writer layer (:mod:`lowdiff_store.writer`).

The checkpointer hands over encoded tensors it owns (``owned=True``: the writer makes no
second copy) and bases written in the background; it gets durability, history truncation
and log metadata back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ...errors import ConfigError, LowdiffError
from ...format.constants import MANIFEST_NAME
from ...log.manifest import MAX_MANIFEST_FILE_BYTES
from ...storage import open_store
from ...writer import AsyncLogWriter, TensorSpec
from ..core.specs import Spec

#: DiffCheckpointer keyword arguments passed through to :class:`AsyncLogWriter`.
WRITER_OPTIONS = ("max_batch_bytes", "max_delay_s", "memory_budget", "segment_bytes")


class LogSink(Protocol):
    """What the checkpointer hands its steps to: :class:`Sink` (the writer's threads in this
    process) or :class:`~lowdiff_store.torch.capture.process_sink.ProcessSink` (a writer
    process fed through a ring); each method as :class:`Sink`'s."""

    @property
    def bases(self) -> list[int]:
        """Steps of the bases published (or handed over, for a writer process)."""
    @property
    def last_step(self) -> int:
        """Newest step appended (or base written); -1 for an empty log."""
    @property
    def durable_step(self) -> int | None:
        """Newest step durable with every step before it and reachable from a base."""
    @property
    def batch(self) -> int:
        """Records per group commit in force."""
    def append(self, step: int, specs: Sequence[Spec], *, kind: str, side: Mapping[str, Any],
               extra: Mapping[str, Any], done: Callable[[], None] | None = None) -> None:
        """Hand over the record of ``step``; ``done`` runs once its arrays are free."""
    def write_base(self, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                   meta: Mapping[str, Any], release: Callable[[], None],
                   crcs: Mapping[str, int] | None = None) -> None:
        """Hand over the base of ``step``; ``release`` runs once its arrays are free."""
    def flush(self) -> int | None:
        """Block until everything handed over is durable; returns the durable step."""
    def truncate_after(self, step: int) -> int:
        """Discard every record and base after ``step``; returns the records dropped."""
    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata."""
    def stats(self) -> dict[str, float]:
        """The writer's counters, and ``process``: 1.0 for a writer process, 0.0 for the
        writer's threads in this process."""
    def set_batch(self, batch: int) -> None:
        """Records per group commit from now on."""
    def close(self) -> None:
        """Flush and close (idempotent); raises a failure not yet raised."""
    def close_quietly(self) -> None:
        """Close after the owner was dropped without ``close()``, raising nothing."""


class Sink:
    """Records and bases of one log."""

    def __init__(self, path: str, *, meta: Mapping[str, Any], batch: int,
                 options: Mapping[str, Any]) -> None:
        unknown = set(options) - set(WRITER_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown writer option(s) {sorted(unknown)}")
        self._w = AsyncLogWriter(path, batch=batch, meta=dict(meta), **options)

    @property
    def bases(self) -> list[int]:
        """Steps of the published bases."""
        return list(self._w.log.manifest.bases)

    @property
    def last_step(self) -> int:
        """Newest step appended (or base written); -1 for an empty log."""
        return int(self._w.last_step)

    @property
    def durable_step(self) -> int | None:
        """Newest step durable with every step before it, and reachable from a base (a diff
        made durable before the first base is published is not yet restorable)."""
        d = self._w.durable_step
        return None if d is None or not self._w.log.manifest.bases else int(d)

    def append(self, step: int, specs: Sequence[Spec], *, kind: str, side: Mapping[str, Any],
               extra: Mapping[str, Any], done: Callable[[], None] | None = None) -> None:
        """Append the record of ``step``; ``done`` runs once the writer no longer needs the
        arrays of ``specs`` (the record is written, or failed)."""
        ts = [TensorSpec(s.name, s.tag, encoded=s.enc, shape=s.shape, zstd=s.zstd)
              for s in specs]
        # (released once written: an s3:// log may make it durable seconds later)
        self._w.append(step, ts, kind=kind, side=dict(side), extra=dict(extra), owned=True,
                       on_release=done)

    def write_base(self, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                   meta: Mapping[str, Any], release: Callable[[], None],
                   crcs: Mapping[str, int] | None = None) -> None:
        """Write the base of ``step`` in the background from arrays nobody changes until
        ``release()`` is called (once the base is written, or failed); ``crcs``: the
        CRC32Cs of the arrays the copy already computed."""
        self._w.write_base(step, dict(tensors), dict(meta), owned=True, release=release,
                           crcs=crcs)

    def flush(self) -> int | None:
        """Block until everything handed over is durable; returns the durable step."""
        self._w.flush()
        return self.durable_step

    def truncate_after(self, step: int) -> int:
        """Discard every record and base after ``step``."""
        return int(self._w.truncate_after(step))

    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata."""
        self._w.update_meta(meta)

    def stats(self) -> dict[str, float]:
        """The writer's counters; ``process``: 0.0 (this process's threads)."""
        return {**self._w.stats(), "process": 0.0}

    def set_batch(self, batch: int) -> None:
        """Records per group commit from now on (see ``AsyncLogWriter.set_batch``)."""
        self._w.set_batch(batch)

    @property
    def batch(self) -> int:
        """Records per group commit in force."""
        return int(self._w.batch)

    def close(self) -> None:
        """Flush and close. Idempotent."""
        self._w.close()

    def close_quietly(self) -> None:
        """Close after the owner was dropped without ``close()``: a failure is not raised
        (no step that was not durable was ever promised)."""
        try:
            self._w.close()
        except (LowdiffError, OSError):
            pass


def manifest_exists(path: str) -> bool:
    """``path`` (a directory or URL) already holds a log: its manifest has a committed
    version (an object store keeps ``MANIFEST.<seq>`` objects, not one ``MANIFEST``)."""
    store = open_store(path)
    return store.read_versioned(MANIFEST_NAME, max_bytes=MAX_MANIFEST_FILE_BYTES) is not None


__all__ = ["WRITER_OPTIONS", "LogSink", "Sink", "manifest_exists"]
