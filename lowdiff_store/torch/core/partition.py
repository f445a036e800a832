"""The deterministic split of named tensors between ranks (DDP's replicated layout and
FSDP2's replicas on an HSDP mesh use the same one)."""

from __future__ import annotations

from collections.abc import Sequence


def partition_by_bytes(items: Sequence[tuple[str, int]], world: int) -> list[list[str]]:
    """Split named tensors of the given byte sizes between ``world`` ranks: largest first
    (ties: earlier first), each to the least loaded rank (ties: lowest rank). Deterministic;
    each rank's names keep their input order."""
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    load = [0] * world
    owner: dict[int, int] = {}
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += items[i][1]
    return [[items[i][0] for i in range(len(items)) if owner[i] == r] for r in range(world)]


__all__ = ["partition_by_bytes"]
