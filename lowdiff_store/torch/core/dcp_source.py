"""Reading a PyTorch Distributed Checkpoint (DCP) directory as an external checkpoint.

Everything here goes through torch's own ``torch.distributed.checkpoint`` (a
``FileSystemReader`` and ``load(..., no_dist=True)``), with one part replaced: a DCP
``.metadata`` file is a pickle, which torch's reader hands to ``pickle.load`` (a hostile one
runs any code it names). Here it is read by :class:`MetadataUnpickler`, which resolves only
the classes DCP's metadata is made of (:data:`METADATA_GLOBALS`, torch's dtypes): a pickle
naming anything else (``os.system``, ``builtins.eval``...) is refused, one line naming the
file and the offset, before any of it runs. Only tensor entries are loaded (torch reads the
data files with ``torch.load(..., weights_only=True)``); DCP's non-tensor entries (bytes
saved with ``torch.save``) are never requested.

Before torch reads a data file, the layout the metadata declares is checked against the
files on disk: every file it names is a plain name in the directory, present, regular and
long enough for every byte range the metadata places in it. A ``.metadata`` that does not
match its files is a one-line error naming the file, before anything is loaded or written.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import CorruptRecordError, FormatError, LowdiffError, Reason
from ...format.checksum import crc32c
from ...format.constants import MAX_ELEMENTS, MAX_NDIM
from ...format.dtypes import STORAGE_DTYPE
from ...log.reference import (
    FILE_NAME,
    ExternalCheckpoint,
    ExternalTensor,
    Reference,
    RefFile,
    file_crc,
)
from ...storage import os_error_in, regular_file_size
from .tensors import DTYPE_OF, TAG_OF, bits_view

#: The metadata file of a DCP checkpoint.
METADATA = ".metadata"
#: Cap on the size of a ``.metadata`` file read (it is read whole, then unpickled): far
#: above what torch writes for any model (hundreds of bytes per tensor chunk).
MAX_METADATA_BYTES = 1 << 30
#: Bytes of tensors loaded by one ``dcp.load`` call while scanning.
SCAN_BATCH_BYTES = 256 << 20


#: ``(module, name)`` of every global a DCP ``.metadata`` pickle may name besides torch's
#: dtypes: the metadata dataclasses, ``torch.Size``, the layout and memory-format
#: encodings, the path of ``StorageMeta.checkpoint_id`` and plain containers. Each builds
#: inert data from its arguments; nothing else is ever resolved.
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *((m, n) for m in ("pathlib", "pathlib._local")  # 3.13 moved the classes
      for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict", "slice")),
})


#: Names of torch's dtypes (``torch.float32``...), read from the module's namespace: a
#: name from the file is looked up here, never with ``getattr`` (which may import).
_DTYPES = frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))


class MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP ``.metadata`` pickle resolving only :data:`METADATA_GLOBALS` and torch's
    dtypes; any other global is a :class:`FormatError` (``bad_metadata``) naming the file
    and the offset of the global's module name in it, raised before the global is looked
    up."""

    def __init__(self, raw: bytes, path: str) -> None:
        """Read the pickle ``raw`` (the bytes of the file ``path``, named in errors)."""
        super().__init__(io.BytesIO(raw))
        self._raw = raw
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if allowed (see the class)."""
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        at = self._raw.find(module.encode("utf-8", "replace"))
        raise FormatError(f"DCP metadata names {module}.{name}, which is not part of DCP's "
                          f"metadata: refused, not run", reason=Reason.BAD_METADATA,
                          path=self._path, offset=at if at >= 0 else None)


def read_metadata_file(path: str) -> Any:
    """The ``Metadata`` object of the DCP ``.metadata`` file at ``path``, read by
    :class:`MetadataUnpickler` (FormatError naming the file for a global outside the
    allow-list or for bytes that are not a pickle of one)."""
    from torch.distributed.checkpoint.metadata import Metadata

    size = regular_file_size(path)
    if size > MAX_METADATA_BYTES:
        raise FormatError(f"DCP metadata of {size} bytes exceeds the cap of "
                          f"{MAX_METADATA_BYTES}", reason=Reason.METADATA_TOO_LARGE,
                          path=path, offset=0)
    with open(path, "rb") as f:
        raw = f.read(size)
    try:
        md = MetadataUnpickler(raw, path).load()
    except LowdiffError:
        raise
    except Exception as e:  # pickle raises anything on bad bytes
        raise FormatError(f"DCP metadata unreadable ({type(e).__name__}: "
                          f"{' '.join(str(e).split())})", reason=Reason.BAD_METADATA,
                          path=path) from None
    if not isinstance(md, Metadata):
        raise FormatError(f"DCP metadata is a {type(md).__name__}, not a Metadata",
                          reason=Reason.BAD_METADATA, path=path)
    return md


def dcp_failure(exc: BaseException) -> BaseException:
    """The first error a ``torch.distributed.checkpoint`` save or load failed with.

    DCP wraps what failed (an ``OSError`` of a full disk, a data file ``torch.load``
    refuses) in a ``CheckpointException``, which derives from ``BaseException`` and prints
    as a multi-line traceback: callers catch it and raise what this returns (``exc`` itself
    when it wraps nothing). A failure with an ``OSError`` down its chain gives that
    ``OSError`` (:func:`~lowdiff_store.storage.os_error_in`): torch.save, writing a
    tensor, turns a full disk into ``RuntimeError("[enforce fail at
    inline_container.cc...]")`` and keeps the errno only as its ``__context__``, which
    raising it again from the caller's ``except`` would replace."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for pair in failures.values():
            inner = pair[0] if isinstance(pair, tuple) and pair else None
            if isinstance(inner, BaseException):
                return os_error_in(inner) or inner
    return exc


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


@functools.cache
def _reader_class() -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):  # type: ignore[misc]
        """torch's reader, with ``.metadata`` read by :func:`read_metadata_file`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = METADATA if rank is None else f"__{int(rank)}{METADATA}"
            md = read_metadata_file(os.path.join(os.fspath(self.path), name))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader


def _reader(root: str) -> Any:
    return _reader_class()(root)


def read_layout(root: str) -> tuple[dict[str, tuple[str, tuple[int, ...], set[str]]],
                                    dict[str, int]]:
    """Read (through torch) and check a DCP checkpoint's metadata against its files:
    ``({key: (tag, shape, file names)} for the tensor entries, {file name: size})``."""
    meta_path = os.path.join(root, METADATA)
    if not os.path.isdir(root):
        raise LowdiffError("DCP checkpoint directory is missing", reason=Reason.MISSING_FILE,
                           path=root)
    if not os.path.isfile(meta_path):
        raise LowdiffError("not a DCP checkpoint (no .metadata)", reason=Reason.MISSING_FILE,
                           path=meta_path)
    try:
        md = _reader(root).read_metadata()  # torch unpickles .metadata
        sdm, storage = md.state_dict_metadata, md.storage_data
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise TypeError("no state_dict_metadata / storage_data")
    except LowdiffError:
        raise
    except Exception as e:  # torch raises anything on bad bytes
        raise FormatError(f"DCP metadata unreadable ({type(e).__name__}: {e})",
                          reason=Reason.BAD_METADATA, path=meta_path) from None
    try:
        return _layout(root, meta_path, sdm, storage)
    except LowdiffError:  # a FormatError is a ValueError too
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        # a pickle of the allowed classes with other types in their fields
        raise FormatError(f"DCP metadata malformed ({type(e).__name__}: "
                          f"{' '.join(str(e).split())})", reason=Reason.BAD_METADATA,
                          path=meta_path) from None


def _nat(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{v!r} is not a natural number")
    return v


def _layout(root: str, meta_path: str, sdm: dict[Any, Any], storage: dict[Any, Any]
            ) -> tuple[dict[str, tuple[str, tuple[int, ...], set[str]]], dict[str, int]]:
    sizes: dict[str, int] = {}
    where: dict[str, set[str]] = {}
    stored: dict[str, int] = {}  # bytes of storage per key; -1 once one is transformed
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or FILE_NAME.fullmatch(name) is None:
            raise FormatError(f"DCP metadata names {name!r}, not a file name in its directory",
                              reason=Reason.UNSAFE_NAME, path=meta_path)
        p = os.path.join(root, name)
        if name not in sizes:
            if not os.path.isfile(p):
                raise LowdiffError("file named by the DCP metadata is missing",
                                   reason=Reason.MISSING_FILE, path=p)
            sizes[name] = os.path.getsize(p)
        off, length = _nat(info.offset), _nat(info.length)
        if off + length > sizes[name]:
            raise FormatError(f"DCP metadata places {length} bytes at {off}, the file has "
                              f"{sizes[name]}: the metadata does not match its files",
                              reason=Reason.TRUNCATED, path=p, offset=off)
        fqn = index.fqn
        if not isinstance(fqn, str):
            raise TypeError(f"storage key {fqn!r} is not a string")
        where.setdefault(fqn, set()).add(name)
        packed = bool(getattr(info, "transform_descriptors", None))
        stored[fqn] = -1 if packed or stored.get(fqn) == -1 else stored.get(fqn, 0) + length
    tensors: dict[str, tuple[str, tuple[int, ...], set[str]]] = {}
    for key, entry in sdm.items():
        size = getattr(entry, "size", None)
        if size is None:
            continue  # bytes entries: never loaded here
        dtype = entry.properties.dtype
        if dtype not in TAG_OF:
            raise FormatError(f"DCP tensor {key!r} has dtype {dtype}, which the format lacks",
                              reason=Reason.BAD_DTYPE, path=meta_path)
        if key not in where:
            raise FormatError(f"DCP metadata has no storage for tensor {key!r}",
                              reason=Reason.BAD_METADATA, path=meta_path)
        shape = tuple(_nat(d) for d in size)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * STORAGE_DTYPE[TAG_OF[dtype]].itemsize
        # nothing is allocated for more bytes than the files hold (torch.save'd data of
        # an uncompressed tensor is at least its bytes; a transformed one is capped by the
        # format's element limit)
        if len(shape) > MAX_NDIM or numel > MAX_ELEMENTS or (
                stored[key] >= 0 and nbytes > stored[key]):
            raise FormatError(f"DCP tensor {key!r} of shape {list(shape)} ({nbytes} bytes) is "
                              f"larger than the {stored[key]} bytes stored for it",
                              reason=Reason.LIMIT_EXCEEDED, path=meta_path)
        tensors[key] = (TAG_OF[dtype], shape, where[key])
    return tensors, sizes


def load_arrays(root: str, layout: dict[str, tuple[str, tuple[int, ...], set[str]]],
                keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The tensors ``keys`` of the DCP checkpoint at ``root``, loaded by torch into fresh
    CPU tensors (in this process alone: ``no_dist``), as arrays of their bits."""
    sd = {k: torch.empty(layout[k][1], dtype=DTYPE_OF[layout[k][0]]) for k in keys}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.distributed.checkpoint.state_dict_loader import load

            try:
                load(sd, storage_reader=_reader(root), no_dist=True)
            except _checkpoint_exception() as e:  # a BaseException: what it wraps
                raise dcp_failure(e) from None
    except LowdiffError:
        raise
    except Exception as e:  # torch raises anything on bad bytes
        files = sorted({f for k in keys for f in layout[k][2]})
        raise FormatError(f"DCP load failed ({type(e).__name__}: {' '.join(str(e).split())})",
                          reason=Reason.BAD_METADATA,
                          path=os.path.join(root, files[0] if files else METADATA)) from None
    return {k: bits_view(t, k)[1] for k, t in sd.items()}


def _batches(layout: dict[str, tuple[str, tuple[int, ...], set[str]]]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for k, (tag, shape, _f) in layout.items():
        n = int(np.prod(shape, dtype=np.int64)) * STORAGE_DTYPE[tag].itemsize
        if out[-1] and size + n > SCAN_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out


def scan_dcp(path: str | os.PathLike[str]) -> ExternalCheckpoint:
    """Scan a DCP checkpoint: its metadata checked against its files, the CRC32C of
    ``.metadata`` and of every data file, and every tensor loaded (in batches of
    :data:`SCAN_BATCH_BYTES`) for the CRC32C of its bytes."""
    root = os.path.abspath(os.fspath(path))
    layout, sizes = read_layout(root)
    names = [METADATA, *sorted(sizes)]
    files = []
    for name in names:
        size, crc = file_crc(os.path.join(root, name))
        files.append(RefFile(name, size, crc))
    index = {n: i for i, n in enumerate(names)}
    tensors: dict[str, ExternalTensor] = {}
    for batch in _batches(layout):
        for k, arr in load_arrays(root, layout, batch).items():
            tag, shape, where = layout[k]
            crc = crc32c(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
            tensors[k] = ExternalTensor(k, tag, shape, crc,
                                        tuple(sorted(index[f] for f in where)))
    return ExternalCheckpoint("dcp", root, tuple(files), tensors)


class DcpSource:
    """:class:`~lowdiff_store.log.reference.ExternalSource` of a DCP reference."""

    def __init__(self, ref: Reference) -> None:
        self._root = ref.root
        # torch unpickles .metadata: it must be the very file the log recorded first
        recorded = {f.name: f for f in ref.files}.get(METADATA)
        path = os.path.join(ref.root, METADATA)
        if recorded is None:
            raise FormatError("a DCP reference without .metadata in its files",
                              reason=Reason.BAD_METADATA, path=ref.root)
        size, crc = file_crc(path)
        if (size, crc) != (recorded.size, recorded.crc32c):
            raise CorruptRecordError("DCP metadata changed since the log started (size or "
                                     "crc32c differs): not read", path=path,
                                     reason=Reason.REFERENCE_CHANGED)
        self._layout, _sizes = read_layout(ref.root)

    def arrays(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The whole tensors ``keys`` (copies owned by the caller)."""
        missing = [k for k in keys if k not in self._layout]
        if missing:
            raise FormatError(f"DCP checkpoint no longer has tensor {missing[0]!r}",
                              reason=Reason.REFERENCE_CHANGED,
                              path=os.path.join(self._root, METADATA))
        return load_arrays(self._root, self._layout, keys)

    def close(self) -> None:
        """Nothing is held open between calls."""


def open_dcp_source(ref: Reference) -> DcpSource:
    """The opener :data:`lowdiff_store.log.reference.OPENERS` names for ``"dcp"``."""
    return DcpSource(ref)


__all__ = ["MAX_METADATA_BYTES", "METADATA", "METADATA_GLOBALS", "SCAN_BATCH_BYTES", "DcpSource",
           "MetadataUnpickler", "dcp_failure", "load_arrays", "open_dcp_source",
           "read_layout", "read_metadata_file", "scan_dcp"]
