"""lowdiff-store: a storage engine and file format for per-iteration checkpointing.

A *base* (full snapshot) every F steps and one small *diff* record per step in an
append-only, checksummed log; recovery loads the nearest base and replays the diffs.

This package never imports torch; the torch adapters live in :mod:`lowdiff_store.torch`.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .log import BaseFile, LogReader, LogWriter, Record, RecoveryReport, tensor_input
    from .log.latest import latest_step

__version__ = "0.1.0"

#: Names of the log layer, loaded on first use (PEP 562): importing the package stays
#: cheap, so the CLI is in control (Ctrl-C, errors) before numpy and the codecs load.
_LAZY = {"BaseFile": "log", "LogReader": "log", "LogWriter": "log", "Record": "log",
         "RecoveryReport": "log", "tensor_input": "log", "latest_step": "log.latest"}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
