"""Sharded checkpoints: one log per rank under one directory, and a top-level manifest.

```
PATH/SHARDS            top-level manifest (magic "LDSHD\\0\\r\\n", same framing as MANIFEST):
                       {"world_size": int, "layout": str, "meta": map}
PATH/rank-00000/       rank 0's log (a complete log: MANIFEST, segments, bases)
PATH/rank-00001/       ...
```

Each rank writes only its own shard. A step of the whole job is recoverable when every
shard holds it: the job's durable step is the minimum over the shards.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, FormatError, LowdiffError, ManifestError, Reason, StorageError
from ..format.constants import MANIFEST_NAME, RANK_DIR, SHARDS_MAGIC, SHARDS_NAME
from ..format.framing import pack_manifest, unpack_manifest
from ..storage import StoreLike, open_store
from .manifest import MAX_MANIFEST_FILE_BYTES

#: the layout of local-update training (``lowdiff_store.torch.distributed.local_sgd``): one
#: complete log per replica, whose torch metadata says its place in a ``"local"`` section
#: (format_spec/log_format.md, "Layout `local`") instead of a ``"shard"`` section
LOCAL_LAYOUT = "local"

#: the layouts whose ranks split one state between them, and what one rank's log holds:
#: a rank directory of these is no whole state alone (:func:`replay_source`). Each rank
#: of a :data:`LOCAL_LAYOUT` checkpoint logs a whole replica of its own instead.
SPLIT_LAYOUTS = {
    "replicated": "the ranks split the parameters between them",
    "zero": "each rank logs its own partition of the optimizer",
    "fsdp": "each rank logs its pieces of the sharded parameters",
}

#: the layouts ``SHARDS`` may name (the spec, "Sharded checkpoints"); any other is
#: ``bad_metadata``: a reader cannot tell what the shards hold
SHARD_LAYOUTS = (*SPLIT_LAYOUTS, LOCAL_LAYOUT)

_RANK_NAME = re.compile(r"rank-([0-9]{5,})")


def is_sharded(path: StoreLike) -> bool:
    """True when ``path`` holds a sharded checkpoint (a ``SHARDS`` file)."""
    return open_store(path).exists(SHARDS_NAME)


def shard_path(path: str | os.PathLike[str], rank: int) -> str:
    """Directory (or URL) of rank ``rank``'s log."""
    return open_store(path).path_of(RANK_DIR.format(rank))


def write_shards_manifest(path: str | os.PathLike[str], world_size: int, *,
                          layout: str = "replicated", meta: dict[str, Any] | None = None
                          ) -> None:
    """Publish the top-level manifest (rank 0 does this once)."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    store = open_store(path)
    store.ensure_root()
    body = {"world_size": world_size, "layout": layout, "meta": dict(meta or {})}
    store.publish(SHARDS_NAME, [pack_manifest(body, SHARDS_MAGIC)])


def read_shards_manifest(path: StoreLike) -> dict[str, Any]:
    """Read and validate the top-level manifest."""
    store = open_store(path)
    f = store.path_of(SHARDS_NAME)
    try:
        data = store.read(SHARDS_NAME, max_bytes=MAX_MANIFEST_FILE_BYTES)
    except StorageError as e:
        if e.reason is Reason.NOT_A_REGULAR_FILE:
            raise
        raise ManifestError(f"cannot read the shards manifest: {e.detail}",
                            reason=Reason.NOT_A_LOG, path=f) from e
    try:
        body = unpack_manifest(data, SHARDS_MAGIC)
    except LowdiffError as e:
        raise ManifestError(e.detail, reason=e.reason, path=f, offset=e.offset) from None
    ws = body.get("world_size")
    if type(ws) is not int or not 1 <= ws <= 1 << 20:
        raise ManifestError("bad world_size in the shards manifest", path=f)
    if not isinstance(body.get("meta", {}), dict):
        raise ManifestError("bad meta in the shards manifest", path=f)
    layout = body.get("layout", "replicated")
    if not isinstance(layout, str):
        raise ManifestError("bad layout in the shards manifest", path=f)
    if layout not in SHARD_LAYOUTS:
        raise ManifestError(f"unknown shard layout {layout[:64]!r} in the shards manifest "
                            f"(known: {', '.join(SHARD_LAYOUTS)})", path=f)
    return body


def check_shards_exist(path: StoreLike, world_size: int) -> None:
    """Refuse a sharded checkpoint whose ``SHARDS`` declares more ranks than have a log,
    before anything is opened per rank: the count is checked against one listing of what
    exists, so a ``SHARDS`` declaring 2^20 ranks costs no more than the objects present."""
    store = open_store(path)
    present = {n.split("/", 1)[0] for n in store.list("rank-") if "/" in n}
    missing = next((r for r in range(min(world_size, len(present) + 1))
                    if RANK_DIR.format(r) not in present), None)
    if missing is not None:
        raise ManifestError(f"the shards manifest declares {world_size} ranks but "
                            f"{RANK_DIR.format(missing)} holds no log (a job stopped while "
                            f"its ranks opened their logs, each other rank holding only its "
                            f"step-0 base, starts over when relaunched on this directory; "
                            f"otherwise that rank's log is lost)",
                            path=store.path_of(SHARDS_NAME))


def check_world_size(path: str | os.PathLike[str], world_size: int) -> dict[str, Any]:
    """Refuse to use a sharded checkpoint with a different world size."""
    body = read_shards_manifest(path)
    if body["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint was written by {body['world_size']} ranks but this job has "
            f"{world_size}; a job logs into a checkpoint of its own world size only "
            f"(restore() reshards it: then log into a new directory)",
            reason=Reason.WORLD_SIZE_MISMATCH, path=open_store(path).path_of(SHARDS_NAME))
    return body


def log_paths(path: str | os.PathLike[str]) -> list[str]:
    """The log directories under ``path``: its shards, or ``path`` itself if unsharded."""
    if is_sharded(path):
        ws = read_shards_manifest(path)["world_size"]
        check_shards_exist(path, ws)
        return [shard_path(path, r) for r in range(ws)]
    return [os.fspath(path)]


@dataclass(frozen=True)
class RankDir:
    """``path`` is the directory of rank ``rank`` of the ``world``-rank checkpoint of
    ``layout`` at ``root`` (the directory holding its ``SHARDS``)."""

    path: str
    root: str
    rank: int
    world: int
    layout: str


def _places(loc: str) -> list[tuple[str, str]]:
    """(parent, name) of the location ``loc``: as written and, for a local path, with its
    links resolved (a rank directory linked from elsewhere is still of its checkpoint)."""
    if "://" in loc:
        head, _, name = loc.rstrip("/").rpartition("/")
        return [(head, name)] if "://" in head and not head.endswith("://") else []
    out: list[tuple[str, str]] = []
    for p in (os.path.abspath(loc), os.path.realpath(loc)):
        place = (os.path.dirname(p), os.path.basename(p))
        if place not in out:
            out.append(place)
    return out


def rank_dir(path: str | os.PathLike[str]) -> RankDir | None:
    """The place of ``path`` when it is a rank directory (``rank-NNNNN``) of a sharded
    checkpoint, its parent holding ``SHARDS``; None for any other path. Only a path named
    like a rank directory costs a look at its parent."""
    loc = os.fspath(path)
    for parent, name in _places(loc):
        m = _RANK_NAME.fullmatch(name)
        if m is None or RANK_DIR.format(int(m[1])) != name or not is_sharded(parent):
            continue
        body = read_shards_manifest(parent)
        return RankDir(loc, parent, int(m[1]), body["world_size"],
                       body.get("layout", "replicated"))
    return None


def split_share(path: str, rank: int, world: int, layout: str, root: str | None,
                verb: str = "replay") -> ConfigError:
    """The refusal of the log at ``path``, rank ``rank`` of a ``world``-rank checkpoint of
    one of the :data:`SPLIT_LAYOUTS`, replayed, restored or compacted (``verb``) alone:
    ``ConfigError(invalid_argument)`` naming the checkpoint directory ``root`` to use
    instead (None: a log moved out of its checkpoint)."""
    where = f"the {world}-rank checkpoint {root}" if root is not None else \
        f"a {world}-rank checkpoint"
    instead = f"the checkpoint directory {root}" if root is not None else \
        "the checkpoint directory it belongs to (the one holding its SHARDS and every rank)"
    return ConfigError(f"rank {rank} of {where} (layout {layout!r}: "
                       f"{SPLIT_LAYOUTS[layout]}) is not a whole state alone: {verb} "
                       f"{instead} instead",
                       reason=Reason.INVALID_ARGUMENT, path=path)


def replay_source(path: str | os.PathLike[str], rank: int | None = None,
                  verb: str = "replay") -> tuple[str, int | None]:
    """What replay or restore of ``path`` (``rank``: the replica asked for, or None) opens:
    ``(checkpoint, rank)``. The one place every entry point (``lowdiff-store replay``,
    ``restore``, ``replay_state``, ``lowdiff-store compact``, whose ``verb`` the refusal
    names) resolves a rank directory (:func:`rank_dir`): of a
    ``"local"`` checkpoint, whose every rank logs a whole replica, it is that checkpoint
    and that rank; of a layout whose ranks split one state (:data:`SPLIT_LAYOUTS`), it is
    refused (:func:`split_share`), as are a directory of a rank the checkpoint does not
    have and a ``rank`` other than the directory's (``ConfigError(invalid_argument)``).
    Any other path is returned as it is."""
    where = rank_dir(path)
    if where is None:
        return os.fspath(path), rank
    p, root, r, world = where.path, where.root, where.rank, where.world
    if r >= world:
        raise ConfigError(f"{RANK_DIR.format(r)} is not a rank of the {world}-rank "
                          f"checkpoint {root} (ranks 0..{world - 1})", path=p)
    if where.layout != LOCAL_LAYOUT:
        raise split_share(p, r, world, where.layout, root, verb)
    if rank is not None and rank != r:
        raise ConfigError(f"rank {rank} was asked of the directory of rank {r} of the "
                          f"checkpoint {root}: give {root} with rank {rank}, or this "
                          f"directory without a rank", path=p)
    return root, r


def copied_logs(paths: list[str], log_ids: list[bytes]) -> list[ManifestError]:
    """One ``log_id_mismatch`` per shard whose log has the ``log_id`` of a lower rank's
    (``paths[r]`` holds the log whose manifest has ``log_ids[r]``): a rank's log copied as
    another rank's directory. Every log gets a fresh ``log_id``, so two ranks never share
    one; each copy alone reads and verifies clean, so only this comparison finds it."""
    first: dict[bytes, str] = {}
    out = []
    for p, i in zip(paths, log_ids, strict=True):
        if i in first:
            out.append(ManifestError(f"this log is a copy of {first[i]} (the same log_id "
                                     f"{i.hex()}): every rank writes a log of its own",
                                     reason=Reason.LOG_ID_MISMATCH, path=p))
        else:
            first[i] = p
    return out


def shard_mismatch(shard: Any, rank: int, world: int, layout: str) -> str | None:
    """Why a log whose torch metadata holds the ``shard`` section ``shard`` is not rank
    ``rank`` of a ``world``-rank checkpoint of ``layout`` (what its ``SHARDS`` file says),
    or None when it is."""
    got = (shard.get("rank"), shard.get("world_size"), shard.get("layout")) \
        if isinstance(shard, dict) else shard
    if got == (rank, world, layout):
        return None
    return (f"the log's shard section {got!r} (rank, world size, layout) is not rank {rank} "
            f"of this {world}-rank {layout!r} checkpoint")


def _local_mismatch(local: Any, rank: int, world: int) -> str | None:
    """Why a log whose ``"local"`` section is ``local`` is not replica ``rank`` of a
    ``world``-rank local-update checkpoint, or None when it is."""
    if not isinstance(local, Mapping):
        return (f"the log has no 'local' section: it is not replica {rank} of this "
                f"{world}-rank local-update checkpoint")
    got = (local.get("rank"), local.get("world_size"))
    if got == (rank, world):
        return None
    return (f"the log's local section says rank {got[0]!r} of {got[1]!r}, but it is rank "
            f"{rank} of this {world}-rank checkpoint")


def check_member(log_dir: str, torch_meta: Any, rank: int, world: int, layout: str
                 ) -> None:
    """Refuse the log at ``log_dir``, found as rank ``rank`` of a ``world``-rank
    checkpoint of ``layout`` (what its directory and ``SHARDS`` say), unless its torch
    metadata ``torch_meta`` (``manifest.meta["torch"]``) records that place: the
    ``"local"`` section's rank and world size (layout ``"local"``: required, every such
    log has them), else the ``"shard"`` section (:func:`shard_mismatch`). A rank directory
    copied or swapped keeps valid CRCs; without this check its log would restore as
    another rank's replica. ``FormatError(bad_metadata)`` naming the log's ``MANIFEST``.
    A log recording no place (not a torch log, or one written before the shard section
    existed) passes: it has nothing to compare."""
    why = None
    if isinstance(torch_meta, Mapping):
        if layout == LOCAL_LAYOUT:
            why = _local_mismatch(torch_meta.get("local"), rank, world)
        elif "shard" in torch_meta:
            why = shard_mismatch(torch_meta["shard"], rank, world, layout)
    if why is not None:
        raise FormatError(why, reason=Reason.BAD_METADATA,
                          path=open_store(log_dir).path_of(MANIFEST_NAME))


__all__ = ["LOCAL_LAYOUT", "SHARD_LAYOUTS", "SPLIT_LAYOUTS", "RankDir", "check_member",
           "check_shards_exist", "check_world_size", "copied_logs", "is_sharded",
           "log_paths", "rank_dir", "read_shards_manifest", "replay_source",
           "shard_mismatch", "shard_path", "split_share", "write_shards_manifest"]
