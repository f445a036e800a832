"""Encoded tensors as the torch layer hands them to the writer (:class:`Spec`): compressors,
communication hooks, delta capture and the checkpointer all build them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import codecs
from ...writer.deferred import DeferredEncoding


@dataclass
class Spec:
    """One tensor of a record: encoded already, or a :class:`~lowdiff_store.writer.
    deferred.DeferredEncoding` the writer's encoder thread runs (a step batch's message,
    whose host copy may still be in flight). The arrays in ``enc`` belong to the writer
    once handed over (nobody writes to them until the writer releases them)."""

    name: str
    tag: str
    shape: tuple[int, ...]
    enc: codecs.Encoded | DeferredEncoding
    zstd: int | None = None

    @property
    def nbytes(self) -> int:
        """Encoded bytes before compression (for a deferred encoding: the host bytes its
        message holds, known without reading them)."""
        return self.enc.nbytes


def raw_spec(name: str, tag: str, arr: np.ndarray, zstd: int | None = None) -> Spec:
    """A ``raw`` tensor whose bits are ``arr`` (owned by the caller, then by the writer)."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return Spec(name, tag, tuple(arr.shape), codecs.Encoded("raw", {}, (codecs.Part(tag, flat),)),
                zstd)


__all__ = ["Spec", "raw_spec"]
