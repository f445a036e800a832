"""Shared setup for the torch adapter tests: CPU, one thread, deterministic."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.tiny import one_thread

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_thread()
