"""The tuner applied to a log: read the costs a run recorded, recommend (F, B).

The torch checkpointer records its measurements (iteration time, diff bytes, write
bandwidth, fsync cost, base stall, replay cost per step...) in the manifest's metadata under
``"measurements"`` (a :class:`~lowdiff_store.tuning.Measurements` dict), refreshed at every
base and at close; its ``AutoTuner`` decisions go into the records' ``"tuning"`` field.
Measured sizes from the log itself (mean diff record bytes) override the recorded ones.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import ConfigError, Reason
from .format.constants import SLICE_NAME
from .log.reader import LogReader
from .tuning import Measurements, Recommendation, recommend


def recorded_measurements(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The measurements recorded in the log (may be empty), with the diff size measured
    from the log's records."""
    with LogReader(path, strict=False) as r:
        meta = r.meta
        rec = dict(meta.get("measurements") or {})
        if len(r):
            rec["diff_bytes"] = r.record_bytes / len(r)
    return rec


def streamed_state_bytes(path: str | os.PathLike[str]) -> int | None:
    """The bytes of the newest streamed base's slices (about the state), or None when the
    log streams no base."""
    with LogReader(path, strict=False) as r:
        if not r.streamed:
            return None
        return sum(r.store.size(SLICE_NAME.format(s)) for s in r.streamed[-1][1])


def recommend_for_log(path: str | os.PathLike[str], *, mtbf: float,
                      restart_cost: float | None = None) -> Recommendation:
    """Recommend ``snapshot_every`` and ``batch`` for the run that wrote ``path``.
    ``restart_cost``: the job's restart time R (s), which no log can measure; None keeps
    the recorded one (:data:`~lowdiff_store.tuning.DEFAULT_RESTART_COST`, an assumption)."""
    data = recorded_measurements(path)
    data["mtbf"] = mtbf
    if restart_cost is not None:
        data["restart_cost"] = restart_cost
    missing = [k for k in ("iteration_time", "write_bandwidth", "fsync_cost", "base_cost",
                           "replay_cost") if k not in data]
    if missing:
        raise ConfigError(
            f"the log has no recorded {', '.join(missing)}: it was not written by "
            "lowdiff_store.torch.DiffCheckpointer (which records its measured costs)",
            reason=Reason.INVALID_ARGUMENT, path=os.fspath(path))
    return recommend(Measurements.from_dict(data), state_bytes=streamed_state_bytes(path))


def recorded_decisions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The changes of (snapshot_every, batch) the checkpointer's tuner made during the run
    (``Decision.to_dict()`` from each record's ``"tuning"`` field), in step order. Reads
    record metadata only."""
    out: list[dict[str, Any]] = []
    with LogReader(path, strict=False, verify=False) as r:
        for rec in r.iter_records():
            d = rec.meta.get("tuning")
            if isinstance(d, dict):
                out.append(d)
    return out


__all__ = ["recommend_for_log", "recorded_decisions", "recorded_measurements"]
