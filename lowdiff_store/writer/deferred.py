"""Encodings computed on the writer's encoder thread rather than by the caller.

A caller whose tensor lives on an accelerator cannot encode it without waiting for the
device (the copy to host memory, the data-dependent gaps of sparse indices, bit packing);
it hands the writer a :class:`DeferredEncoding` instead of a :class:`~lowdiff_store.codecs.
Encoded`: ``encode()`` runs in the encoder stage of :class:`~lowdiff_store.writer.
AsyncLogWriter`, after which the record is laid out, checksummed and written as if the
encoded parts had been given to ``append``. The bytes of the log do not depend on which
of the two was given.

Contract: ``encode()`` is called at most once, on the encoder thread, and returns the
parts (it may wait for a copy to end, and it may return views of memory the caller keeps
unchanged until the record's ``on_release``), or None: the tensor is left out of the
record (a value the caller could not compare with the last logged one without waiting
for the device, found unchanged there; the record is the one it would be without it).
An exception it raises fails the record and poisons the writer, as any encoding error
does. ``nbytes`` is the host memory the caller
holds for the record until it is released: it counts toward the writer's
``memory_budget`` like staged bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import codecs


@dataclass(frozen=True)
class DeferredEncoding:
    """An encoded tensor made on the encoder thread (see the module docstring)."""

    #: makes the encoded parts, or None to leave the tensor out (called once, on the
    #: encoder thread)
    encode: Callable[[], codecs.Encoded | None]
    #: host bytes held for it until the record is released (counted in the budget)
    nbytes: int

    def __post_init__(self) -> None:
        if not callable(self.encode):
            raise TypeError("DeferredEncoding.encode must be callable")
        if type(self.nbytes) is not int or self.nbytes < 0:
            raise ValueError(f"DeferredEncoding.nbytes={self.nbytes!r} must be an int >= 0")


__all__ = ["DeferredEncoding"]
