"""What a log of local-update training records beyond an ordinary log, per method.

In local SGD, post-local SGD, QSR and DiLoCo every rank's replica differs from the others'
between synchronizations, so each rank logs its own replica as a complete log (its
gradients, its optimizer state, its RNG) and a synchronization is an event of the step it
ends (``format_spec/log_format.md``, "Local-update training"):

- ``@sync/NAME``: the parameter after model averaging (post-local SGD: Periodic, QSR or
  Hierarchical averaging): what the averaging all-reduce delivered, raw bits; replay
  writes it into the parameter after the step's optimizer step.
- ``@outer/NAME``: DiLoCo's averaged pseudo-gradient (what its all-reduce delivered);
  replay runs the same outer optimizer step on the global parameters with it and copies
  them into the replica.
- ``@local/counters``: int64 ``[steps, next_sync, period, hook_iter, syncs]``, the method's
  counters after the step (in every record where they changed and in every base).
- Bases add, for DiLoCo, ``@global/NAME`` and ``@outeropt/NAME/momentum_buffer``.
- The step digest (every ``digest_every`` steps) of a DiLoCo log whose ``"local"`` section
  says ``"digest_outer": true`` runs on over the global parameters and the outer
  momentum after the replica's parameters and inner state (:meth:`LocalUpdate.digest`).

A :class:`LocalUpdate` is the part that knows one method: what to log after a step, what
to add to a base, how replay applies both, and the configuration compared at restore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...errors import ConfigError, Reason
from ..core import schema as L
from ..core.optimizers import imported_classes
from ..core.specs import Spec, raw_spec
from ..core.tensors import from_bits, to_bits, write_bits
from .diloco import DiLoCo
from .qsr import QSRModelAverager

SYNC = "@sync/"
OUTER = "@outer/"
GLOBAL = "@global/"
OUTER_OPT = "@outeropt/"
COUNTERS = "@local/counters"
LOCAL_PREFIXES = (SYNC, OUTER, GLOBAL, OUTER_OPT, COUNTERS)
#: compressors whose state is each rank's own (DeMo's momenta accumulate the local
#: gradient before the exchange): several ranks log them as replicas (kind "replica")
RANK_LOCAL = ("demo",)


def rank_local_compressor(compressor: Any) -> bool:
    """Whether ``compressor``'s state is each rank's own (see :data:`RANK_LOCAL`)."""
    return compressor is not None and getattr(compressor, "kind", None) in RANK_LOCAL


def _post_local_types() -> tuple[type, ...]:
    # () unless the user imported torch.distributed.optim (see imported_classes)
    return imported_classes("torch.distributed.optim", "PostLocalSGDOptimizer")


def is_local_update(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a local-update optimizer this package logs
    (``PostLocalSGDOptimizer`` or :class:`DiLoCo`)."""
    return isinstance(optimizer, (DiLoCo, *_post_local_types()))


def _group_size(group: Any) -> int:
    return int(dist.get_world_size(group)) if dist.is_initialized() else 1


class LocalUpdate(ABC):
    """One local-update method, as the checkpointer and replay see it.

    ``names`` / ``params``: the inner optimizer's parameters in its order, set by
    :meth:`bind` before anything else is called."""

    kind = ""
    #: whether the method keeps state outside the replica and its inner optimizer
    #: (DiLoCo's global parameters and outer optimizer)
    has_outer = False

    def __init__(self, wrapper: Any, inner: torch.optim.Optimizer) -> None:
        self.wrapper = wrapper
        self.inner = inner
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.synced = False
        #: the step digest covers the outer state (a log written before it did says no:
        #: ``"digest_outer"`` absent from its ``"local"`` section)
        self.digest_outer = self.has_outer

    def bind(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        """The inner optimizer's parameter names and tensors, in its order."""
        self.names, self.params = list(names), list(params)

    # -- what differs per method
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The method's configuration, recorded in the log and compared at restore."""

    @abstractmethod
    def counters(self) -> list[int]:
        """``[steps, next_sync, period, hook_iter, syncs]`` now (-1 where not used)."""

    @abstractmethod
    def set_counters(self, c: Sequence[int]) -> list[str]:
        """Put logged counters back; returns notes (what could not be put back)."""

    def wrap_step(self, before: Callable[[], None], after: Callable[[], None]) -> Any:
        """Patch the wrapper's ``step`` so ``before``/``after`` run around it; returns a
        handle whose ``remove()`` undoes it."""
        return _StepPatch(self.wrapper, before, after, self)

    def prepare(self) -> None:
        """Called before each outer step: learn whether it will synchronize (a method
        that decides inside its own ``step`` sets nothing here)."""
        self.synced = False

    def sync_specs(self, zstd: int | None) -> list[Spec]:
        """The synchronization event of the step that just ended (empty if none)."""
        return []

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        """Method state a base holds beyond model and inner optimizer."""
        tag, arr = to_bits(torch.tensor(self.counters(), dtype=torch.int64), COUNTERS)
        return {COUNTERS: (tag, arr)}

    def log_section(self, rank: int, world: int) -> dict[str, Any]:
        """The log's ``"local"`` metadata: :meth:`config`, ``rank``, ``world_size`` and,
        for a method with outer state, ``digest_outer``."""
        out = {**self.config(), "rank": rank, "world_size": world}
        if self.has_outer:
            out["digest_outer"] = self.digest_outer
        return out

    def follow_log(self, logged: Mapping[str, Any]) -> None:
        """Take the digest definition of the log's ``"local"`` section ``logged``."""
        self.digest_outer = self.has_outer and logged.get("digest_outer") is True

    def digest(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> int:
        """The step digest: of ``params`` and their ``optimizer`` state, then (with
        :attr:`digest_outer`) of the method's outer state (:meth:`outer_items`)."""
        if not self.digest_outer:
            return L.digest_objects(params, optimizer)
        return L.digest_parts(chain(L.state_items(params, optimizer), self.outer_items()))

    def outer_items(self) -> Any:
        """The :func:`~..core.schema.digest_parts` items of the outer state (none)."""
        return iter(())

    def outer_tensors(self) -> list[torch.Tensor]:
        """The tensors of the outer state (the digest is of them as they are after the
        step: nothing changes them until the next step's synchronization)."""
        return []

    def load_base(self, base: Any) -> list[int] | None:
        """Load a base's method state; returns its counters."""
        if COUNTERS not in base.names:
            return None
        return [int(x) for x in np.asarray(base.tensor(COUNTERS)).reshape(-1)]

    def replay(self, rec: Any, names: Sequence[str], model: Mapping[str, torch.Tensor],
               live: Callable[[str], bool] | None = None) -> list[int] | None:
        """Apply a record's synchronization event; returns its counters if it has any.
        ``live(name)`` False: a parameter a streamed base holds at this step or later
        (its slice was taken after this synchronization), left as it is."""
        for n in names:
            if n.startswith(SYNC):
                pn = n[len(SYNC):]
                if live is None or live(pn):
                    write_bits(model[pn], rec.entry(n).dtype, rec.tensor(n), pn)
        if COUNTERS in names:
            return [int(x) for x in np.asarray(rec.tensor(COUNTERS)).reshape(-1)]
        return None


class _StepPatch:
    """``wrapper.step`` replaced by an instance attribute calling ``before``, the class's
    ``step``, then ``after``; ``remove()`` deletes the attribute."""

    def __init__(self, wrapper: Any, before: Callable[[], None], after: Callable[[], None],
                 method: LocalUpdate) -> None:
        self.wrapper = wrapper
        orig = type(wrapper).step

        def step(*args: Any, **kwargs: Any) -> Any:
            method.prepare()
            before()
            try:
                out = orig(wrapper, *args, **kwargs)
            except BaseException:
                after_failed()
                raise
            after()
            return out

        def after_failed() -> None:
            method.synced = False

        self.fn = step
        wrapper.step = step

    def remove(self) -> None:
        """Undo the patch (only if it is still the one in place)."""
        if vars(self.wrapper).get("step") is self.fn:
            del self.wrapper.step


class PostLocalSGD(LocalUpdate):
    """``torch.distributed.optim.PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``,
    a :class:`~.qsr.QSRModelAverager` or a ``HierarchicalModelAverager``, and the
    ``post_localSGD_hook`` state (``PostLocalSGDState.iter``) if the DDP model has it."""

    kind = "post_local_sgd"

    def __init__(self, wrapper: Any, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
            HierarchicalModelAverager,
        )

        super().__init__(wrapper, wrapper.optim)
        av = wrapper.averager
        self.averager = av
        if isinstance(av, QSRModelAverager):
            self.avg_kind = "qsr"
        elif type(av) is PeriodicModelAverager:
            self.avg_kind = "periodic"
        elif type(av) is HierarchicalModelAverager:
            self.avg_kind = "hierarchical"
        else:
            raise ConfigError(
                f"the model averager {L.class_name(av)} is not one this log knows "
                f"(PeriodicModelAverager, HierarchicalModelAverager, QSRModelAverager): "
                f"its synchronization steps cannot be recorded", reason=Reason.NOT_ALLOWED)
        self.hook_state = _post_local_state(model)

    def config(self) -> dict[str, Any]:
        av = self.averager
        out: dict[str, Any] = {"kind": self.kind, "averager": L.class_name(av),
                               "warmup_steps": int(av.warmup_steps)}
        if self.avg_kind == "periodic":
            out["period"] = int(av.period)
        elif self.avg_kind == "qsr":
            out["qsr"] = av.schedule.config()
        else:
            out["periods"] = [[int(p), _group_size(g)]
                              for p, g in av.period_process_group_dict.items()]
        hs = self.hook_state
        out["hook"] = None if hs is None else {
            "start_localSGD_iter": int(hs.start_localSGD_iter),
            "post_local_gradient_allreduce": bool(hs.post_local_gradient_allreduce)}
        return out

    def counters(self) -> list[int]:
        av = self.averager
        nxt = int(av.next_sync) if self.avg_kind == "qsr" else -1
        period = int(av.period) if self.avg_kind != "hierarchical" else -1
        it = int(self.hook_state.iter) if self.hook_state is not None else -1
        return [int(av.step), nxt, period, it, -1]

    def set_counters(self, c: Sequence[int]) -> list[str]:
        av = self.averager
        av.step = int(c[0])
        if self.avg_kind == "qsr":
            av.next_sync, av.period = int(c[1]), int(c[2])
        if c[3] >= 0:
            if self.hook_state is None:
                return ["the log holds a post_localSGD_hook iteration count but the model has "
                        "no PostLocalSGDState registered: register the hook before restore"]
            self.hook_state.iter = int(c[3])
        return []

    def prepare(self) -> None:
        av = self.averager
        if av.step < av.warmup_steps:
            self.synced = False
        elif self.avg_kind == "qsr":
            self.synced = av.will_average()
        elif self.avg_kind == "periodic":
            self.synced = (av.step - av.warmup_steps) % av.period == 0
        else:
            self.synced = av._find_process_group() is not None

    def sync_specs(self, zstd: int | None) -> list[Spec]:
        if not self.synced:
            return []
        out = []
        for n, p in zip(self.names, self.params, strict=True):
            tag, arr = to_bits(p.detach(), n)
            out.append(raw_spec(SYNC + n, tag, arr, zstd))
        return out


class DiLoCoUpdate(LocalUpdate):
    """The project's :class:`~.diloco.DiLoCo`: logs the averaged pseudo-gradient at each
    outer step; bases add the global parameters and the outer momentum."""

    kind = "diloco"
    has_outer = True

    def __init__(self, wrapper: DiLoCo) -> None:
        super().__init__(wrapper, wrapper.optim)
        self.d = wrapper

    def outer_items(self) -> Any:
        """The global parameters in the inner optimizer's order, each with its outer
        optimizer state (``momentum_buffer``, from the first outer step on)."""
        return L.state_items(self.d.global_params, self.d.outer)

    def outer_tensors(self) -> list[torch.Tensor]:
        """The global parameters and the outer momentum buffers."""
        outer = self.d.outer
        bufs = [v for g in self.d.global_params for v in outer.state.get(g, {}).values()
                if isinstance(v, torch.Tensor)]
        return [*self.d.global_params, *bufs]

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.d.config()}

    def counters(self) -> list[int]:
        d = self.d
        return [d.steps, d.next_sync, d.period, -1, d.syncs]

    def set_counters(self, c: Sequence[int]) -> list[str]:
        d = self.d
        d.steps, d.next_sync, d.period, d.syncs = int(c[0]), int(c[1]), int(c[2]), int(c[4])
        return []

    def sync_specs(self, zstd: int | None) -> list[Spec]:
        if not self.d.synced:
            return []
        out = []
        for n, g in zip(self.names, self.d.global_params, strict=True):
            assert g.grad is not None
            tag, arr = to_bits(g.grad, n)
            out.append(raw_spec(OUTER + n, tag, arr, zstd))
        return out

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        out = super().base_tensors()
        outer = self.d.outer
        for n, g in zip(self.names, self.d.global_params, strict=True):
            out[GLOBAL + n] = to_bits(g, n)
            buf = outer.state.get(g, {}).get("momentum_buffer")
            if buf is not None:
                out[OUTER_OPT + n + "/momentum_buffer"] = to_bits(buf, n)
        return out

    @torch.no_grad()
    def load_base(self, base: Any) -> list[int] | None:
        have = set(base.names)
        outer = self.d.outer
        outer.state.clear()
        for n, g in zip(self.names, self.d.global_params, strict=True):
            if GLOBAL + n not in have:
                raise ConfigError(f"the base holds no global copy of {n!r} (DiLoCo)",
                                  reason=Reason.STATE_MISMATCH, path=base.path)
            write_bits(g, base.info(GLOBAL + n)[0], base.tensor(GLOBAL + n), n)
            key = OUTER_OPT + n + "/momentum_buffer"
            if key in have:
                outer.state[g] = {"momentum_buffer": from_bits(base.info(key)[0],
                                                               base.tensor(key))}
        return super().load_base(base)

    @torch.no_grad()
    def replay(self, rec: Any, names: Sequence[str], model: Mapping[str, torch.Tensor],
               live: Callable[[str], bool] | None = None) -> list[int] | None:
        have = set(names)
        if any(n.startswith(OUTER) for n in names):
            for n, g in zip(self.names, self.d.global_params, strict=True):
                key = OUTER + n
                if key not in have:
                    raise ConfigError(f"step {rec.step}'s outer step lacks {n!r}",
                                      reason=Reason.STATE_MISMATCH, path=rec.path)
                g.grad = from_bits(rec.entry(key).dtype, rec.tensor(key))
            # the global copies and the outer state are a streamed base's first slice's:
            # every outer step after it applies to them; a replica parameter only after
            # its own slice
            self.d.outer.step()
            for n, g, p in zip(self.names, self.d.global_params, self.params, strict=True):
                if live is None or live(n):
                    p.copy_(g)
        return super().replay(rec, names, model, live)


class Logged(LocalUpdate):
    """A post-local SGD replica replayed without its averager or DDP model (the offline
    tools: ``replay --rank``, compaction): the synchronization events are applied from the
    records and the counters are the logged ones, kept for a base."""

    kind = "post_local_sgd"

    def __init__(self, inner: torch.optim.Optimizer, config: Mapping[str, Any]) -> None:
        super().__init__(inner, inner)
        self._config = {k: v for k, v in config.items()
                        if k not in ("rank", "world_size", "digest_outer")}
        self._counters = [-1, -1, -1, -1, -1]

    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def counters(self) -> list[int]:
        return list(self._counters)

    def set_counters(self, c: Sequence[int]) -> list[str]:
        self._counters = [int(x) for x in c]
        return []

    def wrap_step(self, before: Callable[[], None], after: Callable[[], None]) -> Any:
        return _NoPatch()


class Replica(LocalUpdate):
    """No synchronization event: every rank logs its own replica of a state the ranks keep
    equal through their own exchange, because part of it is each rank's own. FlexDeMo's
    setting: a plain optimizer with a rank-local compressor (:class:`DeMoCompressor`,
    whose momenta accumulate each rank's local gradient); each shard holds its rank's
    momenta, so it replays alone, bitwise."""

    kind = "replica"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, optimizer)

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def counters(self) -> list[int]:
        return [-1, -1, -1, -1, -1]

    def set_counters(self, c: Sequence[int]) -> list[str]:
        return []

    def wrap_step(self, before: Callable[[], None], after: Callable[[], None]) -> Any:
        return _NoPatch()


class _NoPatch:
    def remove(self) -> None:
        """Nothing to undo."""


def _post_local_state(model: torch.nn.Module) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
    )

    for _hook, state in getattr(model, "_comm_hooks", None) or []:
        if isinstance(state, PostLocalSGDState):
            return state
    return None


def local_update_of(optimizer: Any, model: torch.nn.Module, *, replica: bool = False
                    ) -> LocalUpdate:
    """The :class:`LocalUpdate` for a local-update optimizer (see :func:`is_local_update`),
    or with ``replica`` for a plain optimizer whose compressor state is each rank's own."""
    if replica and isinstance(optimizer, torch.optim.Optimizer) \
            and not is_local_update(optimizer):
        return Replica(optimizer)
    if isinstance(optimizer, DiLoCo):
        return DiLoCoUpdate(optimizer)
    if isinstance(optimizer, _post_local_types()):
        return PostLocalSGD(optimizer, model)
    raise ConfigError(f"{L.class_name(optimizer)} is not a local-update optimizer this log "
                      f"knows (PostLocalSGDOptimizer, DiLoCo)", reason=Reason.NOT_ALLOWED)


__all__ = ["COUNTERS", "GLOBAL", "LOCAL_PREFIXES", "OUTER", "OUTER_OPT", "SYNC",
           "DiLoCoUpdate", "LocalUpdate", "Logged", "PostLocalSGD", "RANK_LOCAL", "Replica",
           "is_local_update", "local_update_of", "rank_local_compressor"]
