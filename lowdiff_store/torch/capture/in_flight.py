"""At most two dense gradient records in flight (issue 34, item 3): back-pressure at capture.

A dense record holds gradient-sized host memory (copies in buffers of the
:class:`~lowdiff_store.torch.core.step_batch.HostPool`, or gradients lent to it, see
:mod:`.lending`) from the capture of its step until the writer no longer reads it. A
record is *in flight* over that span. Without a bound, the records in flight were the one
captured, the one waiting for the next step to finalize it, and up to two the writer's
staging budget admits (``staging.budget_for``): four gradient-sized copies, and the
host pool keeps every buffer it ever made.

:class:`RecordGate` bounds them. Each capture takes a :class:`Ticket` before it takes any
buffer or lends any gradient (:meth:`RecordGate.enter`); the ticket goes with the step's
record and is given back when the writer releases the record (written, or failed), or at
once when the step turns out to hold no gradients (a skipped step, a step not logged).
``enter`` waits while :meth:`RecordGate.limit` tickets are out: with the default
``batch=1`` two, the record being written and the one just captured, so the training
thread waits at a capture only when the writer has not yet written the record handed to it
one step earlier; then the record finalized at that capture is handed to the writer
first (not after the optimizer step, as otherwise), so the writer, the slower of the two,
never idles through the step. A group commit of ``batch`` records smaller than the writer's
``max_batch_bytes`` needs its group filled: the limit is then ``batch + 1``.

Counters (``DiffCheckpointer.stats()``): ``records_in_flight_max`` (the most tickets
out at once), ``record_waits`` (captures that waited), ``record_wait_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...writer.async_writer import DEFAULT_MAX_BATCH_BYTES
from ..core.tensors import local_of

#: dense records in flight with group commits of one record: the one being written and the
#: one just captured
MAX_IN_FLIGHT = 2

#: the counters of a gate (``DiffCheckpointer.stats()``)
GATE_COUNTERS = ("records_in_flight_max", "record_waits", "record_wait_s")


def in_flight_limit(batch: int, record_bytes: int, max_batch_bytes: int,
                    most: int = MAX_IN_FLIGHT) -> int:
    """Dense records allowed in flight: ``most`` (:data:`MAX_IN_FLIGHT`, or the
    checkpointer's ``records_in_flight=1``: the capture waits until the record before is
    written) when each record is a group of its own (``batch`` 1, or a record of at least
    ``max_batch_bytes``), else room for a group of ``batch`` being filled plus the record
    just captured."""
    if batch <= 1 or record_bytes >= max_batch_bytes:
        return most
    return batch + 1


class Ticket:
    """One record's place in flight; :meth:`leave` gives it back (idempotent, any thread)."""

    __slots__ = ("_gate", "_out")

    def __init__(self, gate: RecordGate) -> None:
        self._gate = gate
        self._out = True

    def leave(self) -> None:
        """The record no longer holds gradient-sized memory."""
        gate = self._gate
        with gate.cond:
            if not self._out:
                return
            self._out = False
            gate.out -= 1
            gate.cond.notify_all()


class RecordGate:
    """Dense records in flight, within :meth:`limit` (see the module docstring).
    ``limit``: the number allowed now (read at each :meth:`enter`: the batch may be
    tuned)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.cond = threading.Condition(threading.Lock())
        #: tickets out now; captures waiting now
        self.out = self.waiting = 0
        self.stats: dict[str, float] = dict.fromkeys(GATE_COUNTERS, 0)

    def full(self) -> bool:
        """:meth:`enter` would wait now."""
        with self.cond:
            return self.out >= max(1, self.limit())

    def enter(self) -> Ticket:
        """A ticket for the record about to be captured, once fewer than :meth:`limit` are
        out (on the training thread: waits for the writer to release an older record)."""
        limit = max(1, self.limit())
        with self.cond:
            if self.out >= limit:
                t0 = time.perf_counter()
                self.stats["record_waits"] += 1
                self.waiting += 1
                try:
                    while self.out >= limit:
                        self.cond.wait()
                finally:
                    self.waiting -= 1
                self.stats["record_wait_s"] += time.perf_counter() - t0
            self.out += 1
            self.stats["records_in_flight_max"] = max(self.stats["records_in_flight_max"],
                                                      self.out)
            return Ticket(self)


def gate_for(mode: str, compressor: Any, source: Any, params: Sequence[Any],
             writer: Mapping[str, Any], sink: Any, most: int = MAX_IN_FLIGHT
             ) -> RecordGate | None:
    """The bound on a checkpointer's dense gradient records in flight into ``sink``:
    ``most`` (two, or one), or a group of ``batch`` records plus one while such records
    are smaller than the writer's ``max_batch_bytes`` (``writer``: the checkpointer's
    writer options); None when its records are not dense gradients (delta mode, a
    compressor's messages, a tee's ``source``)."""
    if mode != "grad" or source is not None or compressor is not None:
        return None
    nbytes = sum(local_of(p).numel() * p.element_size() for p in params)
    big = int(writer.get("max_batch_bytes", DEFAULT_MAX_BATCH_BYTES))
    return RecordGate(lambda: in_flight_limit(sink.batch, nbytes, big, most))


__all__ = ["MAX_IN_FLIGHT", "GATE_COUNTERS", "RecordGate", "Ticket", "gate_for",
           "in_flight_limit"]
