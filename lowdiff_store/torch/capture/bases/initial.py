"""Starting a log from an existing checkpoint without copying it (``initial_base=``).

``DiffCheckpointer(path, model, optimizer, initial_base="ckpt")`` on a new log:

1. scans the external checkpoint (a DCP directory written by ``torch.distributed.checkpoint``,
   a safetensors file, or a directory of sharded safetensors with
   ``model.safetensors.index.json``): every check passes (files present, metadata matching
   its files, index naming existing shards, every tensor read and its CRC32C computed)
   before anything is written;
2. loads it into the model and the optimizer (this is also the import path: training
   resumes from a checkpoint another tool wrote, as step 0 of a new log). Model tensors are
   found under their ``state_dict`` names, with a prefix (``model.`` for DCP's
   ``{"model": ..., "optim": ...}`` layout) detected or given; optimizer state under
   ``<prefix>state.<param name>.<key>`` (the layout of
   ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), if present.
   Hyperparameters stay the optimizer's own (DCP's ``param_groups`` are pickled bytes,
   never loaded here);
3. writes base 0 as a *reference base* (:mod:`lowdiff_store.log.reference`): every tensor
   whose bits equal the external one is referenced with its CRC32C; what the checkpoint
   lacks (RNG states, buffers it does not hold, state cast on load) is stored in the base.

On an FSDP2 job each rank's base references the boxes of the external tensors its pieces
are (``box`` in the reference table), so every rank reads only what it holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....errors import ConfigError, Reason
from ....format.checksum import crc32c_parallel
from ....log import LogReader
from ....log.reference import (
    REFERENCE_KEY,
    ExternalCheckpoint,
    Reference,
    RefTensor,
    make_reference,
    open_external,
    piece,
    scan_safetensors,
)
from ...core import schema as L
from ...core.dcp_source import METADATA, scan_dcp
from ...core.tensors import TAG_OF, ModelEntries, from_bits, local_of, write_bits
from ..sink import manifest_exists

#: Key prefixes tried for model tensors and for optimizer state, in order.
MODEL_PREFIXES = ("", "model.", "app.model.")
OPTIM_PREFIXES = ("optim.", "optimizer.", "app.optim.", "app.optimizer.")


@dataclass
class InitialBase:
    """An external checkpoint a new log starts from (``initial_base=``).

    Attributes:
        path: a DCP directory, a safetensors file, or a directory holding
            ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
        kind: ``"dcp"`` or ``"safetensors"``; None: a directory with ``.metadata`` is DCP.
        model_prefix: key prefix of the model tensors; None: the first of
            :data:`MODEL_PREFIXES` under which every parameter is found.
        optim_prefix: key prefix of the optimizer state; None: the first of
            :data:`OPTIM_PREFIXES` with a ``state.`` entry (no optimizer state if none).
        copy: base 0 holds a copy of the loaded state instead of referencing the
            checkpoint (a plain import: the log no longer needs the checkpoint).
        load: load the checkpoint into the model and the optimizer. False: they already
            hold its state (a trainer loaded it, or saved it after the step): nothing is
            loaded, no tensor needs to be found; the base refers to every tensor found under
            a key of its dtype and global shape whose bits are the checkpoint's
            (:func:`match_live`), and stores the others.
        scanned: the result of :meth:`scan` once made (a sharded job scans before it
            writes its ``SHARDS`` manifest, then hands this object on).
    """

    path: str
    kind: str | None = None
    model_prefix: str | None = None
    optim_prefix: str | None = None
    copy: bool = False
    load: bool = True
    scanned: ExternalCheckpoint | None = field(default=None, repr=False)

    def scan(self) -> ExternalCheckpoint:
        """The checked scan of the checkpoint (made once)."""
        if self.scanned is None:
            p = os.path.abspath(os.fspath(self.path))
            kind = self.kind or ("dcp" if os.path.isfile(os.path.join(p, METADATA))
                                 else "safetensors")
            if kind not in ("dcp", "safetensors"):
                raise ConfigError(f"initial_base kind {kind!r} must be 'dcp' or 'safetensors'")
            self.scanned = scan_dcp(p) if kind == "dcp" else scan_safetensors(p)
        return self.scanned


def as_initial_base(value: Any) -> InitialBase:
    """``initial_base=`` as given (a path or an :class:`InitialBase`)."""
    if isinstance(value, InitialBase):
        return value
    if isinstance(value, (str, os.PathLike)):
        return InitialBase(os.fspath(value))
    raise ConfigError(f"initial_base={value!r} must be a path or an InitialBase")


@dataclass(frozen=True)
class _Loaded:
    key: str
    box: tuple[tuple[int, ...], tuple[int, ...]] | None
    crc: int


class StartingPoint:
    """The external state loaded into the live objects, and how base 0 refers to it."""

    def __init__(self, ext: ExternalCheckpoint, loaded: Mapping[str, _Loaded], *,
                 copy: bool = False) -> None:
        self.ext = ext
        self.loaded = dict(loaded)
        self.copy = copy

    def base(self, tensors: Mapping[str, tuple[str, np.ndarray]], meta: Mapping[str, Any],
             crcs: Mapping[str, int] | None = None
             ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, Any]]:
        """The base's ``(tensors, meta)``: every tensor whose bits are still those loaded
        from the checkpoint (found in it) is referenced instead of stored (with ``copy``:
        the base as it is, an owned copy). ``crcs``: the arrays' CRC32Cs where already
        computed (by the copy that staged them). A base referring to nothing holds no
        reference table (it does not depend on the checkpoint)."""
        if self.copy:
            return dict(tensors), dict(meta)
        kept: dict[str, tuple[str, np.ndarray]] = {}
        refs: list[RefTensor] = []
        known = crcs or {}
        for name, (tag, arr) in tensors.items():
            ld = self.loaded.get(name)
            if ld is not None and (known[name] if name in known else crc_of(arr)) == ld.crc:
                et = self.ext.tensors[ld.key]
                refs.append(RefTensor(name, ld.key, tag, tuple(arr.shape), ld.crc, et.files,
                                      ld.box))
            else:
                kept[name] = (tag, arr)
        if not refs:  # nothing of the checkpoint in the base: it does not depend on it
            return kept, dict(meta)
        ref: Reference = make_reference(self.ext, refs)
        return kept, {**meta, REFERENCE_KEY: ref.to_obj()}


def crc_of(arr: np.ndarray) -> int:
    """The CRC32C of ``arr``'s bytes (on several cores for a large one)."""
    return crc32c_parallel([np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data])


def _box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, global shape) of the box of the global tensor a DTensor's local piece is;
    None for a plain tensor."""
    if local_of(t) is t:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return tuple(int(o) for o in offset), tuple(int(s) for s in t.shape)


def _find(keys: Mapping[str, Any], prefixes: Sequence[str], names: Sequence[str],
          aliases: Mapping[str, Sequence[str]], given: str | None, root: str
          ) -> tuple[str, dict[str, str]]:
    """(prefix, {name: key}) for the names found; every parameter name in ``names`` must be
    found under the prefix chosen."""
    tries = [given] if given is not None else list(prefixes)
    best: tuple[int, str, dict[str, str]] | None = None
    for pre in tries:
        found = {}
        for n in names:
            for cand in (n, *aliases.get(n, ())):
                if pre + cand in keys:
                    found[n] = pre + cand
                    break
        if len(found) == len(names):
            return pre, found
        if best is None or len(found) > best[0]:
            best = (len(found), pre, found)
    assert best is not None
    missing = next(n for n in names if n not in best[2])
    raise ConfigError(f"the checkpoint has no tensor for parameter {missing!r} (tried "
                      f"{', '.join(repr(p + missing) for p in tries)})",
                      reason=Reason.STATE_MISMATCH, path=root)


def load_initial(init: InitialBase, model: Mapping[str, torch.Tensor],
                 aliases: Mapping[str, str], names: Sequence[str],
                 params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
                 ) -> StartingPoint:
    """Scan ``init`` (every check first), then load it into the model tensors ``model``
    (canonical names; DTensors get their piece) and the optimizer stepping ``params``
    (named ``names``). Dtypes and global shapes must match the checkpoint's."""
    ext = init.scan()
    alias_of: dict[str, list[str]] = {}
    for a, canon in aliases.items():
        alias_of.setdefault(canon, []).append(a)
    model_keys_all: dict[str, str] = {}
    pre, found = _find(ext.tensors, MODEL_PREFIXES, list(names), alias_of, init.model_prefix,
                       ext.root)
    model_keys_all.update(found)
    for n in model:  # buffers and parameters outside the optimizer: optional
        if n not in model_keys_all:
            for cand in (n, *alias_of.get(n, ())):
                if pre + cand in ext.tensors:
                    model_keys_all[n] = pre + cand
                    break
    opt_keys = _optimizer_keys(ext, names, init.optim_prefix)
    wanted = sorted(set(model_keys_all.values()) | {k for d in opt_keys.values()
                                                    for k in d.values()})
    src = open_external(Reference(ext.kind, ext.root, ext.files, ()))
    try:
        arrays = src.arrays(wanted)
    finally:
        src.close()
    loaded: dict[str, _Loaded] = {}
    with torch.no_grad():
        for n, key in model_keys_all.items():
            loaded[n] = _write(model[n], arrays[key], ext, key, n)
        opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in zip(names, params, strict=True):
            for k, key in opt_keys.get(n, {}).items():
                t = _state_tensor(p, arrays[key], ext, key)
                opt_tensors.setdefault(n, {})[k] = t
                box = _box(p) if arrays[key].ndim else None
                loaded[L.opt_name(n, k)] = _Loaded(key, box, crc_of(piece(arrays[key], box,
                                                                        _local_shape(p, t))))
    if opt_tensors:
        sd = L.build_optimizer_state(list(names), [len(g["params"]) for g in
                                                   optimizer.param_groups],
                                     L.hyper_of(optimizer), opt_tensors, {})
        try:
            optimizer.load_state_dict(sd)
        except (TypeError, ValueError, KeyError, RuntimeError) as e:
            raise ConfigError(f"the optimizer refused the checkpoint's state ({type(e).__name__}"
                              f": {e})", reason=Reason.STATE_MISMATCH, path=ext.root) from e
    return StartingPoint(ext, loaded, copy=init.copy)


def match_live(init: InitialBase, model: Mapping[str, torch.Tensor],
               aliases: Mapping[str, str], names: Sequence[str],
               params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> StartingPoint:
    """Scan ``init`` (every check first) and find, without loading anything, the tensors of
    the live state it holds: each model tensor (canonical names; a DTensor's piece is a
    box) under a key of the same dtype and global shape, each optimizer state tensor of
    ``params`` (named ``names``) under ``<prefix>state.<name>.<key>``. The base written
    from the result refers to those whose bits equal the checkpoint's (its CRC32C of the
    piece) and stores everything else: a checkpoint written from these objects (a
    trainer's own save) is referenced, tensors its writer renamed or converted are kept."""
    ext = init.scan()
    alias_of: dict[str, list[str]] = {}
    for a, canon in aliases.items():
        alias_of.setdefault(canon, []).append(a)
    wanted: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}  # name -> key, t, like
    best: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for pre in [init.model_prefix] if init.model_prefix is not None else MODEL_PREFIXES:
        found = {}
        for n, t in model.items():
            key = next((pre + c for c in (n, *alias_of.get(n, ()))
                        if _fits(ext, pre + c, t, t)), None)
            if key is not None:
                found[n] = (key, t, t)
        if len(found) > len(best):
            best = found
    wanted.update(best)
    opt_keys = _optimizer_keys(ext, names, init.optim_prefix)
    for n, p in zip(names, params, strict=True):
        state = optimizer.state.get(p, {})
        for k, key in opt_keys.get(n, {}).items():
            v = state.get(k)
            if isinstance(v, torch.Tensor) and _fits(ext, key, v, p):
                wanted[L.opt_name(n, k)] = (key, v, p)
    loaded: dict[str, _Loaded] = {}
    cut: dict[str, tuple[str, Any, tuple[int, ...]]] = {}  # pieces: CRC of the box
    for name, (key, t, like) in wanted.items():
        box = _box(like) if t.ndim else None
        shape = tuple(local_of(like).shape) if t.ndim else ()
        if box is None or (not any(box[0]) and box[1] == shape):
            loaded[name] = _Loaded(key, box, ext.tensors[key].crc32c)
        else:
            cut[name] = (key, box, shape)
    if cut:
        src = open_external(Reference(ext.kind, ext.root, ext.files, ()))
        try:
            arrays = src.arrays(sorted({key for key, _b, _s in cut.values()}))
        finally:
            src.close()
        for name, (key, box, shape) in cut.items():
            loaded[name] = _Loaded(key, box, crc_of(piece(arrays[key], box, shape)))
    return StartingPoint(ext, loaded)


def _fits(ext: ExternalCheckpoint, key: str, t: torch.Tensor, like: torch.Tensor) -> bool:
    """The checkpoint holds ``key`` with ``t``'s dtype and, for a tensor of ``like``'s
    (global) shape, that shape; a 0-d ``t``: a 0-d entry."""
    et = ext.tensors.get(key)
    if et is None or TAG_OF.get(t.dtype) != et.dtype:
        return False
    return et.shape == (tuple(like.shape) if t.ndim else ())


def start_from(value: Any, path: str, entries: ModelEntries, names: Sequence[str],
               params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> StartingPoint:
    """:func:`load_initial` (:func:`match_live` for an :class:`InitialBase` with
    ``load=False``) for ``DiffCheckpointer(path, ..., initial_base=value)``: the log
    at ``path`` must be new (ConfigError(history_conflict) before anything is read): no
    manifest, or one with no base and no record yet (an import killed before its base 0
    was published, which ``latest_step`` calls "start fresh": running it again starts it)."""
    init = as_initial_base(value)
    if _holds_history(path):
        raise ConfigError(f"initial_base={init.path!r} starts a new log, and {path} already "
                          f"holds one: restore() it or use an empty directory",
                          reason=Reason.HISTORY_CONFLICT, path=path)
    if not init.load:
        return match_live(init, entries.tensors, entries.aliases, names, params, optimizer)
    return load_initial(init, entries.tensors, entries.aliases, names, params, optimizer)


def _holds_history(path: str) -> bool:
    if not manifest_exists(path):
        return False
    with LogReader(path) as r:
        return bool(r.bases) or (r.last_step is not None and r.last_step >= 0)


def _local_shape(p: torch.Tensor, t: torch.Tensor) -> tuple[int, ...]:
    return tuple(local_of(p).shape) if t.ndim else ()


def _optimizer_keys(ext: ExternalCheckpoint, names: Sequence[str], given: str | None
                    ) -> dict[str, dict[str, str]]:
    """{param name: {state key: checkpoint key}} of the optimizer state present (keys
    ``<prefix>state.<param name>.<state key>``, the state key without dots)."""
    prefixes = [given] if given is not None else list(OPTIM_PREFIXES)
    pre = next((p + "state." for p in prefixes
                if any(k.startswith(p + "state.") for k in ext.tensors)), None)
    out: dict[str, dict[str, str]] = {}
    if pre is None:
        return out
    known = set(names)
    for key in ext.tensors:
        if key.startswith(pre):
            n, _dot, k = key[len(pre):].rpartition(".")
            if n in known:
                out.setdefault(n, {})[k] = key
    return out


def _file_of(ext: ExternalCheckpoint, key: str) -> str:
    """The file holding (the first bytes of) ``key``, for messages."""
    return os.path.join(ext.root, ext.files[ext.tensors[key].files[0]].name)


def _check(t: torch.Tensor, ext: ExternalCheckpoint, key: str) -> None:
    et = ext.tensors[key]
    tag = TAG_OF.get(t.dtype)
    if tag != et.dtype or tuple(t.shape) != et.shape:
        raise ConfigError(f"checkpoint tensor {key!r} is {et.dtype}{list(et.shape)}, the "
                          f"model's is {tag}{list(t.shape)}", reason=Reason.STATE_MISMATCH,
                          path=_file_of(ext, key))


def _write(t: torch.Tensor, arr: np.ndarray, ext: ExternalCheckpoint, key: str, what: str
           ) -> _Loaded:
    _check(t, ext, key)
    local = local_of(t)
    box = _box(t)
    bits = piece(arr, box, tuple(local.shape))
    write_bits(local, ext.tensors[key].dtype, bits, what)
    return _Loaded(key, box, crc_of(bits))


def _state_tensor(p: torch.Tensor, arr: np.ndarray, ext: ExternalCheckpoint, key: str
                  ) -> torch.Tensor:
    """An optimizer state tensor for parameter ``p`` from the checkpoint: a scalar as it
    is, a tensor of the parameter's global shape as ``p``'s piece (a DTensor like ``p``)."""
    et = ext.tensors[key]
    if not et.shape:
        return from_bits(et.dtype, np.array(arr, order="C"))  # a copy that keeps 0-d
    if et.shape != tuple(p.shape):
        raise ConfigError(f"checkpoint tensor {key!r} has shape {list(et.shape)}, its "
                          f"parameter {list(p.shape)}", reason=Reason.STATE_MISMATCH,
                          path=_file_of(ext, key))
    box = _box(p)
    local = from_bits(et.dtype, piece(arr, box, tuple(local_of(p).shape)) if box is not None
                      else np.array(arr, order="C")).to(local_of(p).device)
    if box is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=p.shape, stride=p.stride())


__all__ = ["MODEL_PREFIXES", "OPTIM_PREFIXES", "InitialBase", "StartingPoint",
           "as_initial_base", "crc_of", "load_initial", "match_live", "start_from"]
