"""Per-segment index files (``seg-N.ldidx``): a cache of (step, offset, length) per record.

Entries are appended after the records they describe have been made durable, so an entry
that passes its check names a durable record. Each entry carries a 64-bit check word mixing
its fields with the segment id and the log id, verified for all entries at once with
numpy: opening a log of 100,000 records costs one read and a few vector operations. An
index that is missing, torn or inconsistent is rebuilt by scanning its segment.
"""

from __future__ import annotations

import struct
import time

import numpy as np

from ..errors import LowdiffError
from ..format.constants import ALIGN, FILE_HEADER_SIZE, INDEX_ENTRY_SIZE, INDEX_MAGIC
from ..format.framing import FileHeader, decode_file_header
from ..storage import AppendHandle, Store
from ..storage.local import AppendFile

#: Room for the index file header (a newer minor may lengthen it; see the spec).
MAX_INDEX_HEADER_BYTES = 4096

ENTRY_DTYPE = np.dtype([("step", "<u8"), ("offset", "<u8"), ("length", "<u8"),
                        ("check", "<u8")])
assert ENTRY_DTYPE.itemsize == INDEX_ENTRY_SIZE

_C = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                             0xD6E8FEB86659FD93)]


def check_words(step: np.ndarray, offset: np.ndarray, length: np.ndarray,
                segment_id: int, log_id: bytes) -> np.ndarray:
    """The check word of each entry (splitmix64-style mixing; all uint64, wrapping)."""
    salt = np.uint64(int.from_bytes(log_id[:8], "little") ^ (segment_id * 0x100000001B3
                                                              & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):
        x = (step * _C[0]) ^ (offset * _C[1]) ^ (length * _C[2]) ^ salt
        x ^= x >> np.uint64(31)
        x *= _C[3]
        x ^= x >> np.uint64(29)
    result: np.ndarray = x
    return result


_M64 = (1 << 64) - 1
_CI = [int(c) for c in _C]
_ENTRY = struct.Struct("<4Q")


def entry_bytes(refs: list[tuple[int, int, int]], segment_id: int, log_id: bytes) -> bytes:
    """The bytes of :func:`make_entries` for a few entries, in plain integer arithmetic
    (the writer appends one or a few entries per sync; numpy's fixed cost per call is
    ~0.1 ms, which is 5-10% of a 1 MiB append + fdatasync)."""
    salt = int.from_bytes(log_id[:8], "little") ^ (segment_id * 0x100000001B3 & _M64)
    out = []
    for step, offset, length in refs:
        x = ((step * _CI[0]) ^ (offset * _CI[1]) ^ (length * _CI[2])) & _M64 ^ salt
        x ^= x >> 31
        x = (x * _CI[3]) & _M64
        x ^= x >> 29
        out.append(_ENTRY.pack(step, offset, length, x))
    return b"".join(out)


def make_entries(refs: list[tuple[int, int, int]], segment_id: int, log_id: bytes
                 ) -> np.ndarray:
    """Index entries for (step, offset, length) triples."""
    arr = np.zeros(len(refs), dtype=ENTRY_DTYPE)
    if refs:
        a = np.asarray(refs, dtype="<u8")
        arr["step"], arr["offset"], arr["length"] = a[:, 0], a[:, 1], a[:, 2]
        arr["check"] = check_words(arr["step"], arr["offset"], arr["length"], segment_id,
                                   log_id)
    return arr


def valid_prefix(entries: np.ndarray, segment_id: int, log_id: bytes, segment_size: int
                 ) -> int:
    """How many leading entries are consistent: check word, increasing steps, increasing
    non-overlapping aligned offsets, inside the segment."""
    n = len(entries)
    if n == 0:
        return 0
    ok = entries["check"] == check_words(entries["step"], entries["offset"],
                                         entries["length"], segment_id, log_id)
    off, ln, st = entries["offset"], entries["length"], entries["step"]
    ok &= (off % 64 == 0) & (ln % 64 == 0) & (ln > 0) & (off >= FILE_HEADER_SIZE)
    with np.errstate(over="ignore"):
        ok &= (off + ln <= np.uint64(segment_size)) & (off + ln >= off)
    if n > 1:
        ok[1:] &= (st[1:] > st[:-1]) & (off[1:] >= off[:-1] + ln[:-1])
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else n


#: How far a local index grows at a time, in zero bytes that entries then overwrite: the
#: file's size changes once per 2,048 entries instead of at every sync, so the fdatasync of
#: the segment does not commit an index size change each time (3% of a 1 MiB append).
RESERVE_BYTES = 64 << 10


class IndexFile:
    """The append side of an index file.

    On a local file, entries are written into zeros reserved ahead of them
    (:data:`RESERVE_BYTES` at a time) and :meth:`seal` / :meth:`flush` cut what is left
    of the reserve. Zeros are never a valid entry (spec section 5: readers take the longest
    valid prefix), so a crash that leaves the reserve behind leaves a valid index; the next
    writer open republishes it exactly (its size is not one entry per record).
    """

    def __init__(self, f: AppendHandle, segment_id: int, log_id: bytes) -> None:
        self.file = f
        self.segment_id = segment_id
        self.log_id = log_id
        #: where the next entry goes (the file's size, less the reserve)
        self.end = f.size
        self._reserve = isinstance(f, AppendFile)

    @classmethod
    def create(cls, store: Store, name: str, log_id: bytes, segment_id: int,
               first_step: int) -> IndexFile:
        """Create an index file with its header (durable)."""
        f = store.open_append(name, create=True)
        try:
            f.append([FileHeader(INDEX_MAGIC, log_id, segment_id, first_step,
                                 time.time_ns()).encode()])
            f.sync()
        except BaseException:
            f.close()
            raise
        return cls(f, segment_id, log_id)

    @classmethod
    def reopen(cls, store: Store, name: str, log_id: bytes, segment_id: int,
               first_step: int, entries: np.ndarray) -> IndexFile:
        """Replace the index by a fresh object holding ``entries`` (atomic publish: used
        after a rebuild; the index is a cache, so replacing it is allowed), then open it
        for appending."""
        store.publish(name, [FileHeader(INDEX_MAGIC, log_id, segment_id, first_step,
                                        time.time_ns()).encode(), entries.tobytes()])
        return cls(store.open_append(name), segment_id, log_id)

    def encode(self, refs: list[tuple[int, int, int]]) -> bytes:
        """The entries of ``refs`` as bytes, for :meth:`append`."""
        if len(refs) <= 64:
            return entry_bytes(refs, self.segment_id, self.log_id)
        return make_entries(refs, self.segment_id, self.log_id).tobytes()

    def append(self, refs: list[tuple[int, int, int]], data: bytes | None = None) -> None:
        """Append entries (not synced: the index is a cache). ``data``: their bytes from
        :meth:`encode` (encoded ahead: the writer does that before it waits on a sync)."""
        if data is None:
            data = self.encode(refs)
        if not data:
            return
        if not self._reserve:
            self.file.append([data])
            self.end = self.file.size
            return
        short = self.end + len(data) - self.file.size
        if short > 0:
            self.file.append([bytes(-(-short // RESERVE_BYTES) * RESERVE_BYTES)])
        self.file.rewrite_unsynced(self.end, data)
        self.end += len(data)

    def _trim(self) -> None:
        if self.file.size > self.end:
            self.file.truncate(self.end)

    def flush(self) -> None:
        """Cut the reserve and make the entries durable."""
        self._trim()
        self.file.flush()

    def seal(self) -> None:
        """Cut the reserve, sync and close: the index is complete."""
        self._trim()
        self.file.seal()

    def close(self) -> None:
        """Close the file (a reserve left behind is harmless; see the class docstring)."""
        self.file.close()


def max_index_bytes(segment_size: int) -> int:
    """The most bytes of an index that can hold valid entries for a segment of
    ``segment_size`` bytes (records are at least ``ALIGN`` bytes long): what is read."""
    return MAX_INDEX_HEADER_BYTES + INDEX_ENTRY_SIZE * (segment_size // ALIGN + 1)


def index_file_size(store: Store, name: str) -> int | None:
    """Size of an index object, or None when it is missing or unusable."""
    try:
        return store.size(name)
    except LowdiffError:
        return None


def load_index(store: Store, name: str, segment_id: int, log_id: bytes, segment_size: int
               ) -> np.ndarray | None:
    """The valid entries of an index object, or None when it is missing or unusable (the
    index is a cache: the caller scans the segment instead). At most
    :func:`max_index_bytes` are read, whatever the file's size; a special file is refused."""
    try:
        src = store.open(name, "pread")
    except LowdiffError:
        return None
    try:
        data = src.read(0, min(src.size, max_index_bytes(segment_size)))  # a fresh buffer
    except LowdiffError:
        return None
    finally:
        src.close()
    try:
        hdr = decode_file_header(data, INDEX_MAGIC)
    except LowdiffError:
        return None
    if hdr.log_id != log_id or hdr.file_id != segment_id:
        return None
    body = memoryview(data)[hdr.header_len:]
    n = len(body) // INDEX_ENTRY_SIZE
    entries = np.frombuffer(body[: n * INDEX_ENTRY_SIZE], dtype=ENTRY_DTYPE)
    return entries[: valid_prefix(entries, segment_id, log_id, segment_size)]


__all__ = ["ENTRY_DTYPE", "IndexFile", "check_words", "entry_bytes", "index_file_size",
           "load_index", "make_entries", "max_index_bytes", "valid_prefix"]
