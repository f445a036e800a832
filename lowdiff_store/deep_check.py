"""What ``verify`` decodes beyond the checksums: everything replay decodes, with the same
decoders and limits, so a log that ``verify`` calls ok is one that replay reads.

- every tensor of every record is decoded (zstd frames decompressed and checked against the
  sizes they declare, sparse/q8/low-rank parameters and parts checked; an xor delta is
  decoded against zeros, which checks everything but the reference it needs at replay);
- every base's metadata is decoded (the same msgpack decoder and caps as replay);
- a log written by the torch layer has its torch metadata checked by the schema of
  :mod:`lowdiff_store.torchmeta`: the log's and every base's parsed as replay parses them,
  every record's side channel checked;
- a tuner decision (a record's ``tuning``) is parsed in every log, as the report reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CodecError, LowdiffError, Reason
from .format.constants import MANIFEST_NAME
from .format.dtypes import STORAGE_DTYPE
from .format.record import TensorEntry, parse_tensors
from .log.reference import AnyBase
from .log.streamed import StreamedBase
from .log.tensors import decode_entry, part_arrays
from .torchmeta import (
    LogMeta,
    check_record_meta,
    parse,
    parse_base,
    parse_streamed,
    record_decision,
)


def log_schema(log_dir: str, meta: Mapping[str, Any]) -> LogMeta | None:
    """The torch metadata of the log (parsed), or None for a log the torch layer did not
    write. Raises FormatError(bad_metadata) naming the manifest."""
    if "torch" not in meta:
        return None
    schema = meta["torch"]
    if isinstance(schema, dict) and type(schema.get("schema")) is int and \
            schema["schema"] > 1:
        return None  # a newer torch schema: replay refuses it with its own reason
    return parse(schema, os.path.join(log_dir, MANIFEST_NAME))


def check_record(meta: Mapping[str, Any], payload: memoryview, schema: LogMeta | None,
                 *, path: str, offset: int, step: int) -> None:
    """Decode every tensor of a record (after its CRC passed) and check its torch fields."""
    entries = parse_tensors(meta, payload.nbytes)
    for e in entries:
        _decode(e, payload)
    if schema is not None:  # the torch fields, the tuner's decision among them
        check_record_meta(meta, schema, [e.name for e in entries], path=path, offset=offset,
                          step=step)
    else:  # any writer may record a decision (``extra``): the report reads it from any log
        record_decision(meta, path=path, offset=offset, step=step)


def _decode(e: TensorEntry, payload: memoryview) -> None:
    if e.codec != "xor":
        decode_entry(e, payload)
        return
    parts = part_arrays(e, payload)  # decompressed and size-checked first
    if sum(p.size for p in parts) != e.numel:
        raise CodecError(f"tensor {e.name!r}: xor parts hold {sum(p.size for p in parts)} "
                         f"elements, the shape {e.numel}", reason=Reason.DECODE_SIZE_MISMATCH)
    decode_entry(e, payload, ref=np.zeros(e.shape, dtype=STORAGE_DTYPE[e.dtype]))


def check_base(bf: AnyBase | StreamedBase, schema: LogMeta | None) -> None:
    """Decode a base's metadata and check its torch part against the log's."""
    meta = bf.meta()
    if schema is not None:
        tensors = None if schema.shard is not None else {n: bf.info(n) for n in bf.names}
        parse_base(meta.get("torch"), schema, path=bf.path, tensors=tensors, step=bf.step)


def check_streamed(base: StreamedBase, schema: LogMeta | None, paths: Sequence[str]) -> None:
    """Decode a streamed base's metadata (every slice's, ``paths`` the slices' files) and
    check its torch part against the log's as replay reads it: each slice at its own
    step, a parameter's optimizer state and residual in its slice, the slices' tensors
    together a whole base (:func:`~lowdiff_store.torchmeta.parse_streamed`)."""
    metas = base.metas()
    if schema is None:
        return
    held = {n: base.step_of(n) for n in base.names}
    base.set_meta(parse_streamed(metas, schema, slices=base.plan.slices, held=held,
                                 paths=paths))
    check_base(base, schema)


def located(err: LowdiffError, path: str, offset: int | None) -> LowdiffError:
    """``err`` with ``path``/``offset`` filled in where it had none."""
    if err.path is None:
        err.path, err.offset = path, offset
        Exception.__init__(err, str(err))
    return err


__all__ = ["check_base", "check_record", "check_streamed", "located", "log_schema"]
