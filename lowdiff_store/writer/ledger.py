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
    background failure (``reported`` once a caller has been raised it).

    A base is a record too: a step appended after a base is durable only once the base
    is published (or given up), even when its own record reached the disk first (a diff
    may be acknowledged while the base thread still writes). Until then ``durable`` stops
    at the newest step appended before the base (:meth:`hold`): a crash meanwhile leaves
    a log that restores no further (the first base of a log, a base standing in for steps
    without a diff)."""

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
        #: newest step acknowledged (diff written and synced, or base published)
        self.acked = -1 if durable is None else durable
        self._caps: dict[int, int] = {}  # base step -> newest step appended before it
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

    def hold(self, base: int, before: int) -> None:
        """A base at step ``base`` is submitted after steps up to ``before``: ``durable``
        goes no further than ``before`` until :meth:`base_ended`. The caller holds
        :attr:`cond`."""
        self._caps[base] = before

    def base_ended(self, base: int, published: bool) -> None:
        """The base at step ``base`` is published (its step is durable), or it is not
        (skipped, failed): the steps after it are no longer held back."""
        self._move(base if published else None, base)

    def advance(self, step: int, group: Sequence[_Acked] = ()) -> None:
        """Make ``step`` (the newest of ``group``, the diffs just acknowledged) durable:
        the durable step first, then the group's futures in step order, then
        ``on_durable`` (serialized, so callbacks see increasing steps)."""
        self._move(step, None, group)

    def reset(self, durable: int | None, diff_durable: int) -> None:
        """Move back to what a cut history holds (``truncate_after``; no base pending)."""
        with self.cond:
            self.diff_durable = min(self.diff_durable, diff_durable)
            self.durable = durable
            self.acked = -1 if durable is None else durable

    def _move(self, step: int | None, ended: int | None, group: Sequence[_Acked] = ()
              ) -> None:
        with self._cb_lock:
            with self.cond:
                if group:
                    assert step is not None
                    self.diff_durable = step
                if ended is not None:
                    self._caps.pop(ended, None)
                if step is not None:
                    self.acked = max(self.acked, step)
                now = min(self.acked, *self._caps.values()) if self._caps else self.acked
                moved = now >= 0 and (self.durable is None or now > self.durable)
                if moved:
                    self.durable = now
                self.cond.notify_all()
            for it in group:
                it.future.set_result(it.step)
            if moved and self._on_durable is not None:
                try:
                    self._on_durable(now)
                except Exception:
                    self._stats["callback_errors"] += 1
                    _log.exception("on_durable(%d) raised", now)


__all__ = ["DurabilityLedger"]
