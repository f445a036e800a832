"""Writing reconstructed state to files other tools read: ``.pt`` (``torch.load(...,
weights_only=True)``), safetensors, HDF5."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, Reason
from ..format.framing import align_up
from ..storage import atomic_write
from . import schema as L
from ._tensors import bits_view

FORMATS = ("pt", "safetensors", "hdf5")


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
                 format: str = "pt", *, optimizer_state: Mapping[str, Any] | None = None
                 ) -> None:
    """Write named tensors to ``out_path`` atomically.

    With ``optimizer_state`` (as returned by ``replay_state(..., with_optimizer=True)``)
    its tensors are added under ``@opt/<param name>/<key>``
    (:func:`flatten_optimizer_state`), and its param groups' hyperparameters go, as JSON,
    into the safetensors metadata / HDF5 root attribute ``optimizer_param_groups``.

    - ``pt``: ``torch.save`` of a plain ``dict[str, Tensor]`` (loads with
      ``torch.load(path, weights_only=True)``);
    - ``safetensors``: the ``safetensors`` package when importable, else an equivalent
      writer here (tensors that share memory are written as copies);
    - ``hdf5``: one contiguous dataset per tensor (h5py), at the path of its name (``/`` in
      ``@opt/P/K`` nests groups); each has attributes ``dtype`` (the format tag) and
      ``name``; bfloat16/float8 are stored as their unsigned-integer bit patterns.
    """
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} must be one of {FORMATS}")
    path = os.fspath(out_path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    groups = None
    if optimizer_state is not None:
        opt = flatten_optimizer_state(optimizer_state)
        clash = set(opt) & set(tensors)
        if clash:
            raise ConfigError(f"optimizer tensor names clash with model names: {sorted(clash)}")
        tensors.update({k: v.detach().cpu().contiguous() for k, v in opt.items()})
        groups = json.dumps([{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer_state["param_groups"]], default=_jsonable)
    writers: dict[str, Callable[[dict[str, torch.Tensor], str, str | None], None]] = {
        "pt": _write_pt, "safetensors": _write_safetensors, "hdf5": _write_hdf5}
    writers[format](tensors, path, groups)


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return str(v)


def _write_pt(tensors: dict[str, torch.Tensor], path: str, groups: str | None) -> None:
    del groups  # a plain dict of tensors (weights_only loading): no room for metadata
    tmp = path + ".tmp"
    torch.save(dict(tensors), tmp)
    os.replace(tmp, path)


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str, groups: str | None
                       ) -> None:
    meta = {"optimizer_param_groups": groups} if groups is not None else None
    try:
        from safetensors.torch import save_file
    except ImportError:
        atomic_write(path, _safetensors_chunks(tensors, meta))
        return
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        key = t.untyped_storage().data_ptr()
        out[k] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    tmp = path + ".tmp"
    save_file(out, tmp, metadata=meta)
    os.replace(tmp, path)


def _safetensors_chunks(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None
                        ) -> list[Any]:
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    chunks: list[Any] = []
    off = 0
    for name, t in tensors.items():
        tag, arr = bits_view(t, name)
        n = arr.nbytes
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [off, off + n]}
        chunks.append(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (align_up(8 + len(raw), 8) - 8 - len(raw))
    return [struct.pack("<Q", len(raw)), raw, *chunks]


def _write_hdf5(tensors: dict[str, torch.Tensor], path: str, groups: str | None) -> None:
    try:
        import h5py
    except ImportError:  # pragma: no cover - h5py is a dependency
        raise ConfigError("format='hdf5' needs h5py", reason=Reason.NOT_ALLOWED) from None
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        if groups is not None:
            f.attrs["optimizer_param_groups"] = groups
        for name, t in tensors.items():
            tag, arr = bits_view(t, name)
            ds = f.create_dataset(name, data=arr)  # "@opt/P/K" nests as groups
            ds.attrs["dtype"] = tag
            ds.attrs["name"] = name
    os.replace(tmp, path)


__all__ = ["FORMATS", "export_state", "flatten_optimizer_state"]
