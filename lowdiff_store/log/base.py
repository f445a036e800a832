"""Base files: the full named-tensor state at one step, in the safetensors layout.

Why safetensors: every tool in the ecosystem reads it (``safetensors.safe_open``,
``load_file``), its layout is tiny and fully validated by our own reader (no C parser
of hostile bytes, unlike HDF5), and tensors are contiguous, so an mmap gives zero-copy
views. What we add inside the layout, compatibly:

- the JSON header starts with ``{"__metadata__":{"format":"lowdiff-base"`` (our magic, at
  byte 8), then ``format_version``, ``step``, ``log_id``, a CRC32C per tensor and a CRC32C
  of the header itself (computed with its own field set to ``00000000``);
- the header is padded with spaces and tensors are separated by reserved ``U8`` padding
  tensors (names starting with ``__lowdiff__.``) so that every tensor starts at a multiple
  of 64 bytes in the file;
- non-tensor state (optimizer hyperparameters, scheduler state...) is msgpack, stored as the
  ``U8`` tensor ``__lowdiff__.meta``.

A base is published atomically (:meth:`lowdiff_store.storage.Store.publish`: on a local
directory a temp file, fsync, rename and directory fsync).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import (
    BadMagicError,
    CorruptRecordError,
    FormatError,
    LowdiffError,
    Reason,
)
from ..format.checksum import crc32c
from ..format.constants import (
    BASE_FORMAT_NAME,
    BASE_HEADER_PREFIX,
    BASE_NAME,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAX_BASE_HEADER_BYTES,
    MAX_ELEMENTS,
    MAX_NAME_BYTES,
    MAX_NDIM,
)
from ..format.dtypes import STORAGE_DTYPE
from ..format.framing import align_up, check_version, pack_meta, unpack_meta
from ..storage import ReadMode, Source, Store, atomic_write, open_source, read_into
from ..storage.base import Buffer

RESERVED_PREFIX = "__lowdiff__."
#: how far past a tensor :meth:`BaseFile.read_into` asks the kernel to read meanwhile
READ_AHEAD = 64 << 20
META_TENSOR = RESERVED_PREFIX + "meta"
_CRC_FIELD = b'"header_crc32c":"'
_CRC_PLACEHOLDER = b"00000000"


def _layout(tensors: Iterable[tuple[str, str, tuple[int, ...], int]], data_start: int
            ) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], int]:
    """Place tensors so each starts 64-byte aligned in the file; returns entries including
    padding tensors, and the data size."""
    out: list[tuple[str, str, tuple[int, ...], int, int]] = []
    off = 0
    npad = 0
    for name, tag, shape, nbytes in tensors:
        gap = align_up(data_start + off) - (data_start + off)
        if gap:
            out.append((f"{RESERVED_PREFIX}pad.{npad}", "U8", (gap,), off, off + gap))
            npad += 1
            off += gap
        out.append((name, tag, shape, off, off + nbytes))
        off += nbytes
    return out, off


def encode_base(step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                meta: Mapping[str, Any], log_id: bytes,
                crcs: Mapping[str, int] | None = None) -> list[Any]:
    """The chunks of a base file. ``tensors`` maps name -> (dtype tag, array holding the
    bits in the tag's storage dtype). Arrays are referenced, not copied. ``crcs``: the
    CRC32C of some arrays' bytes, already computed (by the copy that made them); the
    others are computed here."""
    items: list[tuple[str, str, np.ndarray]] = []
    for name, (tag, arr) in tensors.items():
        _check_name(name)
        if STORAGE_DTYPE.get(tag) != arr.dtype:
            raise FormatError(f"tensor {name!r}: array dtype {arr.dtype} does not hold {tag}",
                              reason=Reason.BAD_DTYPE)
        # np.ascontiguousarray would turn a 0-d array into shape (1,): keep the shape
        items.append((name, tag, arr if arr.flags.c_contiguous else arr.copy(order="C")))
    meta_arr = np.frombuffer(pack_meta(meta), dtype=np.uint8)
    items.append((META_TENSOR, "U8", meta_arr))
    known = crcs or {}
    crc_hex = {name: f"{_crc_of(a) if name not in known else known[name]:08x}"
               for name, _t, a in items}
    head, entries, total = _header(step, [(n, t, tuple(a.shape), a.nbytes)
                                          for n, t, a in items], crc_hex, log_id)
    chunks: list[Any] = list(head)
    by_name = {n: a for n, _t, a in items}
    for name, _tag, _shape, b, e in entries:
        if name in by_name:
            arr = by_name[name]
            chunks.append(arr.reshape(-1).view(np.uint8).data if arr.nbytes else b"")
        else:
            chunks.append(bytes(e - b))
    assert total == sum(e - b for _n, _t, _s, b, e in entries)
    return chunks


def _check_name(name: str) -> None:
    if name.startswith(RESERVED_PREFIX):
        raise FormatError(f"tensor name {name!r} uses the reserved prefix",
                          reason=Reason.UNSAFE_NAME)


def _header(step: int, items: list[tuple[str, str, tuple[int, ...], int]],
            crc_hex: Mapping[str, str], log_id: bytes
            ) -> tuple[tuple[bytes, bytes], list[tuple[str, str, tuple[int, ...], int, int]],
                       int]:
    """A base file's 8-byte length prefix and header (its CRC filled in, padded with
    spaces to where data starts) for ``items`` (name, tag, shape, bytes; the meta tensor
    last) with their CRC32Cs in hex (8 digits each: the header's length does not depend on
    their values); the entries of the data (padding tensors included) and its size."""
    def header_for(data_start: int) -> tuple[bytes, list[tuple[str, str, tuple[int, ...],
                                                                int, int]], int]:
        entries, total = _layout(iter(items), data_start)
        md = {"format": BASE_FORMAT_NAME, "format_version": f"{FORMAT_MAJOR}.{FORMAT_MINOR}",
              "step": str(step), "log_id": log_id.hex(),
              "crc32c": json.dumps(crc_hex, separators=(",", ":"), sort_keys=True),
              "header_crc32c": _CRC_PLACEHOLDER.decode()}
        h: dict[str, Any] = {"__metadata__": md}
        for name, tag, shape, b, e in entries:
            h[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [b, e]}
        raw = json.dumps(h, separators=(",", ":")).encode()
        return raw, entries, total

    # The header length decides where data starts, which decides the padding tensors,
    # which change the header: iterate to a fixed point (two rounds in practice).
    start = align_up(8 + 256)
    for _ in range(8):
        raw, entries, total = header_for(start)
        need = align_up(8 + len(raw))
        if need == start:
            break
        start = need
    else:  # pragma: no cover - the size only grows by a few bytes per round
        raise FormatError("base header layout did not converge")
    raw = raw + b" " * (start - 8 - len(raw))
    prefix = struct.pack("<Q", len(raw))
    crc = crc32c(prefix + raw)
    pos = raw.index(_CRC_FIELD) + len(_CRC_FIELD)
    raw = raw[:pos] + f"{crc:08x}".encode() + raw[pos + 8:]
    return (prefix, raw), entries, total


class BaseBuilder:
    """A base file written piece by piece as its bytes arrive (a base passed through the
    writer process's ring in pieces, ``format_spec/ring.md`` section 3.2), for
    :func:`store_base` to publish in place of its tensors.

    ``layout``: (name, dtype tag, shape) of every tensor in the order their pieces come;
    ``meta``, ``step``, ``log_id``: the base's, known when it starts, so the header's
    length and every tensor's place in the file are known before the first byte. Where
    the store writes files in place (:meth:`~lowdiff_store.storage.Store.open_publish`:
    a local directory) the pieces go straight into the base's temp file, beside it, and
    the header, with the CRC32C of every tensor computed as its pieces passed, is written
    last: the base is never held whole in memory. Elsewhere (an object store publishes
    whole objects) the pieces are assembled in memory and published as any base.
    :meth:`abort` removes what was written (idempotent; a no-op once published)."""

    def __init__(self, store: Store, name: str, step: int,
                 layout: Iterable[tuple[str, str, tuple[int, ...]]],
                 meta: Mapping[str, Any], log_id: bytes) -> None:
        self.name, self.step, self.meta, self.log_id = name, step, dict(meta), log_id
        self._meta_bytes = pack_meta(self.meta)
        self._items: list[tuple[str, str, tuple[int, ...], int]] = []
        for n, tag, shape in layout:
            _check_name(n)
            if any(n == m for m, *_r in self._items):
                raise FormatError(f"tensor {n!r} is twice in the base at step {step}",
                                  reason=Reason.BAD_METADATA)
            if tag not in STORAGE_DTYPE:
                raise FormatError(f"tensor {n!r}: unknown dtype tag {tag!r}",
                                  reason=Reason.BAD_DTYPE)
            size = int(np.prod(shape, dtype=np.int64)) * STORAGE_DTYPE[tag].itemsize
            self._items.append((n, tag, tuple(shape), size))
        self._items.append((META_TENSOR, "U8", (len(self._meta_bytes),),
                            len(self._meta_bytes)))
        head, entries, self.total = _header(step, self._items, dict.fromkeys(
            (n for n, *_r in self._items), _CRC_PLACEHOLDER.decode()), log_id)
        self._start = len(head[0]) + len(head[1])
        self._at = {n: b for n, _t, _s, b, _e in entries}
        self._crc = {n: 0 for n, *_r in self._items}
        self._filled = {n: 0 for n, *_r in self._items}
        self._order = [n for n, *_r in self._items]
        self._next = 0  # the tensor whose bytes come next
        self._file = store.open_publish(name)
        self._arrays: dict[str, np.ndarray] | None = None
        if self._file is None:
            self._arrays = {n: np.empty(size, np.uint8)
                            for n, _t, _s, size in self._items[:-1]}  # (not the meta's)
        self.done = False

    @property
    def in_memory(self) -> bool:
        """Whether the pieces are assembled in memory (the store cannot write in place)."""
        return self._file is None

    def add(self, name: str, at: int, data: Buffer) -> None:
        """The bytes of ``name`` from its byte ``at``: they must follow the last piece of
        that tensor, and the tensors come in the layout's order (``FormatError``)."""
        mv = memoryview(data).cast("B")
        while (self._next < len(self._order) - 1 and self._order[self._next] != name
               and self._filled[self._order[self._next]] == self._size(self._next)):
            self._next += 1
        if (self._order[self._next] != name or at != self._filled[name]
                or at + mv.nbytes > self._size(self._next)):
            raise FormatError(f"a piece of {name!r} of the base at step {self.step} (bytes "
                              f"[{at}, {at + mv.nbytes})) does not follow the last one "
                              f"({self._order[self._next]!r}, "
                              f"{self._filled[self._order[self._next]]} bytes)",
                              reason=Reason.BAD_METADATA)
        if mv.nbytes:
            if self._file is not None:
                self._file.write_at(self._start + self._at[name] + at, mv)
            elif name != META_TENSOR:
                assert self._arrays is not None
                self._arrays[name][at:at + mv.nbytes] = np.frombuffer(mv, np.uint8)
            self._crc[name] = crc32c(mv, self._crc[name])
        self._filled[name] = at + mv.nbytes

    def _size(self, i: int) -> int:
        return self._items[i][3]

    def check_complete(self) -> None:
        """``FormatError`` unless every tensor's bytes have all arrived."""
        for n, _t, _s, size in self._items[:-1]:
            if self._filled[n] != size:
                raise FormatError(f"tensor {n!r} of the base at step {self.step}: "
                                  f"{self._filled[n]} of its {size} bytes arrived",
                                  reason=Reason.BAD_METADATA)

    def publish(self, store: Store, name: str, step: int, meta: Mapping[str, Any],
                log_id: bytes) -> int:
        """Publish the base as ``name`` (atomically and durably, as :func:`store_base`);
        returns its size in bytes. ``name``, ``step``, ``meta`` and ``log_id`` must be
        those it was started with."""
        if (name, step, dict(meta), log_id) != (self.name, self.step, self.meta, self.log_id):
            self.abort()
            raise FormatError(f"the base built for {self.name} (step {self.step}) was "
                              f"published as {name} (step {step}) or with other metadata",
                              reason=Reason.BAD_METADATA)
        self.check_complete()
        if self._arrays is not None:  # (an object store: a base as any)
            tensors = {n: (t, self._arrays[n].view(STORAGE_DTYPE[t]).reshape(s))
                       for n, t, s, _b in self._items[:-1]}
            out = store_base(store, step, tensors, meta, log_id,
                             {n: c for n, c in self._crc.items() if n != META_TENSOR},
                             name=name)  # (no braces in a file name: format keeps it)
            self.done = True
            self._arrays = None
            return out
        assert self._file is not None
        self.add(META_TENSOR, 0, self._meta_bytes)
        head, _entries, total = _header(step, self._items, {n: f"{c:08x}" for n, c in
                                                            self._crc.items()}, log_id)
        if len(head[0]) + len(head[1]) != self._start or total != self.total:
            raise FormatError("base header length changed with its CRCs")  # pragma: no cover
        self._file.write_at(0, head[0] + head[1])
        self._file.truncate(self._start + total)
        self._file.commit()
        self.done = True
        return self._start + total

    def abort(self) -> None:
        """Forget the base: its temp file removed, its memory freed. Idempotent."""
        self._arrays = None
        if self._file is not None and not self.done:
            self._file.abort()
        self.done = True


def write_base(path: str, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
               meta: Mapping[str, Any], log_id: bytes, *, fsync: bool = True) -> int:
    """Write a base atomically; returns its size in bytes."""
    chunks = encode_base(step, tensors, meta, log_id)
    atomic_write(path, chunks, fsync=fsync)
    return sum(memoryview(c).nbytes for c in chunks)


def _crc_of(a: np.ndarray) -> int:
    return crc32c(a.reshape(-1).view(np.uint8).data)


#: what :func:`store_base` publishes: name -> (dtype tag, array), or a built base
BaseTensors = Mapping[str, tuple[str, np.ndarray]] | BaseBuilder


def store_base(store: Store, step: int, tensors: BaseTensors,
                 meta: Mapping[str, Any], log_id: bytes,
                 crcs: Mapping[str, int] | None = None, *, name: str = BASE_NAME) -> int:
    """Publish the base of ``step`` in ``store`` (under its name from the spec, atomically
    and durably); returns its size in bytes. The manifest is not touched. ``name``: the
    file name pattern (:data:`~lowdiff_store.format.constants.SLICE_NAME` for one slice
    of a streamed base, which is framed as a base). ``tensors``: name -> (dtype tag,
    array), or a :class:`BaseBuilder` whose pieces have all arrived."""
    if isinstance(tensors, BaseBuilder):
        return tensors.publish(store, name.format(step), step, meta, log_id)
    chunks = encode_base(step, tensors, meta, log_id, crcs)
    store.publish(name.format(step), chunks)
    return sum(memoryview(c).nbytes for c in chunks)


class CrcQueue:
    """CRC checks of tensors already read, run in order on a helper thread while the
    caller reads the next ones (the CRC releases the GIL); :meth:`wait` raises the first
    failure. A context manager: leaving it waits for the thread (errors not raised)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lowdiff-crc")
        self._futures: list[concurrent.futures.Future[None]] = []

    def submit(self, check: Callable[[], None]) -> None:
        """Run ``check`` after the checks submitted before it."""
        self._futures.append(self._pool.submit(check))

    def wait(self) -> None:
        """Wait for every check submitted; raise the first one's error (file order)."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def close(self) -> None:
        """Wait for the thread and stop it."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CrcQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BaseFile:
    """A validated base. Tensors are zero-copy views with ``mode="mmap"``.

    Every tensor's CRC is checked the first time it is read (``verify=True``), so reading
    a subset costs only that subset; :meth:`verify_all` checks everything.
    """

    def __init__(self, path: str, *, mode: ReadMode = "mmap", source: Source | None = None
                 ) -> None:
        """Open the base file ``path``, or read it from ``source`` (a store's source: then
        ``path`` only names it in messages; the base owns the source and closes it)."""
        self.path = path
        self._src: Source = source if source is not None else open_source(path, mode)
        try:
            self._parse()
        except LowdiffError as e:
            self._src.close()
            if e.path is None:
                e.path = path
                Exception.__init__(e, str(e))
            raise
        self._verified: set[str] = set()

    def _fail(self, detail: str, reason: Reason, offset: int = 8) -> FormatError:
        return FormatError(detail, reason=reason, path=self.path, offset=offset)

    def _parse(self) -> None:
        src = self._src
        if src.size < 8:
            raise self._fail("file shorter than 8 bytes", Reason.TRUNCATED, 0)
        (n,) = struct.unpack("<Q", src.read(0, 8))
        if n > MAX_BASE_HEADER_BYTES:
            raise self._fail(f"header of {n} bytes exceeds the cap", Reason.METADATA_TOO_LARGE,
                             0)
        if 8 + n > src.size:
            raise self._fail(f"header of {n} bytes runs past the end", Reason.TRUNCATED, 0)
        raw = bytes(src.read(8, n))
        if not raw.startswith(BASE_HEADER_PREFIX):
            raise BadMagicError("not a lowdiff-store base (no lowdiff-base metadata)",
                                path=self.path, offset=8)
        pos = raw.find(_CRC_FIELD)
        if pos < 0 or pos + len(_CRC_FIELD) + 8 > len(raw):
            raise self._fail("header has no checksum field", Reason.BAD_METADATA)
        pos += len(_CRC_FIELD)
        stored = raw[pos:pos + 8]
        if re.fullmatch(rb"[0-9a-f]{8}", stored) is None:
            raise CorruptRecordError("header checksum mismatch", path=self.path, offset=8 + pos)
        blank = raw[:pos] + _CRC_PLACEHOLDER + raw[pos + 8:]
        if crc32c(src.read(0, 8).tobytes() + blank) != int(stored, 16):
            raise CorruptRecordError("header checksum mismatch", path=self.path, offset=8)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError):
            raise self._fail("header is not valid JSON", Reason.BAD_METADATA) from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object", Reason.BAD_METADATA)
        md = header.pop("__metadata__", None)
        if not isinstance(md, dict):
            raise self._fail("header has no __metadata__", Reason.BAD_METADATA)
        version = md.get("format_version")
        m = re.fullmatch(r"(\d{1,5})\.(\d{1,5})", version) if isinstance(version, str) else None
        if m is None:
            raise self._fail(f"bad format_version {version!r}", Reason.BAD_METADATA)
        try:
            check_version(int(m.group(1)), int(m.group(2)))
        except LowdiffError as e:
            e.path, e.offset = self.path, 8
            Exception.__init__(e, str(e))
            raise
        try:
            self.step = int(md["step"])
            self.log_id = bytes.fromhex(md["log_id"])
            crcs = json.loads(md["crc32c"])
            if not isinstance(crcs, dict):
                raise TypeError
            self._crcs = {str(k): int(v, 16) for k, v in crcs.items()}
        except (KeyError, ValueError, TypeError, AttributeError):
            raise self._fail("bad lowdiff metadata in the header", Reason.BAD_METADATA) from None
        self.data_start = 8 + n
        data_size = src.size - self.data_start
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        spans = []
        for name, ent in header.items():
            try:
                name_len = len(name.encode())
            except UnicodeEncodeError:  # JSON can spell lone surrogates ("\ud800")
                raise self._fail(f"tensor name {name!r} is not valid UTF-8",
                                 Reason.UNSAFE_NAME) from None
            if not isinstance(ent, dict) or name_len > MAX_NAME_BYTES:
                raise self._fail(f"bad entry for {name!r}", Reason.BAD_METADATA)
            tag, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
            if not isinstance(tag, str) or tag not in STORAGE_DTYPE:
                raise self._fail(f"tensor {name!r}: unknown dtype {tag!r}", Reason.BAD_DTYPE)
            if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                    or not all(type(d) is int and d >= 0 for d in shape)):
                raise self._fail(f"tensor {name!r}: bad shape", Reason.BAD_METADATA)
            if (not isinstance(offs, list) or len(offs) != 2
                    or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1]):
                raise self._fail(f"tensor {name!r}: bad data_offsets", Reason.OUT_OF_BOUNDS)
            numel = 1
            for d in shape:
                numel *= d
                if numel > MAX_ELEMENTS:
                    raise self._fail(f"tensor {name!r} is too large", Reason.LIMIT_EXCEEDED)
            if numel * STORAGE_DTYPE[tag].itemsize != offs[1] - offs[0]:
                raise self._fail(f"tensor {name!r}: {offs[1] - offs[0]} bytes do not hold "
                                 f"shape {shape} of {tag}", Reason.BAD_RECORD_LENGTH)
            if offs[1] > data_size:
                raise self._fail(f"tensor {name!r} ends past the end of the file",
                                 Reason.TRUNCATED)
            spans.append((offs[0], offs[1]))
            self._entries[name] = (tag, tuple(shape), offs[0], offs[1])
        spans.sort()
        pos2 = 0
        for b, e2 in spans:
            if b != pos2:
                raise self._fail("tensor data is not contiguous", Reason.OUT_OF_BOUNDS)
            pos2 = e2
        if pos2 != data_size:
            raise self._fail(f"tensors cover {pos2} of {data_size} data bytes",
                             Reason.TRUNCATED if pos2 > data_size else Reason.OUT_OF_BOUNDS)
        for name in self._entries:
            if not name.startswith(RESERVED_PREFIX + "pad.") and name not in self._crcs:
                raise self._fail(f"tensor {name!r} has no checksum", Reason.BAD_METADATA)
        if META_TENSOR not in self._entries:
            raise self._fail("base has no metadata tensor", Reason.BAD_METADATA)

    @property
    def names(self) -> list[str]:
        """Tensor names, in file order, without the reserved ones."""
        return [n for n in self._entries if not n.startswith(RESERVED_PREFIX)]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype tag, shape) of a tensor."""
        tag, shape, _b, _e = self._entries[name]
        return tag, shape

    @property
    def nbytes(self) -> int:
        """Size of the file."""
        return self._src.size

    def _bytes(self, name: str, verify: bool) -> memoryview:
        try:
            _tag, _shape, b, e = self._entries[name]
        except KeyError:
            raise LowdiffError(f"base has no tensor {name!r}", reason=Reason.INVALID_ARGUMENT,
                               path=self.path) from None
        mv = self._src.read(self.data_start + b, e - b)
        if verify and name not in self._verified:
            if crc32c(mv) != self._crcs.get(name):
                raise CorruptRecordError(f"tensor {name!r} checksum mismatch", path=self.path,
                                         offset=self.data_start + b)
            self._verified.add(name)
        return mv

    def tensor(self, name: str, *, verify: bool = True) -> np.ndarray:
        """The tensor's bits as a read-only array of its storage dtype (zero-copy on mmap)."""
        tag, shape, _b, _e = self._entries.get(name, ("U8", (0,), 0, 0))
        mv = self._bytes(name, verify)
        arr = np.frombuffer(mv, dtype=STORAGE_DTYPE[tag]).reshape(shape)
        return arr

    def read_into(self, name: str, out: np.ndarray, *, checks: CrcQueue | None = None
                  ) -> None:
        """Copy the bytes of tensor ``name`` into ``out`` (a writable C-contiguous array
        of exactly the tensor's size in bytes, any dtype: the memory of the tensor it
        restores) and check them against the tensor's CRC32C; the check is never skipped.

        One pass over the file: a local file is read with ``pread`` straight into ``out``
        while the kernel reads the next :data:`READ_AHEAD` bytes, then the CRC is taken
        from ``out`` (:func:`lowdiff_store.storage.read_into`). A mismatch raises
        CorruptRecordError naming the file and the tensor's offset, a file shorter than
        when it was opened FormatError(truncated); ``out`` then holds unchecked bytes.

        ``checks``: the CRC is computed on that queue's thread while the caller reads the
        next tensor, and a mismatch is raised by :meth:`CrcQueue.wait` (``out`` must not
        change until then)."""
        try:
            _tag, _shape, b, e = self._entries[name]
        except KeyError:
            raise LowdiffError(f"base has no tensor {name!r}", reason=Reason.INVALID_ARGUMENT,
                               path=self.path) from None
        if not (out.flags.c_contiguous and out.flags.writeable) or out.nbytes != e - b:
            raise LowdiffError(f"tensor {name!r} ({e - b} bytes) needs a writable "
                               f"contiguous buffer of its size, not {out.nbytes} bytes",
                               reason=Reason.INVALID_ARGUMENT, path=self.path)
        mv = out.reshape(-1).view(np.uint8).data
        offset = self.data_start + b
        read_into(self._src, offset, mv, ahead=READ_AHEAD)
        if checks is not None:
            checks.submit(lambda: self._check(name, mv, offset))
        else:
            self._check(name, mv, offset)

    def _check(self, name: str, mv: memoryview, offset: int) -> None:
        if crc32c(mv) != self._crcs.get(name):
            raise CorruptRecordError(f"tensor {name!r} checksum mismatch", path=self.path,
                                     offset=offset)
        self._verified.add(name)

    def meta(self) -> dict[str, Any]:
        """The base's non-tensor state (msgpack map)."""
        try:
            return unpack_meta(self._bytes(META_TENSOR, True))
        except LowdiffError as e:
            if e.path is None:
                e.path = self.path
                Exception.__init__(e, str(e))
            raise

    def verify_all(self) -> None:
        """Check the CRC of every tensor."""
        for name in self._entries:
            if not name.startswith(RESERVED_PREFIX + "pad."):
                self._bytes(name, True)

    def close(self) -> None:
        """Release the file (views already handed out stay valid on mmap)."""
        self._src.close()

    def __enter__(self) -> BaseFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["META_TENSOR", "READ_AHEAD", "RESERVED_PREFIX", "BaseFile", "CrcQueue", "encode_base",
           "store_base", "write_base"]
