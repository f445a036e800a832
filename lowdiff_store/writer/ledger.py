"""Durability and failure of one :class:`~lowdiff_store.writer.AsyncLogWriter`, shared by
its threads: the durable step, the first background failure, and the order in which
futures and ``on_durable`` see a step become durable.

Every field is guarded by :attr:`DurabilityLedger.cond`; waiters (``flush``, ``wait``, a
base waiting for the diffs before it, an append blocked on a failure) wait on it and are
woken by :meth:`DurabilityLedger.advance` and :meth:`DurabilityLedger.poison`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import CommitError

_log = logging.getLogger("lowdiff_store.writer")


class _Acked(Protocol):
    step: int
    future: Any


class DurabilityLedger:
    """What is durable and whether the writer failed.

    ``durable``: newest step durable, diffs and bases counted (``None`` before any);
    ``diff_durable``: newest diff step acknowledged durable; ``bases_pending``: bases
    submitted and not yet published or failed; ``error``/``fail_step``/``cause``: the first
    background failure (``reported`` once a caller has been raised it)."""

    def __init__(self, path: str, durable: int | None,
                 on_durable: Callable[[int], None] | None, stats: dict[str, float]) -> None:
        self.path = path
        self.cond = threading.Condition(threading.Lock())
        self.durable = durable
        self.diff_durable = -1
        self.bases_pending = 0
        self.error: CommitError | None = None
        self.fail_step: int | None = None
        self.cause: BaseException | None = None
        self.reported = False
        self._on_durable = on_durable
        self._stats = stats  # the writer's counters (callback_errors)
        self._cb_lock = threading.Lock()  # serializes on_durable calls

    def fresh_error(self, step: int | None) -> CommitError:
        """A new CommitError describing the failure (one per raise: tracebacks differ)."""
        head = "" if step is None else f"step {step} is not durable: "
        err = CommitError(f"{head}the writer failed at step {self.fail_step}: {self.cause}",
                          path=self.path)
        err.__cause__ = self.cause
        return err

    def poison(self, step: int, cause: BaseException) -> None:
        """Record the first background failure and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.fail_step = step
                self.cause = cause
                self.error = self.fresh_error(None)
                _log.error("lowdiff-store writer %s failed at step %d: %s", self.path, step,
                           cause)
            self.cond.notify_all()

    def advance(self, step: int, group: Sequence[_Acked] = ()) -> None:
        """Make ``step`` durable: the durable step first, then the group's futures in step
        order, then ``on_durable`` (serialized, so callbacks see increasing steps). A
        non-empty ``group`` is the diffs just acknowledged; an empty one is a base."""
        with self._cb_lock:
            with self.cond:
                if group:
                    self.diff_durable = step
                moved = self.durable is None or step > self.durable
                if moved:
                    self.durable = step
                self.cond.notify_all()
            for it in group:
                it.future.set_result(it.step)
            if moved and self._on_durable is not None:
                try:
                    self._on_durable(step)
                except Exception:
                    self._stats["callback_errors"] += 1
                    _log.exception("on_durable(%d) raised", step)


__all__ = ["DurabilityLedger"]
