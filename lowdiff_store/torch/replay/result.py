"""What a restore reports (:class:`RestoreResult`, public as
``lowdiff_store.torch.RestoreResult``). Its own module because both the replay engine, which
fills it, and :mod:`.restore`, which returns it, need it, and the engine is below
:mod:`.restore`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.registry import RestoreInfo


@dataclass
class RestoreResult:
    """What :func:`restore` put into the objects.

    Attributes:
        step: the step the objects now hold.
        extra: what ``extra_state()`` returned at that step, or None.
        base_step: the base replay started from (a streamed base: the step it is
            complete at).
        base_slices: a streamed base: the steps its slices were taken after (replay ran
            from the first, each tensor from its own slice's step); empty for a base.
        replayed: number of diffs replayed.
        verified: steps whose recorded digest was checked (and matched).
        exact: every piece of state is bit-exact; False only when an error-feedback
            residual had to be approximated (see ``notes`` and docs/torch.md).
        notes: human-readable remarks (approximations, state not restored).
        info: what a :class:`DiffCheckpointer` created next on the objects continues from
            (pass this result as ``DiffCheckpointer(..., restored=)``; without it the
            checkpointer finds it by the optimizer, see
            :mod:`~lowdiff_store.torch.core.registry`).
    """

    step: int
    extra: Any = None
    base_step: int = 0
    base_slices: list[int] = field(default_factory=list)
    replayed: int = 0
    verified: list[int] = field(default_factory=list)
    exact: bool = True
    notes: list[str] = field(default_factory=list)
    info: RestoreInfo | None = field(default=None, repr=False, compare=False)


__all__ = ["RestoreResult"]
