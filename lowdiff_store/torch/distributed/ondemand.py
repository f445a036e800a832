"""Opening a sharded checkpoint for a restore at another world size without every rank
opening every log.

A rank restoring W shards at W' ranks replays only the shards whose pieces overlap its
own boxes (:mod:`~lowdiff_store.torch.distributed.reshard`), but it must know every
shard's durable step and bases (the job's plan) and the boxes each holds (which shards
it needs). Rank r opens the shards r, r + W', r + 2W', ... (its reader: manifest,
segments, index; its torch metadata parsed and checked), describes each as a
:class:`~lowdiff_store.torch.distributed.reshard.ShardFacts`, and the ranks exchange
these plain values over the coordination group; a shard is then opened again only by
the ranks that replay it (:class:`OnDemandShards`). Each rank thus opens about
W / W' logs plus those it needs, instead of all W: the work over the job is
O(W + W' x needed), not O(W x W').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...log.manifest import manifest_moved
from ...log.shards import check_shards_exist, read_shards_manifest, shard_mismatch, shard_path
from ...log.shardset import LAYOUTS
from ...torchmeta import LogMeta
from ..replay.engine import log_meta
from .checkpointer import agree, gather_objects
from .reshard import ShardFacts, shard_facts

T = TypeVar("T")


def checked_meta(reader: LogReader, rank: int, world: int, layout: str, root: str
                 ) -> LogMeta:
    """The torch metadata of shard ``rank``'s log, checked to declare that place in a
    ``world``-rank checkpoint of ``layout`` (ConfigError(bad_metadata) naming the shard)."""
    meta = log_meta(reader)
    sh = meta.shard
    why = shard_mismatch(None if sh is None else (sh.rank, sh.world_size, sh.layout), rank,
                         world, layout)
    if why is not None:
        raise ConfigError(why, reason=Reason.BAD_METADATA, path=shard_path(root, rank))
    return meta


class _Lazy(Sequence[T]):
    """``n`` items, item ``i`` being ``get(i)`` (computed when indexed)."""

    def __init__(self, n: int, get: Callable[[int], T]) -> None:
        self._n = n
        self._get = get

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._get(i % self._n)

    def __iter__(self) -> Iterator[T]:
        return (self._get(i) for i in range(self._n))


class OnDemandShards:
    """The shards of a sharded checkpoint, each opened on first use (its reader, copy-on-
    write mapped, and its checked torch metadata). ``readers`` and ``metas`` are
    sequences over every shard that open the one indexed. Close it (or use ``with``)."""

    def __init__(self, root: str) -> None:
        self.root = root
        body = read_shards_manifest(root)
        self.world: int = body["world_size"]
        self.layout: str = body.get("layout", "replicated")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown shard layout {self.layout!r}",
                              reason=Reason.BAD_METADATA, path=root)
        self._open: dict[int, tuple[LogReader, LogMeta]] = {}
        self.readers: Sequence[LogReader] = _Lazy(self.world, lambda s: self.open(s)[0])
        self.metas: Sequence[LogMeta] = _Lazy(self.world, lambda s: self.open(s)[1])

    def open(self, s: int) -> tuple[LogReader, LogMeta]:
        """Shard ``s``'s reader and metadata, opened now if not yet."""
        if s not in self._open:
            reader = LogReader(shard_path(self.root, s), mode="private")
            try:
                meta = checked_meta(reader, s, self.world, self.layout, self.root)
            except BaseException:
                reader.close()
                raise
            self._open[s] = (reader, meta)
        return self._open[s]

    @property
    def opened(self) -> list[int]:
        """The shards open now."""
        return sorted(self._open)

    def moved(self) -> bool:
        """A compaction published a newer manifest of some open shard since it was opened
        (see :func:`~lowdiff_store.log.reader.on_newest_manifest`)."""
        return any(manifest_moved(r.store, r.manifest.generation)
                   for r, _m in self._open.values())

    def reopen(self) -> list[int]:
        """Open again, on their newest manifests, the shards open now; returns them."""
        stale = self.opened
        self.close()
        for s in stale:
            self.open(s)
        return stale

    def facts(self, s: int) -> ShardFacts:
        """Shard ``s``'s :class:`ShardFacts` (opening it)."""
        reader, meta = self.open(s)
        return shard_facts(reader, meta, self.layout)

    def close(self) -> None:
        """Close every open shard (they open again when used)."""
        opened, self._open = self._open, {}
        for r, _m in opened.values():
            r.close()

    def __enter__(self) -> OnDemandShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(f: ShardFacts) -> tuple[Any, ...]:
    return dataclasses.astuple(f)


def _facts(t: Sequence[Any]) -> ShardFacts:
    durable, bases, mode, boxes = t
    return ShardFacts(durable, tuple(bases), mode,
                      tuple((n, tuple(o), tuple(s)) for n, o, s in boxes))


def exchange_facts(shards: OnDemandShards, rank: int, world: int, group: Any
                   ) -> list[ShardFacts]:
    """Every shard's :class:`ShardFacts`, this rank describing the shards ``rank``,
    ``rank + world``, ... and the others gathered from the ranks of ``group`` (collective;
    with no group, this process describes every shard). A failure on any rank raises on
    every rank (:func:`~lowdiff_store.torch.distributed.checkpointer.agree`). The shards
    this rank opened stay open: it may need them."""
    mine: dict[int, tuple[Any, ...]] = {}
    err: BaseException | None = None
    step = world if group is not None else 1
    try:
        if rank == 0 or group is None:   # one listing, not one per rank
            check_shards_exist(shards.root, shards.world)
        for s in range(rank if group is not None else 0, shards.world, step):
            mine[s] = _plain(shards.facts(s))
    except Exception as e:
        err = e
    agree(group, err)
    got = gather_objects(group, mine) if group is not None else [mine]
    out: dict[int, ShardFacts] = {}
    for part in got:
        out.update({int(s): _facts(t) for s, t in part.items()})
    if sorted(out) != list(range(shards.world)):
        raise ConfigError("the ranks did not describe every shard",
                          reason=Reason.BAD_METADATA, path=shards.root)
    return [out[s] for s in range(shards.world)]


__all__ = ["OnDemandShards", "checked_meta", "exchange_facts"]
