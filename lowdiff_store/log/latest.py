"""``latest_step(path)``: the newest step a restore of ``path`` would load, without torch.

A training script asks this before building its objects: ``None`` means "start fresh"
(no directory, an empty one, or a log with no base yet), an int means "restore that step".
"""

from __future__ import annotations

import os

from ..format.constants import MANIFEST_NAME
from .reader import LogReader
from .shards import is_sharded, read_shards_manifest, shard_path


def _durable(directory: str) -> int | None:
    if not os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        return None  # nothing published yet (a shard that never started counts as empty)
    with LogReader(directory) as reader:
        return reader.durable_step


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The newest durable step of the checkpoint at ``path``, or None if there is none.

    For one log: the newest step with a base at or before it and every diff in between
    (``LogReader.durable_step``). For a sharded checkpoint (one log per rank): the newest
    step durable on every rank, the minimum over the shards (what ``restore`` loads by
    default). A missing or empty directory, or a log whose first base was never published,
    gives None. A damaged log raises the usual :class:`~lowdiff_store.LowdiffError`.
    Reads only; never imports torch.
    """
    p = os.fspath(path)
    if is_sharded(p):
        world = read_shards_manifest(p)["world_size"]
        steps = [_durable(shard_path(p, r)) for r in range(world)]
        return None if any(s is None for s in steps) else min(s for s in steps if s is not None)
    return _durable(p)


__all__ = ["latest_step"]
