"""The batched asynchronous writer (layer 5): :class:`AsyncLogWriter` stages the caller's
arrays, encodes and batches records on one thread, writes and syncs groups on another, and
acknowledges durability in step order, over the synchronous
:class:`~lowdiff_store.log.LogWriter` (which frames records and owns the files)."""

from .async_writer import AsyncLogWriter, TensorSpec
from .staging import StagingPool

__all__ = ["AsyncLogWriter", "StagingPool", "TensorSpec"]
