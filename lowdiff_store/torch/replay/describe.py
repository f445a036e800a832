"""Torch-level description of a log, for ``lowdiff-store inspect``."""

from __future__ import annotations

import math
import os
from typing import Any

from ...log import LogReader
from ...torchmeta.numerics import describe_runs
from .engine import log_meta


def describe_one_log(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`~lowdiff_store.torch.describe_log` of one (unsharded) log."""
    with LogReader(os.fspath(path)) as r:
        meta = log_meta(r)
        steps = {"first": r.first_step, "last": r.last_step, "durable": r.durable_step,
                 "records": len(r), "bases": list(r.bases),
                 "streamed": [{"complete": c, "slices": list(sl)} for c, sl in r.streamed]}
    codecs = {"grad": meta.grad_codec if meta.mode == "grad" else None,
              "grad_zstd": meta.grad_zstd,
              "delta": meta.delta_codec}
    return {
        "mode": meta.mode,
        "capture": meta.capture,
        "optimizer": meta.optimizer,
        "param_groups": list(meta.groups),
        "params": list(meta.params),
        "buffers": list(meta.buffers),
        "aliases": dict(meta.aliases),
        "model_tensors": [{"name": n, "dtype": t, "shape": list(s)}
                          for n, t, s in meta.model],
        "num_tensors": len(meta.model),
        "num_elements": sum(math.prod(s) for _n, _t, s in meta.model),
        "codecs": codecs,
        "compressor": meta.compressor.config if meta.compressor is not None else None,
        "scheduler": meta.scheduler,
        "scaler": meta.scaler,
        "snapshot_every": meta.snapshot_every,
        "base_slices": meta.base_slices.as_dict() if meta.base_slices is not None else None,
        "digest_every": meta.digest_every,
        "torch_version": meta.torch_version,
        "device": meta.device,
        "numerics": describe_runs(meta.numerics),
        "steps": steps,
    }


__all__ = ["describe_one_log"]
