"""Compaction of a sharded checkpoint (one log per rank, see :mod:`lowdiff_store.log.shards`).

A step of the job is restorable when every shard can rebuild it from a base that *every*
shard holds (a replicated checkpoint replays the merged shards from one common base). So a
sharded compaction runs in two phases, each shard compacted with
:func:`lowdiff_store.compaction.single.compact_log`:

1. **materialize**: a base at the target step (default: the newest step durable on every
   shard) is made in every shard that lacks one, deleting nothing. Each shard's base holds
   that rank's share of the state, built by the caller's materializer
   (``materializer.for_rank(r)``: :class:`lowdiff_store.torch.api.TorchMaterializer`
   replays the merged shards; without one, or when a rank's state cannot be rebuilt, no
   base is made and a note says why);
2. **retention**: every shard keeps its bases from the ``keep_bases``-th newest base
   *common to all shards* on (plus ``keep_history_from``), and the diffs after the oldest
   kept one.

A crash in phase 1 leaves extra bases only (every old base is still there); in phase 2 the
common bases kept by the finished shards are also kept by the others, so every shard stays
restorable to the same steps at all times.

A checkpoint of local-update training (layout ``"local"``) holds one complete log per
replica, each replayed alone from its own bases: a shard's restorable bases are then its
own up to the job's durable step, not the ones common to every shard, and one rank may be
compacted alone (``rank``). Either way every rank stays restorable at the newest step
durable on all ranks (its new base is at that step or before), and ``SHARDS`` is left as
it is.
"""

from __future__ import annotations

import os
import time

from ..errors import ConfigError, LowdiffError, Reason, StepNotFoundError
from ..log.reader import LogReader
from ..log.shards import LOCAL_LAYOUT, check_member, log_paths, read_shards_manifest
from ..log.shardset import restore_points
from ..progress import ProgressFn
from .single import CompactionPlan, CompactionResult, ShardMaterializer, compact_log


def _state(paths: list[str], layout: str
           ) -> tuple[list[tuple[int | None, list[int]]], list[int]]:
    """Each shard's durable step and restore points (its bases and its streamed bases'
    complete steps), once every shard's log is its rank of this ``layout`` checkpoint
    (:func:`check_member`: checked whether or not a base is made, as retention deletes by
    what each shard holds); and the restore points common to every shard (replicated
    shards are replayed merged, from a point taken at the same steps on every shard:
    :func:`~lowdiff_store.log.shardset.plan_job`)."""
    out = []
    points = []
    for rank, p in enumerate(paths):
        with LogReader(p) as r:
            check_member(p, r.meta.get("torch"), rank, len(paths), layout)
            points.append(restore_points(r.bases, r.streamed))
            out.append((r.durable_step, sorted(points[-1])))
    if layout == "replicated":
        common = [c for c, sl in points[0].items() if all(q.get(c) == sl for q in points[1:])]
    else:
        common = list(set(points[0]).intersection(*points[1:]))
    return out, sorted(common)


def _keep_count(bases: list[int], common: list[int], keep_bases: int) -> int:
    """How many of a shard's newest bases to keep so that the ``keep_bases`` newest common
    bases are among them."""
    if not common:
        return max(1, len(bases))
    threshold = common[-keep_bases] if len(common) >= keep_bases else common[0]
    return max(1, sum(1 for b in bases if b >= threshold))


def _ranks(root: str, world: int, rank: int | None, local: bool) -> list[int]:
    """The ranks compacted; a ``rank`` other than None is one of a local-update
    (``local``) checkpoint's ranks."""
    if rank is None:
        return list(range(world))
    if not local:
        raise ConfigError(f"{root}: a rank is compacted alone only in a checkpoint of "
                          f"local-update training (layout 'local'), whose replicas replay "
                          f"alone; this one is compacted as a whole",
                          reason=Reason.INVALID_ARGUMENT, path=root)
    if type(rank) is not int or not 0 <= rank < world:
        raise ConfigError(f"rank {rank!r} is not a rank of this checkpoint (0..{world - 1})",
                          reason=Reason.INVALID_ARGUMENT, path=root)
    return [rank]


def compact_sharded(path: str | os.PathLike[str], *, step: int | None = None,
                    keep_bases: int = 2, keep_history_from: int | None = None,
                    dry_run: bool = False, materializer: ShardMaterializer | None = None,
                    progress: ProgressFn | None = None, rank: int | None = None
                    ) -> CompactionResult:
    """Compact every shard of the sharded checkpoint at ``path`` (see the module
    docstring), or only ``rank``'s (local-update checkpoints). Returns one result summing
    the shards: ``plan.new_base`` is the step of the base made (None if a shard could not
    make it), ``plan.keep_bases`` the bases every compacted shard keeps,
    ``plan.delete_bases`` the union of the bases deleted."""
    root = os.fspath(path)
    if keep_bases < 1:
        raise ConfigError("keep_bases must be >= 1 (a log without a base cannot be restored)")
    t_start = time.perf_counter()
    paths = log_paths(root)
    layout = read_shards_manifest(root).get("layout", "replicated")
    local = layout == LOCAL_LAYOUT
    ranks = _ranks(root, len(paths), rank, local)
    state, _common = _state(paths, layout)
    for r, (d, _b) in enumerate(state):
        if d is None:
            raise StepNotFoundError(f"rank {r}'s shard has no base: nothing to compact",
                                    reason=Reason.NO_BASE, path=paths[r])
    job = min(int(d) for d, _b in state if d is not None)
    target = job if step is None else step
    if type(target) is not int or target < 0:
        raise ConfigError(f"step={step!r} must be a non-negative int")
    if target > job:
        raise StepNotFoundError(f"step {target} is not durable on every rank (the newest step "
                                f"durable on all {len(paths)} ranks is {job})", path=root)
    notes: list[str] = []
    made = 0
    mat_s = 0.0
    new_bytes = 0
    factory = materializer
    missing = [r for r in ranks if target not in state[r][1]]
    if missing and factory is None:
        notes.append(f"no materializer for this checkpoint: no base made at step {target} "
                     "(install torch for gradient logs)")
    elif factory is not None and missing and not dry_run:
        for r in missing:   # phase 1: add the base, delete nothing
            try:
                res = compact_log(paths[r], step=target, keep_bases=1 << 30,
                                  materializer=factory.for_rank(r))
            except LowdiffError as e:
                if e.reason not in (Reason.NOT_ALLOWED, Reason.NO_BASE):
                    raise
                notes.append(f"rank {r}: no base made at step {target}: {e.detail}")
                break
            made += 1
            mat_s += res.materialize_s
            new_bytes += res.new_base_bytes
            if progress:
                progress(made, len(missing) + len(ranks))
    state, common = _state(paths, layout)
    planned = {target} if dry_run and missing and factory is not None else set()
    common = sorted(set(common) | planned)
    plans: list[CompactionPlan] = []
    results: list[CompactionResult] = []
    for r in ranks:   # phase 2: retention against the bases restorable on every rank
        p = paths[r]
        bases = sorted(set(state[r][1]) | ({target} if dry_run and factory else set()))
        # a replica replays from its own bases: those up to the job's durable step
        usable = sorted({b for b in state[r][1] if b <= job} | planned) if local else common
        k = _keep_count(bases, usable, keep_bases)
        # a dry run plans with the base phase 1 would have made (nothing is built)
        ahead = dry_run and factory is not None and target not in state[r][1]
        res = compact_log(p, step=target if ahead or target in state[r][1] else None,
                          keep_bases=k, keep_history_from=keep_history_from,
                          dry_run=dry_run,
                          materializer=factory.for_rank(r) if ahead and factory else None)
        results.append(res)
        plans.append(res.plan)
        notes += [f"rank {r}: {n}" for n in res.plan.notes
                  if not n.startswith("no materializer")]
        if progress:
            progress(made + len(plans), len(missing) + len(ranks))
    kept = sorted(set.intersection(*[set(pl.keep_bases) for pl in plans])) if plans else []
    plan = CompactionPlan(
        new_base=target if (not missing or made == len(missing)
                            or (dry_run and factory is not None)) else None,
        keep_bases=kept,
        delete_bases=sorted({b for pl in plans for b in pl.delete_bases}),
        delete_segments=[s for pl in plans for s in pl.delete_segments],
        bytes_freed=sum(pl.bytes_freed for pl in plans),
        bytes_before=sum(pl.bytes_before for pl in plans),
        notes=notes)
    out = CompactionResult(plan, dry_run, new_base_bytes=new_bytes, materialize_s=mat_s)
    out.bytes_after = sum(x.bytes_after for x in results)
    out.total_s = time.perf_counter() - t_start
    return out


__all__ = ["compact_sharded"]
