"""The store interface: what the log needs from the place its bytes live.

A :class:`Store` holds named *objects* (``MANIFEST``, ``seg-....ldlog``,
``rank-00000/MANIFEST``): names are relative, ``/``-separated, without ``.``/``..``
components. The primitives are chosen so that a local directory (:class:`LocalStore`) and an
S3-compatible object store can both implement them without a rename on the commit path:

- read: :meth:`Store.exists`, :meth:`Store.size`, :meth:`Store.list`, :meth:`Store.open`
  (a :class:`Source` for ranged reads), :meth:`Store.read` (a whole object, capped);
- write: :meth:`Store.create` (write-once: refuses an existing name), :meth:`Store.publish`
  (atomic replace of a whole object), :meth:`Store.open_append` (an :class:`AppendHandle`:
  the active segment and its index), :meth:`Store.delete` (durable, idempotent);
- coordinate: :meth:`Store.try_lock` (exclusive, not waiting), and the versioned commit
  :meth:`Store.read_versioned` / :meth:`Store.commit`: a compare-and-swap on a token, which
  the manifest uses (``lowdiff_store.log.manifest.update_manifest`` reloads and retries on
  :class:`CommitConflict`).

The commit has a default implementation here that needs only :meth:`Store.create` and
:meth:`Store.list`: every version is a create-only object ``NAME.<20-digit sequence>``, the
newest is current, and committing version n+1 fails if another writer created it first.
That is the object-store mechanism (``If-None-Match: *``). :class:`LocalStore` overrides it
to keep the single ``MANIFEST`` file of the on-disk format (rename under a lock, with a
content-hash token). Both pass the same conformance tests (``tests/storage_conformance.py``).
"""

from __future__ import annotations

import abc
import builtins
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

from ..errors import LowdiffError, Reason, StorageError

Buffer = bytes | bytearray | memoryview
ReadMode = Literal["mmap", "pread", "private"]


class Source(Protocol):
    """Random-access bytes. ``read`` is bounds-checked against ``size``."""

    path: str
    size: int

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``; raises ``FormatError(truncated)`` past the end."""
        ...

    def close(self) -> None:
        """Release the file. Views returned by ``read`` must not be used afterwards."""
        ...


class AppendHandle(Protocol):
    """An object written at its end only (the active segment, an index).

    ``size`` is the number of bytes appended (durable or not), ``synced_size`` how many
    of them :meth:`sync` has taken (they can no longer be rewritten), ``durable_size`` how
    many of them survive a crash. A local file makes synced bytes durable at once
    (``durable_size == synced_size``); an object store may stage them locally and upload
    them later (``flush_due`` says when a :meth:`sync` will), so ``durable_size`` may lag
    until then or until :meth:`flush`.
    """

    path: str
    size: int
    synced_size: int

    @property
    def durable_size(self) -> int:
        """Bytes that survive a crash (``<= synced_size``)."""
        ...

    @property
    def flush_due(self) -> float | None:
        """``time.monotonic()`` from which a :meth:`sync` makes every synced byte durable;
        None when ``durable_size == synced_size`` (nothing waits)."""
        ...

    def append(self, chunks: Sequence[Buffer]) -> int:
        """Write the chunks at the end; returns the offset they start at."""
        ...

    def rewrite_unsynced(self, offset: int, data: Buffer) -> None:
        """Overwrite bytes appended since the last sync (refuses durable bytes)."""
        ...

    def sync(self) -> None:
        """Take every byte appended so far (``synced_size = size``); they are durable when
        this returns, or at the store's next durability point (see ``durable_size``)."""
        ...

    def flush(self) -> None:
        """:meth:`sync`, and make every byte durable now (``durable_size == size``)."""
        ...

    def truncate(self, size: int) -> None:
        """Cut to ``size`` bytes (a torn tail that was never durable), durably."""
        ...

    def seal(self) -> None:
        """Make the object final (durable, no more appends) and close the handle."""
        ...

    def close(self) -> None:
        """Close without syncing. Idempotent."""
        ...


class PublishHandle(Protocol):
    """An object being written in place before it is published (:meth:`Store.open_publish`):
    bytes go to a temp object beside it; :meth:`commit` publishes it atomically and
    durably, :meth:`abort` removes it. A process killed meanwhile leaves a temp file that
    the next publish in that directory, or the log's garbage collection, removes."""

    def write_at(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at byte ``offset``."""

    def truncate(self, size: int) -> None:
        """Set the object's size."""

    def commit(self) -> None:
        """Make the bytes durable and publish them under the name (as ``publish``)."""

    def abort(self) -> None:
        """Remove the temp object; idempotent, a no-op after :meth:`commit`."""


class StoreLock(abc.ABC):
    """An exclusive lock held by this process; released by :meth:`release` or ``with``."""

    name: str

    @abc.abstractmethod
    def release(self) -> None:
        """Release the lock. Idempotent."""

    def release_and_remove(self) -> None:
        """Release the lock and remove what holds it (a lock file), so an idle log keeps
        no trace of it. The default only releases."""
        self.release()

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Versioned(NamedTuple):
    """The current version of a committed object: its bytes and the token to commit on."""

    data: bytes
    token: str


class CommitConflict(StorageError):
    """:meth:`Store.commit` lost a race: the object changed since its token was read."""

    default_reason = Reason.COMMIT_CONFLICT


class ObjectExists(StorageError):
    """:meth:`Store.create` was asked for a name that already exists."""

    default_reason = Reason.ALREADY_EXISTS


_BAD_PART = {"", ".", ".."}
_SEQ_RE = re.compile(r"\.(\d{20})$")


def check_name(name: str) -> str:
    """Validate an object name (relative, ``/``-separated, no empty/``.``/``..`` part)."""
    if not isinstance(name, str) or name.startswith("/") or "\\" in name or "\0" in name \
            or any(p in _BAD_PART for p in name.split("/")):
        raise LowdiffError(f"invalid object name {name!r}", reason=Reason.UNSAFE_NAME)
    return name


class Store(abc.ABC):
    """Where the objects of a log (or of a sharded checkpoint) live. See the module doc.

    Every method raises :class:`~lowdiff_store.errors.StorageError` for I/O failures, with
    the object's :meth:`path_of` as the path. Durability: a method that writes returns only
    once what it wrote (and, for :meth:`delete`, the removal) survives a power cut.
    """

    #: Seconds a writer may wait out a store that does not answer (``store_unavailable``)
    #: inside an operation it cannot put off, such as a segment roll, retrying it; 0 (a
    #: local directory): no waiting, its errors are not outages.
    outage_budget_s: float = 0.0

    #: The root, as the user wrote it (a directory path or a URL); used in messages.
    url: str

    # ---------------------------------------------------------------- names

    @abc.abstractmethod
    def path_of(self, name: str) -> str:
        """The full path or URL of object ``name`` (for messages and for the user)."""

    @abc.abstractmethod
    def child(self, prefix: str) -> Store:
        """A store rooted at ``prefix`` inside this one (a shard: ``rank-00000``)."""

    # ---------------------------------------------------------------- reading

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """True when object ``name`` exists."""

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Size of object ``name`` in bytes; ``StorageError(missing_file)`` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Sorted names of every object whose name starts with ``prefix`` (at any depth)."""

    @abc.abstractmethod
    def open(self, name: str, mode: ReadMode = "mmap", *, length: int | None = None
             ) -> Source:
        """A :class:`Source` over object ``name`` (``mode``: zero-copy ``"mmap"`` views,
        ``"pread"`` copies, or ``"private"``: zero-copy views that are writable, copy on
        write, the writes staying in this process; a store that cannot map returns what
        ``"mmap"`` would, and callers check ``writeable`` before writing). ``length``
        limits the source to the first ``length`` bytes: a reader that validated a prefix
        maps no more than that, so a writer cutting a torn tail after it never removes
        bytes under the reader. Special files (FIFO, device, directory) are refused, never
        opened for reading."""

    @abc.abstractmethod
    def read(self, name: str, *, max_bytes: int) -> bytes:
        """The whole object; ``FormatError(metadata_too_large)`` if it is larger than
        ``max_bytes`` (checked before reading), ``StorageError(missing_file)`` if absent."""

    # ---------------------------------------------------------------- writing

    @abc.abstractmethod
    def ensure_root(self) -> None:
        """Create the root (a directory and its parents, durably) if needed."""

    @abc.abstractmethod
    def create(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Write a new object atomically and durably; :class:`ObjectExists` if ``name``
        exists (create-only). Readers see no object or the whole object."""

    @abc.abstractmethod
    def publish(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Replace (or create) object ``name`` atomically and durably: readers see the old
        bytes or the new ones, never a mix. The log replaces only objects whose new bytes
        mean the same (a manifest, an index cache, the base of a step)."""

    def open_publish(self, name: str) -> PublishHandle | None:
        """A handle that writes object ``name``'s bytes at any offset before publishing it
        (:meth:`PublishHandle.commit`, as :meth:`publish` would), or None where the store
        publishes whole objects only (the default: an object store)."""
        del name
        return None

    @abc.abstractmethod
    def open_append(self, name: str, *, create: bool = False) -> AppendHandle:
        """An append handle on ``name`` (``create``: a new, empty object, durably created;
        :class:`ObjectExists` if it exists)."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove object ``name`` durably; a missing object is not an error."""

    def delete_many(self, names: Sequence[str]) -> None:
        """Remove the objects ``names``; durable, all of them, when this returns (a missing
        object is not an error). A backend may make them durable together (one directory
        fsync instead of one per file); until it returns, any of them may come back after
        a power cut, so callers delete only objects nothing references any more."""
        for name in names:
            self.delete(name)

    @abc.abstractmethod
    def try_lock(self, name: str) -> StoreLock | None:
        """Take the exclusive lock ``name`` without waiting: the lock, or None when another
        holder (this or another process) has it."""

    # ---------------------------------------------------------------- versioned commit

    def read_versioned(self, name: str, *, max_bytes: int) -> Versioned | None:
        """The current version of committed object ``name``, or None if never committed.

        Default: the newest of the create-only objects ``NAME.<sequence>``."""
        for _attempt in range(8):
            seqs = self._versions(name)
            if not seqs:
                return None
            newest = seqs[-1]
            try:
                data = self.read(f"{name}.{newest:020d}", max_bytes=max_bytes)
            except StorageError as e:  # removed meanwhile (superseded): look again
                if e.reason is Reason.MISSING_FILE:
                    continue
                raise
            return Versioned(data, str(newest))
        raise StorageError("versions keep disappearing while reading", path=self.path_of(name))

    def commit(self, name: str, chunks: Sequence[Buffer], *, expect: str | None) -> str:
        """Make ``chunks`` the current version of ``name`` if its current token is
        ``expect`` (None: never committed); returns the new token. Raises
        :class:`CommitConflict` when another writer committed first. Atomic and durable.

        Default: create-only ``NAME.<expect + 1>`` (no rename, no copy, no delete)."""
        if expect is None:
            if self._versions(name):
                raise CommitConflict("already committed", path=self.path_of(name))
            seq = 0
        else:
            seq = int(expect) + 1
        try:
            self.create(f"{name}.{seq:020d}", chunks)
        except ObjectExists:
            raise CommitConflict(f"version {seq} was committed by another writer",
                                 path=self.path_of(name)) from None
        return str(seq)

    def _versions(self, name: str) -> builtins.list[int]:
        out = []
        for n in self.list(name + "."):
            m = _SEQ_RE.search(n)
            if m is not None and n == f"{name}.{m.group(1)}":
                out.append(int(m.group(1)))
        return sorted(out)


__all__ = ["AppendHandle", "Buffer", "CommitConflict", "ObjectExists", "PublishHandle",
           "ReadMode", "Source", "Store", "StoreLock", "Versioned", "check_name"]
