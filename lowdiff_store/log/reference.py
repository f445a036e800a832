"""Reference bases: a base whose tensors live in an existing checkpoint the log does not own.

A training run that starts from weights already on disk (a DCP directory, a safetensors file
or a sharded safetensors checkpoint with ``model.safetensors.index.json``) need not copy them
into its first base. The base file then holds only what the external checkpoint lacks (RNG
states, optimizer values...) and, under the key ``"reference"`` of its metadata, a table
naming every other tensor's place in the external checkpoint with the CRC32C its bytes had
when the log started (``format_spec/log_format.md``, section 7.1).

Reading such a base checks the external files first (present, regular, same size) and every
tensor's CRC when it is read, so a checkpoint replaced, truncated or removed after the log
started is a one-line error naming the file (reason ``reference_changed`` or
``missing_file``), never silently used. :meth:`ReferenceBase.verify_all` also checks the
CRC32C of every external file, which covers every byte without decoding anything.

This module is torch-free. Safetensors checkpoints are read here (the same checks as our own
bases: header cap, checked arithmetic, contiguous offsets). DCP checkpoints are read by
torch's own ``torch.distributed.checkpoint`` (their ``.metadata`` is a pickle, which this
package never unpickles itself): the kind ``"dcp"`` maps, through the fixed table
:data:`OPENERS`, to :func:`lowdiff_store.torch.core.dcp_source.open_dcp_source`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError, CorruptRecordError, FormatError, LowdiffError, Reason
from ..format.checksum import crc32c
from ..format.constants import MAX_BASE_HEADER_BYTES, MAX_ELEMENTS, MAX_NAME_BYTES, MAX_NDIM
from ..format.dtypes import STORAGE_DTYPE
from ..storage import Source, is_directory, open_source, read_capped, regular_file_size
from .base import BaseFile

#: Key of a base's metadata holding its reference table.
REFERENCE_KEY = "reference"
#: Kinds of external checkpoint a reference may name.
KINDS = ("safetensors", "dcp")
#: The index file of a sharded safetensors checkpoint (Hugging Face's name).
HF_INDEX = "model.safetensors.index.json"
#: Cap on the bytes read of an index file.
MAX_INDEX_BYTES = 64 << 20
#: Files of an external checkpoint are plain names in its directory: no separators, no
#: parent references. Strings read from a file never become arbitrary paths.
FILE_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.\-]{1,255}")
_READ_BLOCK = 16 << 20


@dataclass(frozen=True)
class RefFile:
    """One file of the external checkpoint: its name in the root, size and CRC32C."""

    name: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class RefTensor:
    """One tensor of a reference base.

    Attributes:
        name: the tensor's name in the base (the log's name).
        key: its key in the external checkpoint.
        dtype: format dtype tag; ``shape``: the base tensor's shape.
        crc32c: CRC32C of the base tensor's bytes (C order) when the log started.
        files: indexes into :attr:`Reference.files` of the files holding its bytes.
        box: ``None`` (the whole external tensor) or ``(offset, global_shape)``: the base
            tensor is the box of ``shape`` at ``offset`` of the external tensor of
            ``global_shape`` (one rank's piece of a sharded parameter).
    """

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    crc32c: int
    files: tuple[int, ...]
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class Reference:
    """A parsed reference table (the ``"reference"`` key of a base's metadata)."""

    kind: str
    root: str
    files: tuple[RefFile, ...]
    tensors: tuple[RefTensor, ...]

    def file_path(self, i: int) -> str:
        """Path of file ``i``."""
        return os.path.join(self.root, self.files[i].name)

    def to_obj(self) -> dict[str, Any]:
        """The msgpack-able form stored in a base (the spec's schema)."""
        return {"kind": self.kind, "root": self.root,
                "files": [[f.name, f.size, f.crc32c] for f in self.files],
                "tensors": [[t.name, t.key, t.dtype, list(t.shape), t.crc32c, list(t.files),
                             None if t.box is None else [list(t.box[0]), list(t.box[1])]]
                            for t in self.tensors]}


def _ints(v: Any, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or len(v) > MAX_NDIM \
            or not all(type(x) is int and 0 <= x < 2 ** 63 for x in v):
        raise ValueError
    return tuple(v)


def parse_reference(obj: Any, path: str) -> Reference:
    """A :class:`Reference` from a base's metadata value (FormatError(bad_metadata) naming
    ``path`` for anything off the schema)."""
    try:
        if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
            raise ValueError
        root = obj["root"]
        if not isinstance(root, str) or not root or "\0" in root:
            raise ValueError
        # a relative root is the base file's directory joined with it (a log moved with
        # the checkpoint it starts from); writers record absolute roots
        root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), root))
        files = []
        for f in obj["files"]:
            name, size, crc = f
            if not isinstance(name, str) or FILE_NAME.fullmatch(name) is None:
                raise ValueError
            sz, c = _ints([size, crc], 2)
            files.append(RefFile(name, sz, c))
        if len({f.name for f in files}) != len(files):
            raise ValueError
        tensors = []
        for t in obj["tensors"]:
            name, key, tag, shape, crc, where, box = t
            if (not isinstance(name, str) or not isinstance(key, str) or not name
                    or len(name.encode()) > MAX_NAME_BYTES or tag not in STORAGE_DTYPE):
                raise ValueError
            shp = _ints(shape)
            idx = _ints(where)
            if not idx or any(i >= len(files) for i in idx) or crc >= 2 ** 32:
                raise ValueError
            bx = None
            if box is not None:
                off, glob = _ints(box[0], len(shp)), _ints(box[1], len(shp))
                if any(o + s > g for o, s, g in zip(off, shp, glob, strict=True)):
                    raise ValueError
                bx = (off, glob)
            if int(np.prod(shp, dtype=np.float64)) > MAX_ELEMENTS:
                raise ValueError
            tensors.append(RefTensor(name, key, tag, shp, _ints([crc], 1)[0], idx, bx))
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError
    except (ValueError, TypeError, KeyError, IndexError):
        raise FormatError("bad reference table in the base metadata",
                          reason=Reason.BAD_METADATA, path=path) from None
    ref = Reference(obj["kind"], root, tuple(files), tuple(tensors))
    check_sizes(ref, path)
    return ref


def check_sizes(ref: Reference, path: str) -> None:
    """Every tensor of ``ref`` (its whole external tensor, for a box) fits in the recorded
    sizes of the files said to hold it, so that nothing is ever allocated from a table
    for more bytes than the external checkpoint has (FormatError(limit_exceeded) naming
    ``path``). Opening a reference base checks those sizes against the files."""
    for t in ref.tensors:
        numel = 1
        for d in (t.box[1] if t.box is not None else t.shape):
            numel *= d
        need = numel * STORAGE_DTYPE[t.dtype].itemsize
        have = sum(ref.files[i].size for i in t.files)
        if need > have:
            raise FormatError(f"referenced tensor {t.name!r} needs {need} bytes, its files "
                              f"hold {have}", reason=Reason.LIMIT_EXCEEDED, path=path)


# --------------------------------------------------------------------- external files


def file_crc(path: str) -> tuple[int, int]:
    """(size, CRC32C) of a regular file, read in blocks (refuses FIFOs and devices)."""
    regular_file_size(path)
    src = open_source(path, "pread")
    try:
        crc, pos = 0, 0
        while pos < src.size:
            n = min(_READ_BLOCK, src.size - pos)
            crc = crc32c(src.read(pos, n), crc)
            pos += n
        return src.size, crc
    finally:
        src.close()


def check_files(ref: Reference, *, contents: bool) -> None:
    """Each file of ``ref`` is present, regular and of the recorded size; with
    ``contents`` its CRC32C matches too. The first difference raises naming the file."""
    for i, f in enumerate(ref.files):
        p = ref.file_path(i)
        size = regular_file_size(p)
        if size != f.size:
            raise CorruptRecordError(
                f"external checkpoint file changed since the log started: {size} bytes, "
                f"{f.size} recorded", reason=Reason.REFERENCE_CHANGED, path=p)
        if contents:
            _size, crc = file_crc(p)
            if crc != f.crc32c:
                raise CorruptRecordError(
                    f"external checkpoint file changed since the log started: crc32c "
                    f"{crc:08x}, {f.crc32c:08x} recorded", reason=Reason.REFERENCE_CHANGED,
                    path=p)


# ------------------------------------------------------------------- safetensors files


def safetensors_entries(src: Source, path: str
                        ) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    """Parse and check a safetensors header: ``({key: (tag, shape, begin, end)},
    data_start)``; offsets are checked contiguous from 0 to the end of the file, byte counts
    against shapes, before anything else is read (FormatError naming ``path``)."""
    def fail(detail: str, reason: Reason, offset: int = 8) -> FormatError:
        return FormatError(detail, reason=reason, path=path, offset=offset)

    if src.size < 8:
        raise fail("file shorter than 8 bytes", Reason.TRUNCATED, 0)
    (n,) = struct.unpack("<Q", src.read(0, 8))
    if n > MAX_BASE_HEADER_BYTES:
        raise fail(f"header of {n} bytes exceeds the cap", Reason.METADATA_TOO_LARGE, 0)
    if 8 + n > src.size:
        raise fail(f"header of {n} bytes runs past the end", Reason.TRUNCATED, 0)
    try:
        header = json.loads(bytes(src.read(8, n)))
    except (ValueError, RecursionError):
        raise fail("header is not valid JSON", Reason.BAD_METADATA) from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object", Reason.BAD_METADATA)
    header.pop("__metadata__", None)
    data_size = src.size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for key, ent in header.items():
        tag = ent.get("dtype") if isinstance(ent, dict) else None
        if not isinstance(tag, str) or tag not in STORAGE_DTYPE:
            raise fail(f"tensor {key!r}: unknown dtype {tag!r}", Reason.BAD_DTYPE)
        shape, offs = ent.get("shape"), ent.get("data_offsets")
        try:
            shp = _ints(shape)
            b, e = _ints(offs, 2)
        except ValueError:
            raise fail(f"tensor {key!r}: bad shape or data_offsets", Reason.BAD_METADATA
                       ) from None
        numel = 1
        for d in shp:
            numel *= d
            if numel > MAX_ELEMENTS:
                raise fail(f"tensor {key!r} is too large", Reason.LIMIT_EXCEEDED)
        if b > e or numel * STORAGE_DTYPE[tag].itemsize != e - b:
            raise fail(f"tensor {key!r}: data_offsets do not hold shape {list(shp)} of {tag}",
                       Reason.BAD_RECORD_LENGTH)
        if e > data_size:
            raise fail(f"tensor {key!r} ends past the end of the file", Reason.TRUNCATED)
        out[key] = (tag, shp, b, e)
    pos = 0
    for b, e in sorted((v[2], v[3]) for v in out.values()):
        if b != pos:
            raise fail("tensor data is not contiguous", Reason.OUT_OF_BOUNDS)
        pos = e
    if pos != data_size:
        raise fail(f"tensors cover {pos} of {data_size} data bytes", Reason.OUT_OF_BOUNDS)
    return out, 8 + n


def _safetensors_layout(path: str) -> tuple[str, list[str]]:
    """(root directory, file names) of a safetensors checkpoint: a file, or a directory
    with an index (every shard it names must exist) or one ``model.safetensors``."""
    p = os.path.abspath(path)
    if not is_directory(p):
        regular_file_size(p)
        return os.path.dirname(p), [os.path.basename(p)]
    index = os.path.join(p, HF_INDEX)
    try:
        regular_file_size(index)
    except LowdiffError as e:
        if e.reason is not Reason.MISSING_FILE:
            raise
        regular_file_size(os.path.join(p, "model.safetensors"))
        return p, ["model.safetensors"]
    raw = read_capped(index, MAX_INDEX_BYTES)
    try:
        wm = json.loads(raw)["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FormatError("not a safetensors index (no weight_map of file names)",
                          reason=Reason.BAD_METADATA, path=index) from None
    names = sorted(set(wm.values()))
    for name in names:
        if FILE_NAME.fullmatch(name) is None:
            raise FormatError(f"index names {name!r}, which is not a file name in its "
                              f"directory", reason=Reason.UNSAFE_NAME, path=index)
        try:
            regular_file_size(os.path.join(p, name))
        except LowdiffError as e:  # a shard the index names is missing: refused, named
            e.detail = f"a shard {HF_INDEX} names: {e.detail}"
            Exception.__init__(e, str(e))
            raise
    return p, names


@dataclass(frozen=True)
class ExternalTensor:
    """One tensor of a scanned external checkpoint (its key, bits' tag, shape, CRC32C of
    its bytes and the indexes of the files holding them)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    crc32c: int
    files: tuple[int, ...]


@dataclass(frozen=True)
class ExternalCheckpoint:
    """What :func:`scan_safetensors` (or the torch layer's DCP scan) found: the files with
    their sizes and CRCs, the tensors by key. Everything is checked before it is returned."""

    kind: str
    root: str
    files: tuple[RefFile, ...]
    tensors: Mapping[str, ExternalTensor]


def scan_safetensors(path: str | os.PathLike[str]) -> ExternalCheckpoint:
    """Scan a safetensors checkpoint (a file, or a directory with ``model.safetensors`` or
    an index and its shards): every file's header checked, every tensor's CRC32C and
    every file's CRC32C computed. A missing shard, a bad header or a key held by two
    shards raises naming the file."""
    root, names = _safetensors_layout(os.fspath(path))
    files: list[RefFile] = []
    tensors: dict[str, ExternalTensor] = {}
    for i, name in enumerate(names):
        p = os.path.join(root, name)
        size, fcrc = file_crc(p)
        src = open_source(p, "mmap")
        try:
            entries, start = safetensors_entries(src, p)
            for key, (tag, shape, b, e) in entries.items():
                if key in tensors:
                    raise FormatError(f"tensor {key!r} is in two shards", path=p,
                                      reason=Reason.BAD_METADATA)
                tensors[key] = ExternalTensor(key, tag, shape,
                                              crc32c(src.read(start + b, e - b)), (i,))
        finally:
            src.close()
        files.append(RefFile(name, size, fcrc))
    return ExternalCheckpoint("safetensors", root, tuple(files), tensors)


class ExternalSource(Protocol):
    """Reads tensors of an external checkpoint as arrays of their storage dtype."""

    def arrays(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The whole tensors of ``keys`` (views or copies; read-only use)."""

    def close(self) -> None:
        """Release files."""


class SafetensorsSource:
    """:class:`ExternalSource` of a safetensors reference: zero-copy views (mmap)."""

    def __init__(self, ref: Reference) -> None:
        self._srcs: list[tuple[Source, dict[str, tuple[str, tuple[int, ...], int, int]],
                               int]] = []
        self._where: dict[str, int] = {}
        try:
            for i in range(len(ref.files)):
                p = ref.file_path(i)
                src = open_source(p, "mmap")
                self._srcs.append((src, {}, 0))
                entries, start = safetensors_entries(src, p)
                self._srcs[-1] = (src, entries, start)
                for k in entries:
                    self._where.setdefault(k, i)
        except BaseException:
            self.close()
            raise
        self._ref = ref

    def arrays(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """See :class:`ExternalSource`."""
        out = {}
        for k in keys:
            if k not in self._where:
                raise CorruptRecordError(f"external checkpoint has no tensor {k!r}",
                                         reason=Reason.REFERENCE_CHANGED, path=self._ref.root)
            src, entries, start = self._srcs[self._where[k]]
            tag, shape, b, e = entries[k]
            out[k] = np.frombuffer(src.read(start + b, e - b),
                                   dtype=STORAGE_DTYPE[tag]).reshape(shape)
        return out

    def close(self) -> None:
        """See :class:`ExternalSource`."""
        for src, _e, _s in self._srcs:
            src.close()
        self._srcs = []


def _open_safetensors(ref: Reference) -> ExternalSource:
    return SafetensorsSource(ref)


#: kind -> opener, or the ``module:function`` of one imported when first needed (the DCP
#: reader needs torch). A fixed table: a kind read from a file never names code to run.
OPENERS: dict[str, Callable[[Reference], ExternalSource] | str] = {
    "safetensors": _open_safetensors,
    "dcp": "lowdiff_store.torch.core.dcp_source:open_dcp_source",
}


def open_external(ref: Reference) -> ExternalSource:
    """An :class:`ExternalSource` for ``ref`` (ConfigError(not_allowed) when the kind needs
    a package that is not installed)."""
    opener = OPENERS[ref.kind]
    if isinstance(opener, str):
        mod, fn = opener.split(":")
        try:
            opener = getattr(importlib.import_module(mod), fn)
        except ImportError as e:
            raise ConfigError(f"reading a {ref.kind} reference needs torch ({e})",
                              reason=Reason.NOT_ALLOWED, path=ref.root) from None
    assert callable(opener)
    return opener(ref)


# ------------------------------------------------------------------------ the base


def piece(arr: np.ndarray, box: tuple[tuple[int, ...], tuple[int, ...]] | None,
          shape: tuple[int, ...]) -> np.ndarray:
    """The box of ``shape`` at ``box[0]`` of ``arr`` (C-contiguous), or ``arr``."""
    if box is None:
        return arr
    return np.ascontiguousarray(arr[tuple(slice(o, o + s) for o, s in
                                          zip(box[0], shape, strict=True))])


class ReferenceBase:
    """A base whose tensors are partly in an external checkpoint; reads like a
    :class:`BaseFile` (``names``, ``info``, ``tensor``, ``meta``, ``verify_all``).

    Opening checks that every external file is present and of its recorded size; the
    external tensors are read together on first use, each checked against its recorded
    CRC32C (``reference_changed`` naming the file holding it)."""

    def __init__(self, bf: BaseFile, ref: Reference) -> None:
        """Wrap the base file ``bf`` (owned: closed with this) holding the table ``ref``."""
        self.file = bf
        self.reference = ref
        self.path = bf.path
        self.step = bf.step
        self.log_id = bf.log_id
        self._refs = {t.name: t for t in ref.tensors}
        self._loaded: dict[str, np.ndarray] | None = None
        self._checked: set[str] = set()
        clash = set(self._refs) & set(bf.names)
        if clash:
            raise FormatError(f"tensor {sorted(clash)[0]!r} is both in the base and referenced",
                              reason=Reason.BAD_METADATA, path=bf.path)
        check_files(ref, contents=False)

    @property
    def names(self) -> list[str]:
        """Tensor names: the base file's, then the referenced ones in table order."""
        return self.file.names + [t.name for t in self.reference.tensors]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype tag, shape) of a tensor."""
        t = self._refs.get(name)
        return (t.dtype, t.shape) if t is not None else self.file.info(name)

    @property
    def nbytes(self) -> int:
        """Size of the base file (the external checkpoint is not counted)."""
        return self.file.nbytes

    def _load(self) -> dict[str, np.ndarray]:
        if self._loaded is None:
            src = open_external(self.reference)
            try:
                keys = sorted({t.key for t in self.reference.tensors})
                self._loaded = src.arrays(keys)
            finally:
                src.close()
        return self._loaded

    def tensor(self, name: str, *, verify: bool = True) -> np.ndarray:
        """The tensor's bits (see :meth:`BaseFile.tensor`); a referenced one is read from
        the external checkpoint and checked against its recorded CRC32C."""
        t = self._refs.get(name)
        if t is None:
            return self.file.tensor(name, verify=verify)
        full = self._load()[t.key]
        want = t.box[1] if t.box is not None else t.shape
        if full.dtype != STORAGE_DTYPE[t.dtype] or tuple(full.shape) != want:
            raise CorruptRecordError(
                f"tensor {t.key!r} is now {full.dtype}{list(full.shape)}, the log recorded "
                f"{t.dtype}{list(want)}", reason=Reason.REFERENCE_CHANGED,
                path=self.reference.file_path(t.files[0]))
        arr = piece(full, t.box, t.shape)
        if verify and name not in self._checked:
            if crc32c(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data) != t.crc32c:
                raise CorruptRecordError(
                    f"tensor {t.key!r} changed since the log started (crc32c mismatch)",
                    reason=Reason.REFERENCE_CHANGED, path=self.reference.file_path(t.files[0]))
            self._checked.add(name)
        return arr

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Copy tensor ``name``'s bytes into ``out`` (see :meth:`BaseFile.read_into`); a
        referenced one is read and checked as by :meth:`tensor`, then copied."""
        if name not in self._refs:
            self.file.read_into(name, out)
            return
        arr = np.ascontiguousarray(self.tensor(name)).reshape(-1).view(np.uint8)
        if not (out.flags.c_contiguous and out.flags.writeable) or out.nbytes != arr.nbytes:
            raise LowdiffError(f"tensor {name!r} ({arr.nbytes} bytes) needs a writable "
                               f"contiguous buffer of its size, not {out.nbytes} bytes",
                               reason=Reason.INVALID_ARGUMENT, path=self.path)
        np.copyto(out.reshape(-1).view(np.uint8), arr, casting="no")

    def meta(self) -> dict[str, Any]:
        """The base's non-tensor state (the reference table included)."""
        return self.file.meta()

    def verify_all(self) -> None:
        """Check the base file, the size and CRC32C of every external file, then every
        referenced tensor's CRC32C (when a reader of the kind is installed: DCP needs
        torch)."""
        self.file.verify_all()
        check_files(self.reference, contents=True)
        try:
            self._load()
        except ConfigError as e:
            if e.reason is Reason.NOT_ALLOWED:
                return  # no reader for the kind here (DCP without torch): the file CRCs
                # above already cover every byte
            raise
        for t in self.reference.tensors:
            self.tensor(t.name)

    def close(self) -> None:
        """Release the base file and the tensors read."""
        self._loaded = None
        self.file.close()

    def __enter__(self) -> ReferenceBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What :meth:`LogReader.base` returns.
AnyBase = BaseFile | ReferenceBase


def as_base(bf: BaseFile) -> AnyBase:
    """``bf``, or a :class:`ReferenceBase` over it when its metadata holds a reference."""
    try:
        try:
            meta = bf.meta()
        except LowdiffError:
            return bf  # undecodable metadata: raised by meta() to whoever reads it
        obj = meta.get(REFERENCE_KEY)
        return bf if obj is None else ReferenceBase(bf, parse_reference(obj, bf.path))
    except BaseException:
        bf.close()
        raise


def table_of(bf: BaseFile) -> Reference | None:
    """The parsed reference table of a base file, or None (FormatError if malformed)."""
    obj = bf.meta().get(REFERENCE_KEY)
    return None if obj is None else parse_reference(obj, bf.path)


def summary(ref: Reference) -> dict[str, Any]:
    """A JSON-friendly description of a reference (``inspect``)."""
    return {"kind": ref.kind, "root": ref.root, "files": [f.name for f in ref.files],
            "file_bytes": sum(f.size for f in ref.files), "tensors": len(ref.tensors)}


def make_reference(ext: ExternalCheckpoint, tensors: Iterable[RefTensor]) -> Reference:
    """The :class:`Reference` of a base taking ``tensors`` from ``ext``. Every file of the
    checkpoint is kept (a DCP ``.metadata`` holds no tensor, and a changed one must be
    seen). FormatError(limit_exceeded) for a tensor larger than its files (a compressed
    DCP checkpoint: import it with an owned copy)."""
    ref = Reference(ext.kind, ext.root, ext.files, tuple(tensors))
    check_sizes(ref, ext.root)
    return ref


__all__ = ["FILE_NAME", "HF_INDEX", "KINDS", "OPENERS", "REFERENCE_KEY", "AnyBase",
           "ExternalCheckpoint", "ExternalSource", "ExternalTensor", "RefFile", "RefTensor",
           "Reference", "ReferenceBase", "SafetensorsSource", "as_base", "check_files",
           "check_sizes",
           "file_crc", "make_reference", "open_external", "parse_reference", "piece",
           "safetensors_entries", "scan_safetensors", "summary", "table_of"]
