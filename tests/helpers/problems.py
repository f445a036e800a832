"""Logs with as many problems as records, for the report's and verify's linear-work checks
(``tests/test_report_contract.py``) and their benchmark (``bench/bench_report.py
--problems``): tiny records written with the core ``LogWriter``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lowdiff_store import LogReader, LogWriter, tensor_input

#: what ``Decision.to_dict()`` writes (lowdiff_store/tuning.py)
GOOD: dict[str, Any] = {"step": 2, "snapshot_every": 9, "batch": 2,
                        "previous_snapshot_every": 8, "previous_batch": 1,
                        "predicted_waste_before": 0.02, "predicted_waste_after": None,
                        "reason": "model: fewer bases", "measurements": None}


def write_log(log: str | Path, n: int, decision: Callable[[int], Any] | None = None) -> None:
    """A core log of ``n`` tiny records after base 0; ``decision(step)`` is the step's
    ``tuning`` field (None: none)."""
    with LogWriter(log) as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        for t in range(1, n + 1):
            d = decision(t) if decision is not None else None
            w.append(t, [tensor_input("w", np.full(4, t, np.float32), "F32")], kind="grad",
                     extra=None if d is None else {"tuning": d})
        w.sync()


def damaged_log(log: str | Path, n: int, damage: str) -> None:
    """A log of ``n`` records each of which is a problem. ``"decision"``: every record
    holds a tuner decision whose step is a string (valid CRCs: ``verify`` and the report's
    own read each find ``n`` problems); ``"checksum"``: every record's checksum broken
    (scanning stops at the first, the report's read of every record finds each)."""
    if damage == "decision":
        write_log(log, n, lambda t: {**GOOD, "step": str(t)})
        return
    if damage != "checksum":
        raise ValueError(f"damage must be 'decision' or 'checksum', not {damage!r}")
    write_log(log, n)
    with LogReader(log) as r:
        table = r.record_table()
        (_sid, path, _size), = r.segment_files()
    raw = bytearray(Path(path).read_bytes())
    for _step, _sid, off, length in table.tolist():
        raw[off + length - 8] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
