"""A test-only way to make the base staging pool slow, as on a loaded machine.

:func:`slow_staging` wraps :meth:`StagingArea.provide` (run on the checkpointer's helper
thread) so each buffer is made ``delay`` seconds late, on a timer thread (the helper thread goes
on with its copies and digests, which training waits for): a base whose staging memory is
made ahead of it then meets it not ready, what a CPU hog beside the suite does now and
then. Set ``LOWDIFF_TEST_SLOW_STAGING=<seconds>`` to apply it to every test (the root
conftest does), which shows the tests that assume bases on their exact steps without
``exact_bases=True``."""

from __future__ import annotations

import threading

import pytest

ENV = "LOWDIFF_TEST_SLOW_STAGING"


def slow_staging(monkeypatch: pytest.MonkeyPatch, delay: float = 0.5,
                 gate: threading.Event | None = None) -> list[float]:
    """Make every staging buffer ``delay`` seconds late (and, with ``gate``, not before
    the gate is set: a test decides when the memory is ready); returns a list that gets
    one entry (the delay) per buffer made, so a test can check the slow path was taken."""
    from lowdiff_store.torch.capture.bases.copy import StagingArea

    made: list[float] = []
    provide = StagingArea.provide

    def made_late() -> None:
        made.append(delay)

    def late(self: StagingArea) -> None:
        def make() -> None:
            if gate is not None:
                gate.wait(300)
            provide(self)
            made_late()

        timer = threading.Timer(delay, make)
        timer.daemon = True
        timer.start()

    monkeypatch.setattr(StagingArea, "provide", late)
    return made
