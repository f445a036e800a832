"""The red-team tests (issue 35 item 5): CPU, one thread, deterministic, as the torch tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.tiny import one_thread

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_thread()
