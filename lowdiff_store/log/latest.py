"""``latest_step(path)``: the newest step a restore of ``path`` would load, without torch.

A training script asks this before building its objects: ``None`` means "start fresh"
(no directory, an empty one, or a log with no base yet), an int means "restore that step".
"""

from __future__ import annotations

from ..format.constants import MANIFEST_NAME, RANK_DIR
from ..storage import Store, StoreLike, open_store
from ..storage.orphans import wait_for_orphaned_writer
from .reader import LogReader
from .shards import is_sharded, read_shards_manifest


def _durable(store: Store) -> int | None:
    wait_for_orphaned_writer(store.url)  # (its trainer died: it is finishing the log)
    if not store.exists(MANIFEST_NAME):
        return None  # nothing published yet (a shard that never started counts as empty)
    with LogReader(store) as reader:
        return reader.durable_step


def latest_step(path: StoreLike) -> int | None:
    """The newest durable step of the checkpoint at ``path``, or None if there is none.

    For one log: the newest step with a base at or before it and every diff in between
    (``LogReader.durable_step``). For a sharded checkpoint (one log per rank): the newest
    step durable on every rank, the minimum over the shards (what ``restore`` loads by
    default). A missing or empty directory, or a log whose first base was never published,
    gives None. A damaged log raises the usual :class:`~lowdiff_store.LowdiffError`.
    A writer process whose trainer died is waited for first, as ``restore`` does (it is
    making what it was handed durable: asked a moment earlier, a restart would start
    afresh, or short of the step its restore then loads). Reads only; never imports torch.
    """
    store = open_store(path)
    if not is_sharded(store):
        return _durable(store)
    world = read_shards_manifest(store)["world_size"]
    steps: list[int] = []
    for r in range(world):  # stops at the first shard with nothing durable
        d = _durable(store.child(RANK_DIR.format(r)))
        if d is None:
            return None
        steps.append(d)
    return min(steps)


__all__ = ["latest_step"]
