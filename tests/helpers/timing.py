"""Deadlines for the tests that wait on other processes or threads.

A test never asserts how long something took and never stops after N seconds of work: it
counts steps and events, and waits for a condition under a *deadline* that only bounds a
hang. Deadlines are generous for a loaded 2-core machine and multiplied by
``LOWDIFF_TEST_TIME_SCALE`` (default 1; e.g. 3 on a slower or busier machine). A deadline
that runs out fails the test with what was awaited, never passes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def time_scale() -> float:
    """The factor ``LOWDIFF_TEST_TIME_SCALE`` (at least 1: a deadline is never shortened)."""
    raw = os.environ.get("LOWDIFF_TEST_TIME_SCALE", "1")
    try:
        return max(1.0, float(raw))
    except ValueError:
        raise ValueError(f"LOWDIFF_TEST_TIME_SCALE={raw!r}: not a number") from None


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`time_scale`: a deadline, never an expected duration."""
    return seconds * time_scale()


def wait_for(condition: Callable[[], T], what: str, timeout: float = 60.0,
             interval: float = 0.005) -> T:
    """Poll ``condition`` until it returns a true value, which is returned. Fails the test
    (AssertionError naming ``what``) if ``scaled(timeout)`` seconds pass first."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {limit:.0f} s")
        time.sleep(interval)
