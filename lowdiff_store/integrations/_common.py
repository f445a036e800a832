"""What the trainer callbacks share: their arguments and the ``resume="never"`` rule."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError, Reason
from ..format.constants import MANIFEST_NAME, SHARDS_NAME
from ..storage import open_store

#: ``resume=`` values: ``"auto"`` continues an existing log, ``"never"`` refuses one.
RESUME_MODES = ("auto", "never")


def callback_args(path: str | os.PathLike[str], resume: str, options: dict[str, Any]
                  ) -> tuple[str, str, dict[str, Any]]:
    """Check a callback's arguments: ``(path, resume, DiffCheckpointer options)``. The
    scheduler, scaler and extra state are the trainer's own, never passed by the user."""
    if resume not in RESUME_MODES:
        raise ConfigError(f"resume={resume!r} must be one of {RESUME_MODES}")
    for bad in ("extra_state", "scheduler", "scaler"):
        if bad in options:
            raise ConfigError(f"{bad}= is set by the callback (the trainer's own)")
    return os.fspath(path), resume, options


def refuse_existing(path: str, resume: str) -> None:
    """With ``resume="never"``, a log (or sharded checkpoint) already at ``path`` is an
    error (``history_conflict``)."""
    store = open_store(path)
    if resume == "never" and any(store.exists(n) for n in (MANIFEST_NAME, SHARDS_NAME)):
        raise ConfigError(f"{path} already holds a log and resume='never': use an empty "
                          f"directory", reason=Reason.HISTORY_CONFLICT, path=path)


__all__ = ["RESUME_MODES", "callback_args", "refuse_existing"]
