"""A streamed base read as one base (spec section 7.2): the union of its slices, each
tensor read from the slice that holds it, with the step that slice was taken after.

A streamed base is not a consistent state: the tensors of the slice taken after step s
hold the state after s. Replay starts after the first slice and moves each tensor only
at the steps after its own slice (:meth:`StreamedBase.step_of`); once past the base's
complete step every tensor is at the same step again, and the state is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError, Reason
from .base import BaseFile, CrcQueue

if TYPE_CHECKING:
    from .reader import BasePlan, LogReader


class StreamedBase:
    """The slices of the streamed base ``plan`` of ``reader``, opened and checked: each a
    slice of this log at its step, naming this base (its ``"slice"`` metadata), and no
    tensor in two slices. :meth:`meta` is the first slice's metadata (the non-tensor
    state after the first slice's step); :meth:`metas` every slice's."""

    def __init__(self, reader: LogReader, plan: BasePlan) -> None:
        self.plan = plan
        #: the step replay starts after: the first slice's
        self.step = plan.first
        self._files: list[BaseFile] = []
        self._owner: dict[str, int] = {}
        try:
            for i, s in enumerate(plan.slices):
                f = reader.slice_file(s)
                self._files.append(f)
                self._check(f, i)
                for n in f.names:
                    if n in self._owner:
                        raise FormatError(f"tensor {n!r} is in two slices of the streamed "
                                          f"base {plan.complete} (steps "
                                          f"{plan.slices[self._owner[n]]} and {s})",
                                          reason=Reason.BAD_METADATA, path=f.path)
                    self._owner[n] = i
        except BaseException:
            self.close()
            raise
        self.path = self._files[0].path
        self._meta: dict[str, Any] = self._files[0].meta()

    def _check(self, f: BaseFile, i: int) -> None:
        sl = f.meta().get("slice")
        plan = self.plan
        if (not isinstance(sl, dict) or sl.get("base") != plan.complete
                or list(sl.get("steps") or []) != list(plan.slices)):
            raise FormatError(f"slice {i} of the streamed base {plan.complete} names "
                              f"another base ({sl!r})", reason=Reason.BAD_METADATA,
                              path=f.path)

    @property
    def names(self) -> list[str]:
        """Every tensor name, slice by slice in the order of their steps."""
        return list(self._owner)

    def step_of(self, name: str) -> int:
        """The step after which the slice holding ``name`` was taken."""
        return self.plan.slices[self._owner[name]]

    def file_of(self, name: str) -> BaseFile:
        """The slice file holding ``name``."""
        try:
            return self._files[self._owner[name]]
        except KeyError:
            raise KeyError(name) from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype tag, shape) of ``name``."""
        return self.file_of(name).info(name)

    def tensor(self, name: str, *, verify: bool = True) -> np.ndarray:
        """The tensor ``name`` (CRC checked), as its slice file returns it."""
        return self.file_of(name).tensor(name, verify=verify)

    def read_into(self, name: str, out: np.ndarray, *, checks: CrcQueue | None = None
                  ) -> None:
        """Read ``name`` into ``out`` (see :meth:`BaseFile.read_into`)."""
        self.file_of(name).read_into(name, out, checks=checks)

    def meta(self) -> dict[str, Any]:
        """The metadata replay starts from (the first slice's, unless replaced by
        :meth:`set_meta`)."""
        return self._meta

    def set_meta(self, meta: dict[str, Any]) -> None:
        """Replace what :meth:`meta` returns (a layer above merging the slices' own)."""
        self._meta = meta

    def metas(self) -> list[dict[str, Any]]:
        """Each slice's metadata, in step order."""
        return [f.meta() for f in self._files]

    @property
    def nbytes(self) -> int:
        """Bytes of every slice file."""
        return sum(f.nbytes for f in self._files)

    def close(self) -> None:
        """Close every slice file."""
        for f in self._files:
            f.close()

    def __enter__(self) -> StreamedBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["StreamedBase"]
