"""The manifest: the single commit point of the set of live files of a log.

It names the log (a random 16-byte id, also stamped in every segment and index header),
the live segments (by id, with their first step), the live bases (by step) and log-level
metadata. File names are derived from those numbers, never read from the file. It is
replaced atomically (temp file, fsync, rename, directory fsync); unknown keys written by a
newer minor version are kept when it is rewritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import LowdiffError, ManifestError, Reason
from ..format.constants import MANIFEST_NAME, MAX_STEP
from ..format.framing import pack_manifest, unpack_manifest
from ..storage import atomic_write


@dataclass
class Manifest:
    """In-memory view of a manifest body."""

    log_id: bytes
    generation: int = 0
    next_segment_id: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)  # (segment id, first step)
    bases: list[int] = field(default_factory=list)                 # base steps, ascending
    meta: dict[str, Any] = field(default_factory=dict)             # log-level, opaque to core
    extra: dict[str, Any] = field(default_factory=dict)            # unknown keys, preserved

    @classmethod
    def new(cls, meta: dict[str, Any] | None = None) -> Manifest:
        """A fresh manifest with a random log id."""
        return cls(log_id=uuid.uuid4().bytes, meta=dict(meta or {}))

    def to_body(self) -> dict[str, Any]:
        """The msgpack body."""
        body = dict(self.extra)
        body.update({
            "log_id": self.log_id,
            "generation": self.generation,
            "next_segment_id": self.next_segment_id,
            "segments": [list(s) for s in self.segments],
            "bases": list(self.bases),
            "meta": self.meta,
        })
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any], path: str) -> Manifest:
        """Validate a decoded body."""
        def bad(detail: str) -> ManifestError:
            return ManifestError(detail, reason=Reason.BAD_METADATA, path=path)

        log_id = body.get("log_id")
        if not isinstance(log_id, bytes) or len(log_id) != 16:
            raise bad("manifest has no valid log_id")
        ints = {k: body.get(k, 0) for k in ("generation", "next_segment_id")}
        for k, v in ints.items():
            if type(v) is not int or v < 0:
                raise bad(f"manifest field {k} is not a non-negative integer")
        segs = body.get("segments", [])
        bases = body.get("bases", [])
        meta = body.get("meta", {})
        if not isinstance(segs, list) or not isinstance(bases, list) or not isinstance(meta,
                                                                                      dict):
            raise bad("manifest segments/bases/meta have the wrong type")
        out_segs: list[tuple[int, int]] = []
        for s in segs:
            if (not isinstance(s, list) or len(s) < 2 or type(s[0]) is not int
                    or type(s[1]) is not int or not 0 <= s[0] < ints["next_segment_id"]
                    or not 0 <= s[1] <= MAX_STEP):
                raise bad(f"bad segment entry {s!r}")
            if out_segs and (s[0] <= out_segs[-1][0] or s[1] < out_segs[-1][1]):
                raise bad("segments are not in increasing order")
            out_segs.append((s[0], s[1]))
        for b in bases:
            if type(b) is not int or not 0 <= b <= MAX_STEP:
                raise bad(f"bad base entry {b!r}")
        if bases != sorted(set(bases)):
            raise bad("bases are not strictly increasing")
        known = {"log_id", "generation", "next_segment_id", "segments", "bases", "meta"}
        extra = {k: v for k, v in body.items() if k not in known}
        return cls(log_id, ints["generation"], ints["next_segment_id"], out_segs,
                   list(bases), meta, extra)


def manifest_path(directory: str) -> str:
    """Path of the manifest of the log in ``directory``."""
    return os.path.join(directory, MANIFEST_NAME)


def load_manifest(directory: str) -> Manifest:
    """Read and validate the manifest of ``directory``."""
    path = manifest_path(directory)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ManifestError("no MANIFEST: not a lowdiff-store log (or its manifest is lost)",
                            reason=Reason.NOT_A_LOG, path=directory) from None
    except OSError as e:
        raise ManifestError(f"cannot read manifest: {e.strerror}", reason=Reason.IO_ERROR,
                            path=path) from e
    try:
        body = unpack_manifest(data)
    except LowdiffError as e:
        raise ManifestError(e.detail, reason=e.reason, path=path, offset=e.offset) from None
    return Manifest.from_body(body, path)


def publish_manifest(directory: str, manifest: Manifest) -> None:
    """Atomically replace the manifest (bumping its generation). Callers that may race
    with another process (a writer and a compactor) use :func:`update_manifest`."""
    manifest.generation += 1
    atomic_write(manifest_path(directory), [pack_manifest(manifest.to_body())])


@contextlib.contextmanager
def manifest_lock(directory: str) -> Iterator[None]:
    """Exclusive lock (``MANIFEST.lock``) around a read-modify-publish of the manifest.

    The writer and a compactor in another process both change the manifest; each reloads
    it under this lock, applies its change and publishes, so no update is lost.
    """
    path = os.path.join(directory, "MANIFEST.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update_manifest(directory: str, change: Callable[[Manifest], None]) -> Manifest:
    """Reload the manifest under :func:`manifest_lock`, apply ``change``, publish it."""
    with manifest_lock(directory):
        m = load_manifest(directory)
        change(m)
        publish_manifest(directory, m)
        return m


def try_lock(directory: str, name: str) -> int | None:
    """Take ``DIR/name`` exclusively without waiting: a file descriptor, or None if another
    process holds it. Close the descriptor to release."""
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


__all__ = ["Manifest", "load_manifest", "manifest_lock", "manifest_path", "publish_manifest",
           "try_lock", "update_manifest"]
