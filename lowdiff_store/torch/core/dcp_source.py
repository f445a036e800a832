"""Reading a PyTorch Distributed Checkpoint (DCP) directory as an external checkpoint.

Everything here goes through torch's own ``torch.distributed.checkpoint`` (a
``FileSystemReader`` and ``load(..., no_dist=True)``): a DCP ``.metadata`` file is a pickle,
which torch reads and lowdiff-store's own format readers never do. Only tensor entries are
loaded; DCP's non-tensor entries (bytes saved with ``torch.save``, loaded by DCP with
``weights_only=False``) are never requested, so no object of the checkpoint is unpickled by
a load made here.

Before torch reads a data file, the layout the metadata declares is checked against the
files on disk: every file it names is a plain name in the directory, present, regular and
long enough for every byte range the metadata places in it. A ``.metadata`` that does not
match its files is a one-line error naming the file, before anything is loaded or written.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import CorruptRecordError, FormatError, LowdiffError, Reason
from ...format.checksum import crc32c
from ...format.dtypes import STORAGE_DTYPE
from ...log.reference import (
    FILE_NAME,
    ExternalCheckpoint,
    ExternalTensor,
    Reference,
    RefFile,
    file_crc,
)
from .tensors import DTYPE_OF, TAG_OF, bits_view

#: The metadata file of a DCP checkpoint.
METADATA = ".metadata"
#: Bytes of tensors loaded by one ``dcp.load`` call while scanning.
SCAN_BATCH_BYTES = 256 << 20


def _reader(root: str) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(root)


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
    except Exception as e:  # torch raises anything on bad bytes
        raise FormatError(f"DCP metadata unreadable ({type(e).__name__}: {e})",
                          reason=Reason.BAD_METADATA, path=meta_path) from None
    sizes: dict[str, int] = {}
    where: dict[str, set[str]] = {}
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
        off, length = int(info.offset), int(info.length)
        if off < 0 or length < 0 or off + length > sizes[name]:
            raise FormatError(f"DCP metadata places {length} bytes at {off}, the file has "
                              f"{sizes[name]}: the metadata does not match its files",
                              reason=Reason.TRUNCATED, path=p, offset=off)
        where.setdefault(str(index.fqn), set()).add(name)
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
        tensors[str(key)] = (TAG_OF[dtype], tuple(int(d) for d in size), where[key])
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

            load(sd, storage_reader=_reader(root), no_dist=True)
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


__all__ = ["METADATA", "SCAN_BATCH_BYTES", "DcpSource", "load_arrays", "open_dcp_source",
           "read_layout", "scan_dcp"]
