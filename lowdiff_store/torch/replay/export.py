"""Writing reconstructed state to files other tools read: ``.pt`` (``torch.load(...,
weights_only=True)``), safetensors, HDF5, and the checkpoint directories of
:mod:`.checkpoint_dirs`: DCP and Hugging Face sharded safetensors."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ...errors import ConfigError, Reason, StorageError
from ...outputs import check_output, publish_output
from ..core import schema as L
from ..core.tensors import bits_view
from .checkpoint_dirs import (
    DEFAULT_MAX_SHARD_BYTES,
    safetensors_chunks,
    write_dcp,
    write_hf,
)

FORMATS = ("pt", "safetensors", "hdf5", "dcp", "hf")
#: Formats that publish a directory rather than a file.
DIRECTORY_FORMATS = ("dcp", "hf")

#: File name suffix -> export format (:func:`format_for_path`).
SUFFIXES = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors", ".h5": "hdf5",
            ".hdf5": "hdf5"}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_state` wrote.

    Attributes:
        path: the file (or directory, for ``dcp`` and ``hf``) published.
        format: one of :data:`FORMATS`.
        model_tensors: number of model tensors written (every state_dict name).
        optimizer_tensors: number of optimizer tensors written (``@opt/<param>/<key>``).
        bytes: size of the file (of every file of a directory).
    """

    path: str
    format: str
    model_tensors: int
    optimizer_tensors: int
    bytes: int


def format_for_path(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The export format for ``path``: ``format`` when given, else the one its suffix names
    (:data:`SUFFIXES`). ``ConfigError`` when ``format`` is not one of :data:`FORMATS`,
    contradicts a known suffix (``format="pt"`` for ``x.safetensors``), or is None and the
    suffix is unknown."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    implied = SUFFIXES.get(suffix)
    if format is None:
        if implied is None:
            raise ConfigError(f"cannot tell the export format from the name "
                              f"{os.fspath(path)!r}: use a suffix "
                              f"({', '.join(SUFFIXES)}) or pass the format "
                              f"({', '.join(FORMATS)})")
        return implied
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} must be one of {FORMATS}")
    if implied is not None and implied != format:
        raise ConfigError(f"format {format!r} contradicts the suffix of "
                          f"{os.fspath(path)!r} ({implied}): rename the file or drop the "
                          "format")
    return format


def flatten_optimizer_state(optimizer_state: Mapping[str, Any],
                            names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of an ``optimizer.state_dict()`` under ``@opt/<param name>/<key>``.

    ``names``: parameter names in optimizer order; by default the groups' ``param_names``
    (which :func:`replay_state` fills in)."""
    if names is None:
        names = [n for g in optimizer_state["param_groups"] for n in g.get("param_names", [])]
        if len(names) != sum(len(g["params"]) for g in optimizer_state["param_groups"]):
            raise ConfigError("the optimizer state has no param_names: pass names=")
    out: dict[str, torch.Tensor] = {}
    for idx, entries in optimizer_state["state"].items():
        for key, v in entries.items():
            if isinstance(v, torch.Tensor):
                out[L.opt_name(names[idx], str(key))] = v
    return out


def export_state(state: Mapping[str, torch.Tensor], out_path: str | os.PathLike[str],
                 format: str | None = None, *,
                 optimizer_state: Mapping[str, Any] | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 hf_config: str | os.PathLike[str] | Mapping[str, Any] | bytes | None = None
                 ) -> ExportResult:
    """Write named tensors to ``out_path`` atomically; returns what was written.

    ``format``: ``pt``, ``safetensors`` or ``hdf5``; by default the one the suffix of
    ``out_path`` names (``.pt``/``.pth``, ``.safetensors``, ``.h5``/``.hdf5``); a format
    that contradicts a known suffix is refused (:func:`format_for_path`).

    With ``optimizer_state`` (as returned by ``replay_state(..., with_optimizer=True)``)
    its tensors are added under ``@opt/<param name>/<key>``
    (:func:`flatten_optimizer_state`), and its param groups' hyperparameters go, as JSON,
    into the safetensors metadata / HDF5 root attribute ``optimizer_param_groups``.

    - ``pt``: ``torch.save`` of a plain ``dict[str, Tensor]`` (loads with
      ``torch.load(path, weights_only=True)``);
    - ``safetensors``: written here, streamed from the tensors without a copy (tensors
      that share memory get their own bytes each; loads with ``safetensors.torch.load_file``
      and every other safetensors reader);
    - ``hdf5``: one contiguous dataset per tensor (h5py), at the path of its name (``/`` in
      ``@opt/P/K`` nests groups); each has attributes ``dtype`` (the format tag) and
      ``name``; bfloat16/float8 are stored as their unsigned-integer bit patterns;
    - ``dcp`` (a directory, never implied by a name): a PyTorch Distributed Checkpoint
      written by ``torch.distributed.checkpoint.save``, ``{"model": ...}`` and with
      ``optimizer_state`` ``"optim"`` in ``get_optimizer_state_dict``'s layout
      (:func:`~.checkpoint_dirs.write_dcp`);
    - ``hf`` (a directory): Hugging Face sharded safetensors, shards of at most
      ``max_shard_bytes`` and ``model.safetensors.index.json``, plus ``config.json`` from
      ``hf_config``: a path, its bytes as :func:`~.checkpoint_dirs.read_hf_config` returns
      them, or a dict (model tensors only; :func:`~.checkpoint_dirs.write_hf`).

    The file is published like every output (:func:`~lowdiff_store.outputs.
    publish_output`): a temp file of a unique name in the same directory, fsync, rename,
    fsync of the directory. On failure (full disk, missing directory, read-only place)
    ``out_path`` is untouched, nothing is left behind, and a
    :class:`~lowdiff_store.errors.StorageError` names the path and the reason. A
    destination that is a log or lies inside one is refused before anything is written
    (:class:`~lowdiff_store.errors.ConfigError`, ``not_allowed``).
    """
    fmt = format_for_path(out_path, format)
    path = os.fspath(out_path)
    if fmt in DIRECTORY_FORMATS:
        return _export_dir(state, path, fmt, optimizer_state, max_shard_bytes, hf_config)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    n_model = len(tensors)
    groups = None
    if optimizer_state is not None:
        opt = flatten_optimizer_state(optimizer_state)
        clash = set(opt) & set(tensors)
        if clash:
            raise ConfigError(f"optimizer tensor names clash with model names: {sorted(clash)}")
        tensors.update({k: v.detach().cpu().contiguous() for k, v in opt.items()})
        groups = json.dumps([{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer_state["param_groups"]], default=_jsonable)
    if fmt == "hdf5":
        _check_h5py()
    writers: dict[str, Callable[[dict[str, torch.Tensor], BinaryIO, str | None], None]] = {
        "pt": _write_pt, "safetensors": _write_safetensors, "hdf5": _write_hdf5}
    size = publish_output(path, lambda f: writers[fmt](tensors, f, groups))
    return ExportResult(path, fmt, n_model, len(tensors) - n_model, size)


def _export_dir(state: Mapping[str, torch.Tensor], path: str, fmt: str,
                optimizer_state: Mapping[str, Any] | None, max_shard_bytes: int,
                hf_config: str | os.PathLike[str] | Mapping[str, Any] | bytes | None
                ) -> ExportResult:
    n_opt = 0
    if fmt == "dcp":
        if optimizer_state is not None:
            n_opt = len(flatten_optimizer_state(optimizer_state))
        size = write_dcp(path, state, optimizer_state)
    else:
        if optimizer_state is not None:
            raise ConfigError("format 'hf' holds model weights only: export the optimizer "
                              "with format 'dcp' (or pt/safetensors/hdf5)")
        size = write_hf(path, state, max_shard_bytes=max_shard_bytes, config=hf_config)
    return ExportResult(path, fmt, len(state), n_opt, size)


def check_destination(out_path: str | os.PathLike[str], format: str | None = None) -> None:
    """Refuse, before any long work, a destination :func:`export_state` cannot publish to:
    a directory (for a file format) or an existing file or non-empty directory (for a
    directory format), a missing parent directory, a read-only or unwritable place
    (:class:`~lowdiff_store.errors.StorageError` naming the path and the reason), a log or a
    place inside one (:class:`~lowdiff_store.errors.ConfigError`, ``not_allowed``)."""
    path = os.fspath(out_path)
    check_output(path)
    parent = os.path.dirname(os.path.abspath(path))
    err, why = 0, ""
    taken = os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path))
    if format in DIRECTORY_FORMATS and taken:
        err, why = errno.EEXIST, "it exists (a checkpoint directory is published whole)"
    elif format not in DIRECTORY_FORMATS and os.path.isdir(path):
        err, why = errno.EISDIR, "it is a directory"
    elif not os.path.isdir(parent):
        exists = os.path.exists(parent)
        err = errno.ENOTDIR if exists else errno.ENOENT
        why = f"{parent} {'is not a directory' if exists else 'does not exist'}"
    elif not os.access(parent, os.W_OK | os.X_OK):
        err = errno.EROFS if _read_only(parent) else errno.EACCES
        why = f"{parent} is {'on a read-only filesystem' if err == errno.EROFS else 'not writable'}"
    if err:
        e = StorageError(f"cannot write the export here: {why} ({os.strerror(err)}, errno "
                         f"{err})", path=path)
        e.errno = err
        raise e


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return str(v)


def _write_pt(tensors: dict[str, torch.Tensor], f: BinaryIO, groups: str | None) -> None:
    del groups  # a plain dict of tensors (weights_only loading): no room for metadata
    torch.save(dict(tensors), f)


def _write_safetensors(tensors: dict[str, torch.Tensor], f: BinaryIO, groups: str | None
                       ) -> None:
    meta = {"optimizer_param_groups": groups} if groups is not None else None
    for chunk in safetensors_chunks(tensors, meta):  # every tensor's bytes, shared or not
        f.write(chunk)


def _check_h5py() -> None:
    try:
        import h5py  # noqa: F401
    except ImportError:
        raise ConfigError("format='hdf5' needs h5py (pip install 'lowdiff-store[torch]')",
                          reason=Reason.NOT_ALLOWED) from None


def _write_hdf5(tensors: dict[str, torch.Tensor], f: BinaryIO, groups: str | None) -> None:
    import h5py

    with h5py.File(f, "w") as h5:
        if groups is not None:
            h5.attrs["optimizer_param_groups"] = groups
        for name, t in tensors.items():
            tag, arr = bits_view(t, name)
            ds = h5.create_dataset(name, data=arr)  # "@opt/P/K" nests as groups
            ds.attrs["dtype"] = tag
            ds.attrs["name"] = name


__all__ = ["DIRECTORY_FORMATS", "FORMATS", "SUFFIXES", "ExportResult", "check_destination",
           "export_state", "flatten_optimizer_state", "format_for_path"]
