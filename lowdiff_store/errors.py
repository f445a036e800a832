"""Error types of lowdiff-store.

There is one root, :class:`LowdiffError` (an ``Exception``, never a ``BaseException``).
Leaves also inherit the matching builtin (``ValueError`` for bad bytes, ``OSError`` for
I/O, ``RuntimeError`` for misuse), so callers that already catch those keep working.

Every error carries a stable *reason code* (:class:`Reason`), the file it concerns and,
where it applies, the byte offset. Reason codes are data: the spec
(``format_spec/log_format.md``, section "Reason codes"), the golden vectors and the tests
all use them; messages are for people and may change.

``str(err)`` is always one line: ``PATH:OFFSET: REASON: detail``.
"""

from __future__ import annotations

import enum
import os


class Reason(str, enum.Enum):
    """Stable reason codes. The values are part of the format's public contract."""

    # framing and headers
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_format_version"
    TRUNCATED = "truncated"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_RECORD_LENGTH = "bad_record_length"
    UNKNOWN_RECORD_TYPE = "unknown_record_type"
    BAD_METADATA = "bad_metadata"
    METADATA_TOO_LARGE = "metadata_too_large"
    OUT_OF_BOUNDS = "out_of_bounds"
    LIMIT_EXCEEDED = "limit_exceeded"
    BAD_DTYPE = "bad_dtype"
    UNSAFE_NAME = "unsafe_name"
    # codecs
    UNKNOWN_CODEC = "unknown_codec"
    BAD_CODEC_PARAMS = "bad_codec_params"
    DECODE_SIZE_MISMATCH = "decode_size_mismatch"
    # log structure
    STEP_OUT_OF_ORDER = "step_out_of_order"
    LOG_ID_MISMATCH = "log_id_mismatch"
    MISSING_FILE = "missing_file"
    INDEX_STALE = "index_stale"
    NO_SUCH_STEP = "no_such_step"
    NO_BASE = "no_base"
    NOT_A_LOG = "not_a_log"
    REFERENCE_CHANGED = "reference_changed"
    # storage and writer
    IO_ERROR = "io_error"
    WRITER_CLOSED = "writer_closed"
    WRITER_FAILED = "writer_failed"
    LOCKED = "locked"
    ALREADY_EXISTS = "already_exists"
    COMMIT_CONFLICT = "commit_conflict"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    STORE_UNAVAILABLE = "store_unavailable"
    UNSAFE_STORE = "unsafe_store"
    # semantics (torch layer, distributed, replay)
    WORLD_SIZE_MISMATCH = "world_size_mismatch"
    HISTORY_CONFLICT = "history_conflict"
    NOT_ALLOWED = "not_allowed"
    STATE_MISMATCH = "state_mismatch"
    REPLAY_DIVERGED = "replay_diverged"
    NUMERICS_MISMATCH = "numerics_mismatch"
    INVALID_ARGUMENT = "invalid_argument"

    def __str__(self) -> str:
        return self.value


class LowdiffError(Exception):
    """Root of every error raised by lowdiff-store.

    Attributes:
        reason: the stable :class:`Reason` code.
        path: the file or directory concerned, or ``None``.
        offset: the byte offset in ``path`` where the problem was found, or ``None``.
        detail: a human-readable explanation (one line).
    """

    default_reason: Reason = Reason.INVALID_ARGUMENT

    def __init__(
        self,
        detail: str,
        *,
        reason: Reason | None = None,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
    ) -> None:
        self.reason: Reason = reason if reason is not None else self.default_reason
        self.path: str | None = os.fspath(path) if path is not None else None
        self.offset: int | None = offset
        self.detail: str = " ".join(str(detail).split())  # always one line
        # Exception.__init__ (not OSError's) keeps args a single message for every leaf.
        Exception.__init__(self, self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path if self.offset is None else f"{self.path}:{self.offset}"
            where += ": "
        elif self.offset is not None:
            where = f"offset {self.offset}: "
        return f"{where}{self.reason.value}: {self.detail}"

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly description (used by the CLI's ``--json`` output)."""
        return {
            "error": type(self).__name__,
            "reason": self.reason.value,
            "path": self.path,
            "offset": self.offset,
            "detail": self.detail,
        }


class FormatError(LowdiffError, ValueError):
    """Bytes that do not follow the format (bad header, bad metadata, limits)."""

    default_reason = Reason.BAD_METADATA


class CorruptRecordError(FormatError):
    """A record or file failed its checksum or framing checks."""

    default_reason = Reason.CHECKSUM_MISMATCH


class BadMagicError(FormatError):
    """The file does not start with the expected magic bytes."""

    default_reason = Reason.BAD_MAGIC


class UnsupportedVersionError(FormatError):
    """The file was written by a newer major format version than this build reads."""

    default_reason = Reason.UNSUPPORTED_VERSION

    def __init__(self, found: int, supported: int, **kw: object) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            f"unsupported format version {found} (this build reads up to {supported})",
            **kw,  # type: ignore[arg-type]
        )


class CodecError(FormatError):
    """A codec could not encode or decode (unknown codec, bad parameters, sizes)."""

    default_reason = Reason.BAD_CODEC_PARAMS


class ManifestError(FormatError):
    """The manifest is unreadable or names files that are missing or invalid."""

    default_reason = Reason.BAD_METADATA


class StepNotFoundError(LowdiffError, LookupError):
    """The requested step is not in the log (or no base precedes it)."""

    default_reason = Reason.NO_SUCH_STEP


class StorageError(LowdiffError, OSError):
    """An I/O failure (ENOSPC, EIO, permissions); the original error is ``__cause__``."""

    default_reason = Reason.IO_ERROR


class WriterClosedError(LowdiffError, RuntimeError):
    """An append or flush on a writer that is closed or failed."""

    default_reason = Reason.WRITER_CLOSED


class CommitError(LowdiffError, RuntimeError):
    """A background batch failed; the step that failed and the cause are named."""

    default_reason = Reason.WRITER_FAILED


class ConfigError(LowdiffError, ValueError):
    """Invalid arguments or a state that the caller must resolve (history conflict...)."""

    default_reason = Reason.INVALID_ARGUMENT


class ReplayError(LowdiffError, RuntimeError):
    """Replay could not reproduce the recorded state (digest mismatch, missing state)."""

    default_reason = Reason.REPLAY_DIVERGED


__all__ = [
    "BadMagicError",
    "CodecError",
    "CommitError",
    "ConfigError",
    "CorruptRecordError",
    "FormatError",
    "LowdiffError",
    "ManifestError",
    "Reason",
    "ReplayError",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedVersionError",
    "WriterClosedError",
]
