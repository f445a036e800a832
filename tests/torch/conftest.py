"""Shared setup for the torch adapter tests: CPU, one thread, deterministic."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)
