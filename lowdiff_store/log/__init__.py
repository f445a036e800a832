"""The log layer: segments, index, manifest, bases; open, append, scan, recover."""

from .base import BaseFile, write_base
from .manifest import Manifest, load_manifest
from .reader import LogReader, Record, RecoveryReport
from .tensors import from_encoded, tensor_input
from .writer import DEFAULT_SEGMENT_BYTES, LogWriter

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "BaseFile",
    "LogReader",
    "LogWriter",
    "Manifest",
    "Record",
    "RecoveryReport",
    "from_encoded",
    "load_manifest",
    "tensor_input",
    "write_base",
]
