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
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, FormatError, LowdiffError, ManifestError, Reason, StorageError
from ..format.constants import MANIFEST_NAME, RANK_DIR, SHARDS_MAGIC, SHARDS_NAME
from ..format.framing import pack_manifest, unpack_manifest
from ..storage import StoreLike, open_store
from .manifest import MAX_MANIFEST_FILE_BYTES

#: the layouts ``SHARDS`` may name (the spec, "Sharded checkpoints"); any other is
#: ``bad_metadata``: a reader cannot tell what the shards hold
SHARD_LAYOUTS = ("replicated", "zero", "fsdp", "local")

#: the layout of local-update training (``lowdiff_store.torch.distributed.local_sgd``): one
#: complete log per replica, whose torch metadata says its place in a ``"local"`` section
#: (format_spec/log_format.md, "Layout `local`") instead of a ``"shard"`` section
LOCAL_LAYOUT = "local"


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
                            f"{RANK_DIR.format(missing)} holds no log",
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


__all__ = ["LOCAL_LAYOUT", "SHARD_LAYOUTS", "check_member", "check_shards_exist",
           "check_world_size", "copied_logs", "is_sharded", "log_paths",
           "read_shards_manifest", "shard_mismatch", "shard_path", "write_shards_manifest"]
