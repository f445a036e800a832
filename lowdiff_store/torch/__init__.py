"""Torch adapters: per-step capture (:class:`DiffCheckpointer`), exact recovery
(:func:`restore`), time travel without the model (:func:`replay_state`), top-k compressed
training (:class:`TopKCompressor`), export and inspection; distributed training (one log per
rank, DDP communication-hook reuse: :mod:`lowdiff_store.torch.distributed`).

This is the only package of lowdiff-store that imports torch. See ``docs/torch.md``.
"""

from ._layout import ALLOWED_OPTIMIZERS
from ._replay import RestoreResult, replay_state
from .checkpointer import DiffCheckpointer
from .comm_hooks import TopKAllGatherState, topk_allgather_hook
from .compress import TopKCompressor
from .describe import describe_log
from .export import FORMATS, export_state, flatten_optimizer_state
from .materialize import materialize_base
from .optim_wrap import unwrap_optimizer
from .resume import restore
from .stateful import LateExtra, Stateful

__all__ = [
    "ALLOWED_OPTIMIZERS",
    "FORMATS",
    "DiffCheckpointer",
    "LateExtra",
    "RestoreResult",
    "Stateful",
    "TopKAllGatherState",
    "TopKCompressor",
    "describe_log",
    "export_state",
    "flatten_optimizer_state",
    "materialize_base",
    "replay_state",
    "restore",
    "topk_allgather_hook",
    "unwrap_optimizer",
]
