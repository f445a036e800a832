"""Torch adapters: per-step capture (:class:`DiffCheckpointer`), exact recovery
(:func:`restore`), time travel without the model (:func:`replay_state`), top-k compressed
training (:class:`TopKCompressor`), export and inspection; distributed training (one log per
rank, DDP communication-hook reuse: :mod:`lowdiff_store.torch.distributed`).

This is the only package of lowdiff-store that imports torch. See ``docs/torch.md``.
"""

from .api import TorchMaterializer, describe_log, replay_state, restore
from .checkpointer import DiffCheckpointer
from .comm_hooks import TopKAllGatherState, topk_allgather_hook
from .compress import TopKCompressor
from .export import FORMATS, export_state, flatten_optimizer_state
from .materialize import materialize_base
from .replay import RestoreResult
from .schema import ALLOWED_OPTIMIZERS

__all__ = [
    "ALLOWED_OPTIMIZERS",
    "FORMATS",
    "DiffCheckpointer",
    "RestoreResult",
    "TopKAllGatherState",
    "TopKCompressor",
    "TorchMaterializer",
    "describe_log",
    "export_state",
    "flatten_optimizer_state",
    "materialize_base",
    "replay_state",
    "restore",
    "topk_allgather_hook",
]
