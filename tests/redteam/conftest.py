"""The red-team tests (issue 35 item 5): CPU, one thread, deterministic, as the torch tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)
