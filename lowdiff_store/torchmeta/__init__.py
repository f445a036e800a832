"""The schema of the torch layer's metadata, parsed without torch.

The torch layer (:mod:`lowdiff_store.torch`) stores three kinds of msgpack metadata
(docs/torch.md, "What is stored"): the log-level map ``meta["torch"]`` of the manifest, the
map ``"torch"`` of every base, and each record's side channel (``side``) and optional fields
(``digest``, ``tuning``). Their CRCs only prove that the bytes are the ones written; a file
crafted with valid checksums can still hold a map that does not follow the schema. This
package reads the schema the way the core format reads its own headers: types, allow-lists
(modes, codecs, dtype tags), names that refer to each other, shapes bounded by the format's
limits, packed values (``typed_msgpack``) well formed and small. Every violation is one
:class:`~lowdiff_store.errors.FormatError` with reason ``bad_metadata``, the file and, where
known, the offset.

- :mod:`.names`: every tensor-name prefix, and the class names earlier versions recorded;
- :mod:`.checks`: the constants and the checks of small values;
- :mod:`.meta`: the log's and a base's metadata parsed once into frozen dataclasses
  (:class:`LogMeta`, :class:`ShardMeta`, :class:`BaseMeta`), which consumers read;
- :mod:`.record`: a record's side channel, checked against its log's :class:`LogMeta`;
- :mod:`.decision`: a record's tuner decision (``tuning``) parsed into a
  :class:`RecordedDecision` (a field any log may carry).

It imports neither torch nor numpy, so :func:`lowdiff_store.verify.verify_log` applies the
same checks as replay (a log that ``verify`` passes is one that replay reads), and the torch
layer parses once where it opens a log or a base, and checks each record it reads.
"""

from __future__ import annotations

from typing import Any

from .checks import (
    AMP_KEYS,
    CAPTURES,
    DELTA_CODECS,
    EF_STATES,
    GRAD_CODECS,
    HYPER_KINDS,
    LAYOUTS,
    MAP_TAG,
    MAX_DEPTH,
    MAX_INLINE_NUMEL,
    MAX_RANKS,
    MODES,
    SCHEMA,
    TENSOR_TAG,
    TUPLE_TAG,
)
from .decision import RecordedDecision, parse_decision, record_decision
from .meta import (
    BaseMeta,
    BaseSlices,
    CompressorMeta,
    LogMeta,
    Mesh,
    ModelTensor,
    OptLayout,
    PieceMeta,
    ShardMeta,
    parse,
    parse_base,
    parse_streamed,
)
from .record import check_record_meta


def check_log_meta(meta: Any, path: str | None = None) -> dict[str, Any]:
    """The log-level torch metadata ``meta`` itself, once :func:`parse` accepts it (one
    FormatError(bad_metadata) naming ``path`` if not)."""
    parse(meta, path)
    out: dict[str, Any] = meta
    return out


__all__ = ["AMP_KEYS", "CAPTURES", "DELTA_CODECS", "EF_STATES", "GRAD_CODECS", "HYPER_KINDS",
           "LAYOUTS", "MAP_TAG", "MAX_DEPTH", "MAX_INLINE_NUMEL", "MAX_RANKS", "MODES",
           "SCHEMA", "TENSOR_TAG", "TUPLE_TAG", "BaseMeta", "BaseSlices", "CompressorMeta",
           "LogMeta", "Mesh", "ModelTensor", "OptLayout", "PieceMeta", "RecordedDecision",
           "ShardMeta", "check_log_meta", "check_record_meta", "parse", "parse_base",
           "parse_decision", "parse_streamed", "record_decision"]
