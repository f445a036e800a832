"""Base staging under a budget too small for one base (issue 35 item 5): refused when the
checkpointer is made, in one line naming what to raise, before any step runs; the log
directory it had opened starts normally when the script is run again with a budget that
fits (the same re-run after a crash before base 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowdiff_store import LowdiffError, Reason, latest_step
from lowdiff_store.torch import DiffCheckpointer, restore

from .common import build, one_line, same_bits, train

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_staging_budget_smaller_than_a_base(tmp_path: Path, writer: str) -> None:
    m, opt = build(0)
    process = writer == "process"
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=2, staging_budget=64,
                         writer_process=process)
    assert ei.value.reason is Reason.OUT_OF_BOUNDS
    one_line(ei.value, "staging_budget=64", "raise staging_budget to at least")
    assert latest_step(tmp_path / "log") is None  # nothing durable: start fresh
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=2,
                          staging_budget=1 << 20, writer_process=process):
        train(m, opt, 0, 5)
    m2, opt2 = build(3)
    assert restore(tmp_path / "log", m2, opt2).step == 5
    same_bits(m2.state_dict(), m.state_dict())
