"""lowdiff-store: a storage engine and file format for per-iteration checkpointing.

A *base* (full snapshot) every F steps and one small *diff* record per step in an
append-only, checksummed log; recovery loads the nearest base and replays the diffs.

This package never imports torch; the torch adapters live in :mod:`lowdiff_store.torch`.
"""

from .errors import (
    BadMagicError,
    CodecError,
    CommitError,
    ConfigError,
    CorruptRecordError,
    FormatError,
    LowdiffError,
    ManifestError,
    Reason,
    ReplayError,
    StepNotFoundError,
    StorageError,
    UnsupportedVersionError,
    WriterClosedError,
)
from .format.constants import FORMAT_MAJOR, FORMAT_MINOR
from .log import BaseFile, LogReader, LogWriter, Record, RecoveryReport, tensor_input
from .log.latest import latest_step

__version__ = "0.1.0"

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "BadMagicError",
    "BaseFile",
    "CodecError",
    "CommitError",
    "ConfigError",
    "CorruptRecordError",
    "FormatError",
    "LogReader",
    "LogWriter",
    "LowdiffError",
    "ManifestError",
    "Reason",
    "Record",
    "RecoveryReport",
    "ReplayError",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedVersionError",
    "WriterClosedError",
    "__version__",
    "latest_step",
    "tensor_input",
]
