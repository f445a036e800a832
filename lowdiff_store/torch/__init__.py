"""Torch adapters: per-step capture (:class:`DiffCheckpointer`), exact recovery
(:func:`restore`), time travel without the model (:func:`replay_state`), compressed
training (:class:`TopKCompressor`, :class:`TernGradCompressor`, :class:`QSGDCompressor`,
:class:`DeMoCompressor` with the :class:`DeMo` optimizer), export and inspection;
distributed training (one log per rank, DDP communication-hook reuse:
:mod:`lowdiff_store.torch.distributed.checkpointer`).

This is the only package of lowdiff-store that imports torch. See ``docs/torch.md``.
"""

from .api import TorchMaterializer, describe_log, pin_numerics, replay_state, restore
from .capture.bases.initial import InitialBase
from .capture.checkpointer import DiffCheckpointer
from .capture.stateful import LateExtra, Stateful
from .compressors.demo import DeMo, DeMoCompressor
from .compressors.quantized import QSGDCompressor, TernGradCompressor
from .compressors.topk import GradCompressor, TopKCompressor
from .core.optimizers import unwrap_optimizer
from .core.schema import ALLOWED_OPTIMIZERS
from .distributed.diloco import DiLoCo
from .distributed.hooks import (
    QSGDState,
    TernGradState,
    TopKAllGatherState,
    qsgd_hook,
    terngrad_hook,
    topk_allgather_hook,
)
from .distributed.local_sgd import restore_replica
from .distributed.qsr import QSRModelAverager, QSRSchedule, qsr_period
from .replay.export import FORMATS, ExportResult, export_state, flatten_optimizer_state
from .replay.materialize import materialize_base
from .replay.restore import RestoreResult

__all__ = [
    "ALLOWED_OPTIMIZERS",
    "FORMATS",
    "DeMo",
    "DeMoCompressor",
    "DiLoCo",
    "DiffCheckpointer",
    "ExportResult",
    "GradCompressor",
    "InitialBase",
    "QSGDCompressor",
    "LateExtra",
    "QSGDState",
    "QSRModelAverager",
    "QSRSchedule",
    "RestoreResult",
    "TernGradCompressor",
    "TernGradState",
    "Stateful",
    "TopKAllGatherState",
    "TopKCompressor",
    "TorchMaterializer",
    "describe_log",
    "export_state",
    "flatten_optimizer_state",
    "materialize_base",
    "pin_numerics",
    "replay_state",
    "qsgd_hook",
    "qsr_period",
    "restore",
    "restore_replica",
    "terngrad_hook",
    "topk_allgather_hook",
    "unwrap_optimizer",
]
