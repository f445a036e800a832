"""One log per rank: the per-rank checkpointer (a partition of owned tensors and a gradient
source handed to :class:`~..capture.checkpointer.DiffCheckpointer`), sharded restore and
resharding to any world size and layout, FSDP2 placements, the user-facing DDP communication
hooks and the tee that logs what they communicate. The top room under :mod:`..api`."""

from .checkpointer import set_coordination_group

__all__ = ["set_coordination_group"]
