"""Exports that are directories: a PyTorch Distributed Checkpoint (DCP) and Hugging Face's
sharded safetensors (``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``).

Both are published whole, as every output (:func:`lowdiff_store.outputs.publish_output`,
never inside a log): written into a hidden temp directory beside the destination, every file
fsynced, then renamed. A full disk or a killed export leaves no directory under the
destination's name.

DCP layout: ``{"model": <model state_dict>}`` and, with the optimizer, ``"optim"`` in the
layout ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` produces (state
and param groups keyed by parameter name), so ``dcp.load`` of ``{"model":
get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}`` followed by
``set_model_state_dict`` / ``set_optimizer_state_dict`` restores a plain model or an FSDP2
model at any world size. Written by ``torch.distributed.checkpoint.save`` itself, in this
process alone (``no_dist``); its ``.metadata`` is DCP's own (a pickle, written by torch).
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from ...format.framing import align_up
from ...log.reference import HF_INDEX, MAX_INDEX_BYTES
from ...outputs import publish_output
from ...storage import read_capped
from ..core.dcp_source import dcp_failure
from ..core.tensors import bits_view

#: Default shard size limit of ``format="hf"`` (Hugging Face's default, 5 GB).
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
_SIZE = re.compile(r"(\d+)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``5GB``, ``500MB``, ``64MiB`` or an int (ConfigError when unreadable)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.fullmatch(str(text).strip())
        if m is None:
            raise ConfigError(f"size {text!r} is not a number of bytes (e.g. 5GB, 64MiB)")
        n = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    if n <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return n


def dcp_optimizer_state(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` with ``param_names`` (as :func:`replay_state` returns
    it) in DCP's layout: state and ``params`` keyed by parameter name."""
    names = [n for g in optimizer_state["param_groups"] for n in g.get("param_names", [])]
    if len(names) != sum(len(g["params"]) for g in optimizer_state["param_groups"]):
        raise ConfigError("the optimizer state has no param_names")
    by_index = dict(zip((i for g in optimizer_state["param_groups"] for i in g["params"]),
                        names, strict=True))
    state = {by_index[i]: dict(v) for i, v in optimizer_state["state"].items()}
    groups = []
    for g in optimizer_state["param_groups"]:
        h = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        h["params"] = [by_index[i] for i in g["params"]]
        groups.append(h)
    return {"state": state, "param_groups": groups}


def write_dcp(path: str, model_state: Mapping[str, torch.Tensor],
              optimizer_state: Mapping[str, Any] | None = None) -> int:
    """Publish a DCP checkpoint of the state at ``path``; returns its bytes."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    sd: dict[str, Any] = {"model": {k: v.detach().cpu() for k, v in model_state.items()}}
    if optimizer_state is not None:
        sd["optim"] = dcp_optimizer_state(optimizer_state)

    def fill(tmp: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: saving in this process"
            try:
                dcp_save(sd, storage_writer=FileSystemWriter(tmp), no_dist=True)
            except CheckpointException as e:  # a BaseException wrapping the OSError
                raise dcp_failure(e) from None

    return publish_output(path, fill, directory=True)


def safetensors_chunks(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None
                        ) -> list[Any]:
    """The chunks of a safetensors file of ``tensors`` (bytes streamed from each tensor, no
    copy; tensors sharing memory get their own bytes each), header padded to 8 bytes."""
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


def hf_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
              ) -> list[list[str]]:
    """Tensor names split into shards in order, each under ``max_shard_bytes`` unless one
    tensor alone is larger (it then has a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def read_hf_config(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the ``config.json`` at ``path``, checked to be JSON. Read as every
    file a user names is (:func:`~lowdiff_store.storage.read_capped`): a FIFO, a device
    (``/dev/zero``) or a directory, through a link or not, is ``not_a_regular_file`` and
    never read; a file over the cap of the checkpoint's other JSON file, its index
    (:data:`~lowdiff_store.log.reference.MAX_INDEX_BYTES`), is ``metadata_too_large``
    before a byte of it is read; bytes that are not JSON, a ConfigError."""
    p = os.fspath(path)
    return _json_checked(read_capped(p, MAX_INDEX_BYTES), p)


def _json_checked(raw: bytes, path: str | None) -> bytes:
    try:
        json.loads(raw)
    except ValueError:
        raise ConfigError("the config is not JSON", path=path) from None
    return raw


def write_hf(path: str, model_state: Mapping[str, torch.Tensor], *,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
             config: str | os.PathLike[str] | Mapping[str, Any] | bytes | None = None
             ) -> int:
    """Publish the model state as Hugging Face sharded safetensors at ``path``:
    ``model-0000k-of-0000N.safetensors`` (metadata ``{"format": "pt"}``) and
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``); with
    ``config`` a ``config.json`` too, so ``from_pretrained(path)`` loads it: a path
    (copied as it is, read by :func:`read_hf_config`), its bytes (as that returns them)
    or a dict. Returns the bytes published."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    shards = hf_shards(tensors, max_shard_bytes)
    conf: bytes | None = None
    if isinstance(config, Mapping):
        conf = json.dumps(dict(config), indent=2, sort_keys=True).encode()
    elif isinstance(config, bytes):
        conf = _json_checked(config, None)
    elif config is not None:
        conf = read_hf_config(config)

    def fill(tmp: str) -> None:
        weight_map: dict[str, str] = {}
        total = 0
        for k, names in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            part = {n: tensors[n] for n in names}
            with open(os.path.join(tmp, fname), "wb") as f:
                for chunk in safetensors_chunks(part, {"format": "pt"}):
                    f.write(chunk)
            for n in names:
                weight_map[n] = fname
                total += part[n].numel() * part[n].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(tmp, HF_INDEX), "w") as f:
            json.dump(index, f, indent=2)
        if conf is not None:
            with open(os.path.join(tmp, "config.json"), "wb") as f:
                f.write(conf)

    return publish_output(path, fill, directory=True)


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "dcp_optimizer_state", "hf_shards", "parse_size",
           "read_hf_config", "safetensors_chunks", "write_dcp", "write_hf"]
