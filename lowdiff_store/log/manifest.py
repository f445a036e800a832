"""The manifest: the single commit point of the set of live files of a log.

It names the log (a random 16-byte id, also stamped in every segment and index header),
the live segments (by id, with their first step), the live bases (by step) and log-level
metadata. File names are derived from those numbers, never read from the file. Unknown
keys written by a newer minor version are kept when it is rewritten.

Commit: every change is a compare-and-swap through the store's versioned commit
(:meth:`lowdiff_store.storage.Store.commit`): :func:`update_manifest` reads the current
manifest and its token, applies the change, bumps the generation and commits on the token;
if another process (the writer, a compactor) committed in between, it reloads and applies
the change again. On a local directory the commit is a rename of ``MANIFEST`` under
``flock(MANIFEST.lock)``; on an object store a create-only, sequence-numbered object.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LowdiffError, ManifestError, Reason, StorageError
from ..format.constants import MANIFEST_HEADER_SIZE, MANIFEST_NAME, MAX_MANIFEST_BYTES, MAX_STEP
from ..format.framing import pack_manifest, unpack_manifest
from ..storage import CommitConflict, Store, StoreLike, open_store

#: A manifest file is at most its header and the largest body the spec allows.
MAX_MANIFEST_FILE_BYTES = MANIFEST_HEADER_SIZE + MAX_MANIFEST_BYTES

#: Commit attempts of :func:`update_manifest` before it gives up (each conflict means
#: another process committed: progress was made, so this is never reached in practice).
_COMMIT_ATTEMPTS = 1000


@dataclass
class Manifest:
    """In-memory view of a manifest body."""

    log_id: bytes
    generation: int = 0
    next_segment_id: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)  # (segment id, first step)
    bases: list[int] = field(default_factory=list)                 # base steps, ascending
    #: streamed bases (format 1.3): (complete step, slice steps ascending, the last the
    #: complete step), ascending by complete step
    streamed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
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
        if self.streamed:  # (absent when none: a log without one is byte for byte 1.2's)
            body["streamed"] = [[c, list(steps)] for c, steps in self.streamed]
        else:
            body.pop("streamed", None)
        return body

    def base_steps(self) -> list[int]:
        """Every step a restore may start from: the consistent bases and the complete
        steps of the streamed ones, ascending."""
        return sorted(set(self.bases) | {c for c, _s in self.streamed})

    def slice_steps(self) -> set[int]:
        """The steps of every live slice."""
        return {s for _c, steps in self.streamed for s in steps}

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
        streamed = _streamed(body.get("streamed", []), bad)
        known = {"log_id", "generation", "next_segment_id", "segments", "bases", "meta",
                 "streamed"}
        extra = {k: v for k, v in body.items() if k not in known}
        return cls(log_id, ints["generation"], ints["next_segment_id"], out_segs,
                   list(bases), streamed, meta, extra)


def _streamed(entries: Any, bad: Callable[[str], ManifestError]
              ) -> list[tuple[int, tuple[int, ...]]]:
    """The ``streamed`` list of a manifest body, checked (log_format.md section 7.2):
    entries ascending by complete step, each one's slices strictly ascending, at least
    one, the last at its complete step, after the previous entry's complete step."""
    if not isinstance(entries, list):
        raise bad("manifest streamed has the wrong type")
    out: list[tuple[int, tuple[int, ...]]] = []
    for e in entries:
        if (not isinstance(e, list) or len(e) != 2 or type(e[0]) is not int
                or not isinstance(e[1], list) or not e[1]
                or any(type(s) is not int or not 0 <= s <= MAX_STEP for s in e[1])):
            raise bad(f"bad streamed base entry {e!r}")
        steps = tuple(e[1])
        if list(steps) != sorted(set(steps)) or steps[-1] != e[0]:
            raise bad(f"streamed base {e[0]}: slices {list(steps)} are not strictly "
                      f"increasing up to it")
        if out and steps[0] <= out[-1][0]:
            raise bad(f"streamed base {e[0]} starts before the previous one completes")
        out.append((e[0], steps))
    return out


def manifest_path(directory: StoreLike) -> str:
    """Path (or URL) of the manifest of the log in ``directory``."""
    return open_store(directory).path_of(MANIFEST_NAME)


def _shards_hint(store: Store) -> str:
    """For a directory without a MANIFEST that holds rank logs: ``SHARDS`` is what is
    missing. Rank 0 publishes it when the job's checkpointer opens; killed before that,
    while another rank already opened its log, it leaves rank logs and no ``SHARDS``. The
    next open of the job (same world size, every rank) publishes it and goes on."""
    try:
        ranks = sorted({n.split("/", 1)[0] for n in store.list("rank-") if "/" in n})
    except LowdiffError:
        return ""   # the plain answer stands: this listing only explains it
    if not ranks:
        return ""
    return (f"; it holds {', '.join(ranks[:3])}{' ...' if len(ranks) > 3 else ''} but no "
            f"SHARDS: rank 0 did not publish the shards manifest (stopped while the job "
            f"opened its checkpointer); open the checkpointer again on every rank to "
            f"publish it")


def load_manifest_versioned(location: StoreLike) -> tuple[Manifest, str]:
    """The manifest of the log at ``location`` and the token to commit a change on."""
    store = open_store(location)
    path = store.path_of(MANIFEST_NAME)
    try:
        cur = store.read_versioned(MANIFEST_NAME, max_bytes=MAX_MANIFEST_FILE_BYTES)
    except StorageError as e:
        if e.reason is Reason.IO_ERROR:
            raise ManifestError(f"cannot read manifest: {e.detail}", reason=Reason.IO_ERROR,
                                path=path) from e
        raise
    if cur is None:
        raise ManifestError("no MANIFEST: not a lowdiff-store log (or its manifest is lost)"
                            + _shards_hint(store), reason=Reason.NOT_A_LOG, path=store.url)
    try:
        body = unpack_manifest(cur.data)
    except LowdiffError as e:
        raise ManifestError(e.detail, reason=e.reason, path=path, offset=e.offset) from None
    return Manifest.from_body(body, path), cur.token


def load_manifest(location: StoreLike) -> Manifest:
    """Read and validate the manifest of the log at ``location`` (a directory, URL or
    store)."""
    return load_manifest_versioned(location)[0]


def manifest_moved(location: StoreLike, generation: int | None) -> bool:
    """A manifest newer than generation ``generation`` has been published since (False when
    ``generation`` is None or the manifest cannot be read now). A reader that met a file
    missing asks this: a compaction deletes files only after publishing a manifest that no
    longer names them, so a moved manifest means "read again", not "the log is damaged"."""
    if generation is None:
        return False
    try:
        return load_manifest(location).generation != generation
    except LowdiffError:
        return False


def create_manifest(store: Store, manifest: Manifest) -> None:
    """Commit the first manifest of a new log (fails with ``commit_conflict`` if one
    exists)."""
    manifest.generation += 1
    store.commit(MANIFEST_NAME, [pack_manifest(manifest.to_body())], expect=None)


def publish_manifest(location: StoreLike, manifest: Manifest) -> None:
    """Replace the manifest by ``manifest`` (bumping its generation), whatever is there now.
    Callers that may race with another process (a writer and a compactor) use
    :func:`update_manifest`, which applies a change to the current manifest instead."""
    store = open_store(location)
    for _ in range(_COMMIT_ATTEMPTS):
        _cur, token = load_manifest_versioned(store)
        try:
            store.commit(MANIFEST_NAME, [pack_manifest({**manifest.to_body(),
                                                        "generation": manifest.generation + 1})],
                         expect=token)
        except CommitConflict:
            continue
        manifest.generation += 1
        return
    raise CommitConflict("the manifest keeps changing", path=store.path_of(MANIFEST_NAME))


def update_manifest(location: StoreLike, change: Callable[[Manifest], None]) -> Manifest:
    """Apply ``change`` to the current manifest and commit it (compare-and-swap on its
    token; on a conflict, reload and apply ``change`` again, so it must depend only on the
    manifest it is given). Returns the manifest committed."""
    store = open_store(location)
    for _ in range(_COMMIT_ATTEMPTS):
        m, token = load_manifest_versioned(store)
        change(m)
        m.generation += 1
        try:
            store.commit(MANIFEST_NAME, [pack_manifest(m.to_body())], expect=token)
        except CommitConflict:
            continue
        return m
    raise CommitConflict("the manifest keeps changing", path=store.path_of(MANIFEST_NAME))


__all__ = ["MAX_MANIFEST_FILE_BYTES", "Manifest", "create_manifest", "load_manifest",
           "load_manifest_versioned", "manifest_moved", "manifest_path", "publish_manifest",
           "update_manifest"]
