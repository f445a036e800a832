"""Compaction and retention: bound disk use and recovery time.

:func:`compact` is the front: it decides whether ``path`` is one log
(:func:`~lowdiff_store.compaction.single.compact_log`) or a sharded checkpoint
(:func:`~lowdiff_store.compaction.sharded.compact_sharded`). See those modules for the
guarantees (crash safety, concurrency with a live writer and with readers).
"""

from __future__ import annotations

import os

from ..errors import ConfigError, Reason
from ..log.shards import is_sharded
from ..progress import ProgressFn
from .sharded import compact_sharded
from .single import (
    CompactionPlan,
    CompactionResult,
    Materializer,
    ShardMaterializer,
    compact_log,
    log_bytes,
    plan,
    publish_base,
)


def compact(path: str | os.PathLike[str], *, step: int | None = None, keep_bases: int = 2,
            keep_history_from: int | None = None, dry_run: bool = False,
            materializer: Materializer | ShardMaterializer | None = None,
            progress: ProgressFn | None = None, rank: int | None = None) -> CompactionResult:
    """Materialize a base at ``step`` (default: the newest durable step) and apply
    retention: keep the newest ``keep_bases`` bases (plus, with ``keep_history_from``, the
    base at or before that step and every base after it) and every diff after the oldest
    kept base; delete the rest once no manifest names it.

    ``materializer`` produces the new base's content (the torch layer's
    :class:`~lowdiff_store.torch.api.TorchMaterializer`); without one only retention is
    applied. A sharded checkpoint needs one that gives a materializer per rank
    (``for_rank``): anything else is refused rather than ignored. ``progress(done, total)``
    is called as the work advances.

    A checkpoint of local-update training (layout ``"local"``: one replica per rank) is
    compacted per replica, each rank's base replayed from its own shard; ``rank`` compacts
    that rank's shard alone (``ConfigError(invalid_argument)`` for any other checkpoint, or
    a rank it does not have). Every rank stays restorable at the newest step durable on
    all ranks.
    """
    p = os.fspath(path)
    if rank is not None and not is_sharded(p):
        raise ConfigError(f"{p} is one log: a rank applies to checkpoints of local-update "
                          f"training (one replica per rank)", reason=Reason.INVALID_ARGUMENT,
                          path=p)
    if not is_sharded(p):
        if materializer is not None and not callable(materializer):
            raise ConfigError("materializer must be callable (reader, step)",
                              reason=Reason.INVALID_ARGUMENT, path=p)
        return compact_log(p, step=step, keep_bases=keep_bases,
                           keep_history_from=keep_history_from, dry_run=dry_run,
                           materializer=materializer, progress=progress)
    if materializer is not None and not isinstance(materializer, ShardMaterializer):
        raise ConfigError(f"{p} is a sharded checkpoint: the materializer must give one per "
                          "rank (for_rank), e.g. lowdiff_store.torch.api.TorchMaterializer",
                          reason=Reason.INVALID_ARGUMENT, path=p)
    return compact_sharded(p, step=step, keep_bases=keep_bases,
                           keep_history_from=keep_history_from, dry_run=dry_run,
                           materializer=materializer, progress=progress, rank=rank)


__all__ = ["CompactionPlan", "CompactionResult", "Materializer", "ShardMaterializer", "compact",
           "compact_log", "compact_sharded", "log_bytes", "plan", "publish_base"]
