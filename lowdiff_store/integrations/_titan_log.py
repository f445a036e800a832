"""What :class:`~lowdiff_store.integrations.torchtitan.LowDiffCheckpointManager` reads of its
log and of torchtitan's job, apart from the manager itself: which DCP checkpoints the log's
bases refer to (retention must not delete them), when a base is durable on every rank, and
the digest of the job's configuration a resume is checked against.

The retention rule (``docs/integrations.md``, torchtitan): the log keeps the newest base
durable on every rank and the records from it on; a DCP directory that a base of the log
still refers to is never deleted by ``keep_latest_k``, its deletion is put off until the
log has dropped that base.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..log import LogReader
from ..log.manifest import load_manifest
from ..log.reference import table_of
from ..log.shards import log_paths


def needed_dirs(log: str) -> set[str]:
    """The external checkpoint directories the live bases of the log at ``log`` (every
    shard of a sharded one) refer to, as absolute normalized paths; empty for no log."""
    if not os.path.isdir(log):
        return set()
    out: set[str] = set()
    for p in log_paths(log):
        if not os.path.isdir(p):
            continue
        with LogReader(p, verify=False) as r:
            for b in r.bases:
                bf = r.base_file(b)
                try:
                    ref = table_of(bf)
                finally:
                    bf.close()
                if ref is not None:
                    out.add(os.path.normpath(os.path.abspath(ref.root)))
    return out


def base_everywhere(log: str, step: int) -> bool:
    """Whether every shard of the log at ``log`` (or the one log) has published its base of
    ``step`` (a published base is durable)."""
    return all(step in load_manifest(p).bases for p in log_paths(log))


#: the parts of torchtitan's ``Trainer.Config.to_dict()`` a resumed job must share with the
#: job that wrote the log (dotted paths); the rest (dump folder, metrics, profiler,
#: checkpoint, comm, validator, logging) may change between runs
CONFIG_PARTS = ("model_spec", "hf_assets_path", "tokenizer", "dataloader", "optimizer",
                "lr_scheduler", "training", "parallelism", "activation_checkpoint", "compile",
                "loss", "quantize", "debug.seed", "debug.deterministic", "debug.batch_invariant")
#: within those, what may change: ``training.steps`` (a run extended or cut short)
CONFIG_FREE = ("training.steps",)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _dig(d: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _without(d: Any, path: str, free: Iterable[str]) -> Any:
    """``d`` (the value at ``path``) without the keys of ``free`` below ``path``."""
    if not isinstance(d, dict):
        return d
    return {k: _without(v, f"{path}.{k}", free) for k, v in d.items()
            if f"{path}.{k}" not in free}


def config_digest(trainer: Any) -> dict[str, str]:
    """``{part: digest}`` of the parts :data:`CONFIG_PARTS` of ``trainer.config`` (a
    torchtitan ``Trainer``: the ``train_state`` torchtitan hands its checkpoint manager);
    empty when there is no such config. Values are canonical JSON (functions by their
    names: object addresses are removed), each digested with SHA-256 (16 hex digits)."""
    cfg = getattr(trainer, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        return {}
    full = to_dict()
    out = {}
    for part in CONFIG_PARTS:
        value = _without(_dig(full, part), part, CONFIG_FREE)
        text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
        out[part] = hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()[:16]
    return out


def config_changes(logged: Mapping[str, str], now: Mapping[str, str],
                   ignore: Sequence[str]) -> list[str]:
    """The parts whose digest differs between the log's job and this one, except those
    ``ignore`` names (nothing is compared when either job has no config)."""
    if not logged or not now:
        return []
    return sorted(k for k in set(logged) | set(now)
                  if logged.get(k) != now.get(k) and k not in ignore)


__all__ = ["CONFIG_FREE", "CONFIG_PARTS", "base_everywhere", "config_changes",
           "config_digest", "needed_dirs"]
