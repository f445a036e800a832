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
from typing import Any

from ..errors import ConfigError, LowdiffError, ManifestError, Reason
from ..format.constants import RANK_DIR, SHARDS_MAGIC, SHARDS_NAME
from ..format.framing import pack_manifest, unpack_manifest
from ..storage import atomic_write


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a sharded checkpoint (a ``SHARDS`` file)."""
    return os.path.exists(os.path.join(os.fspath(path), SHARDS_NAME))


def shard_path(path: str | os.PathLike[str], rank: int) -> str:
    """Directory of rank ``rank``'s log."""
    return os.path.join(os.fspath(path), RANK_DIR.format(rank))


def write_shards_manifest(path: str | os.PathLike[str], world_size: int, *,
                          layout: str = "replicated", meta: dict[str, Any] | None = None
                          ) -> None:
    """Publish the top-level manifest (rank 0 does this once)."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    p = os.fspath(path)
    os.makedirs(p, exist_ok=True)
    for r in range(world_size):  # every rank's directory exists once SHARDS does
        os.makedirs(shard_path(p, r), exist_ok=True)
    body = {"world_size": world_size, "layout": layout, "meta": dict(meta or {})}
    atomic_write(os.path.join(p, SHARDS_NAME), [pack_manifest(body, SHARDS_MAGIC)])


def read_shards_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate the top-level manifest."""
    f = os.path.join(os.fspath(path), SHARDS_NAME)
    try:
        with open(f, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise ManifestError(f"cannot read the shards manifest: {e.strerror}",
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
    if not isinstance(body.get("layout", "replicated"), str):
        raise ManifestError("bad layout in the shards manifest", path=f)
    # counts are checked against what exists before anything is opened per rank: a
    # SHARDS file declaring 2^20 ranks must not make a reader try 2^20 logs
    present = _rank_dirs(os.fspath(path))
    missing = [r for r in range(min(ws, len(present) + 1)) if RANK_DIR.format(r) not in present]
    if missing:
        raise ManifestError(f"the shards manifest declares {ws} ranks but "
                            f"{RANK_DIR.format(missing[0])} does not exist", path=f)
    return body


def _rank_dirs(root: str) -> set[str]:
    try:
        with os.scandir(root) as it:
            return {e.name for e in it if e.name.startswith("rank-")}
    except OSError:
        return set()


def check_world_size(path: str | os.PathLike[str], world_size: int) -> dict[str, Any]:
    """Refuse to use a sharded checkpoint with a different world size."""
    body = read_shards_manifest(path)
    if body["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint was written by {body['world_size']} ranks but this job has "
            f"{world_size}; a job logs into a checkpoint of its own world size only "
            f"(restore() reshards it: then log into a new directory)",
            reason=Reason.WORLD_SIZE_MISMATCH, path=os.path.join(os.fspath(path), SHARDS_NAME))
    return body


def log_paths(path: str | os.PathLike[str]) -> list[str]:
    """The log directories under ``path``: its shards, or ``path`` itself if unsharded."""
    if is_sharded(path):
        ws = read_shards_manifest(path)["world_size"]
        return [shard_path(path, r) for r in range(ws)]
    return [os.fspath(path)]


__all__ = ["check_world_size", "is_sharded", "log_paths", "read_shards_manifest",
           "shard_path", "write_shards_manifest"]
