"""What a step's record states besides its gradients or weight deltas: hyperparameters,
scheduler, scaler, ``extra_state()``, module buffers, RNG states and (``ef_state="step"``)
compressor residuals, each only when it changed since the last record (:class:`Carried`).

Residuals live on the parameters' devices and change every step: the training thread never
reads them. A residual is logged when it is a new tensor or its version moved since it was
last logged (no host read to compare bits); the step's residuals go to the host as one
:class:`~lowdiff_store.torch.core.step_batch.StepBatch` (one copy per device and dtype,
non-blocking under CUDA, an event after it), encoded on the writer's encoder thread.

A record's side keys keep the order they always had (the bytes written depend on it):
``hyper`` at the pre-step hook, ``extra`` after the step (unless late), then at finalize
``hyper_after``, ``sched``, ``scaler``, ``skipped`` and a late ``extra``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, Reason
from ..core import schema as L
from ..core.specs import Spec, raw_spec
from ..core.step_batch import BitsMessage, ChangedBitsMessage, HostPool, StepBatch
from ..core.tensors import ModelEntries, local_of, same_bytes, to_bits, unwrap_model
from ..core.typed_msgpack import pack
from ..replay.materialize import base_meta
from .carried import Carried
from .stateful import ExtraSource


class FollowedBuffers(dict[str, torch.Tensor]):
    """A model's persistent buffers by name (``entries.buffers``), followed when the model
    replaces one by assignment (``module.count = module.count + 1`` rebinds the name to a
    new tensor): :meth:`follow` takes the tensors the model holds now, here, in
    ``entries.tensors`` and in the map it is given (the model tensors the bases, digests
    and delta captures read: a per-rank layout's ``Partition.model`` is a map of its
    own), so the records and bases log the buffer training uses, not the one it
    dropped. A replacement of another shape, dtype or device is refused
    (``ConfigError``): replay copies a logged buffer into the restored model's own. A
    name whose module cannot be found (a module with its own state-dict names) is not
    followed."""

    def __init__(self, model: torch.nn.Module, entries: ModelEntries) -> None:
        super().__init__({n: entries.tensors[n] for n in entries.buffers})
        self._tensors = entries.tensors
        inner = unwrap_model(model)
        self._slots: list[tuple[str, torch.nn.Module, str]] = []
        for name, t in self.items():
            prefix, _, key = name.rpartition(".")
            try:
                mod = inner.get_submodule(prefix) if prefix else inner
            except AttributeError:
                continue
            if mod._buffers.get(key) is t:
                self._slots.append((name, mod, key))

    def follow(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Take the buffers the model holds now (see the class docstring), in ``tensors``
        too (model tensors by name) where it holds them."""
        for name, mod, key in self._slots:
            now, old = mod._buffers.get(key), self[name]
            if now is old:
                continue
            if now is None or now.shape != old.shape or now.dtype != old.dtype \
                    or now.device != old.device:
                what = "removed" if now is None else \
                    f"{tuple(now.shape)} {now.dtype} on {now.device}"
                raise ConfigError(
                    f"buffer {name!r} ({tuple(old.shape)} {old.dtype} on {old.device}) was "
                    f"replaced: {what}; a log follows a replaced buffer only when its shape, "
                    f"dtype and device stay (assign in place with copy_, or make a new "
                    f"checkpointer)", reason=Reason.NOT_ALLOWED)
            self[name] = self._tensors[name] = now
            if tensors is not None and name in tensors:
                tensors[name] = now


class SideChannel:
    """The side channel of one checkpointer: ``optimizer``, ``scheduler``, ``scaler``,
    ``extra`` (what ``extra_state`` gives), ``buffers`` (module buffers by name) and, with
    ``ef_zstd`` given (``ef_state="step"``), the residuals of ``compressor`` for the
    parameters ``names``/``params``, copied through host buffers of ``pool``.
    :attr:`values` carries packed values, :attr:`tensors` arrays by record name; both start
    from the objects as they are at creation."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 extra: ExtraSource, buffers: Mapping[str, torch.Tensor], *,
                 compressor: Any = None, names: list[str] | None = None,
                 params: list[torch.Tensor] | None = None, ef_step: bool = False,
                 ef_zstd: int | None = None, pool: HostPool | None = None) -> None:
        self.optimizer, self.scheduler, self.scaler, self.extra = \
            optimizer, scheduler, scaler, extra
        self.buffers = buffers
        ef = compressor is not None and compressor.error_feedback and ef_step
        self._ef = list(zip(names or [], [L.EF + n for n in names or []], params or [],
                            strict=True)) if ef else []
        self._compressor, self._ef_zstd = compressor, ef_zstd
        self._pool = pool if pool is not None else HostPool()
        #: record name -> (residual, its version) as last logged; weak: a compressor that
        #: replaces its residuals each step frees the old ones on the device
        self._ef_logged: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}
        #: device buffer name -> (tag, bytes) last logged or carried (encoder thread)
        self._buf_last: dict[str, tuple[str, np.ndarray]] = {}
        self.values, self.tensors = Carried(L.same), Carried(same_bytes)
        self.values.set("hyper", L.hyper_of(optimizer))
        self.values.set("sched", self._sched())
        self.values.set("scaler", self._scaler())
        self.values.set("extra", self._extra())

    def _sched(self) -> Any:
        if self.scheduler is None:
            return None
        return pack(self.scheduler.state_dict(), "scheduler.state_dict()")

    def _scaler(self) -> Any:
        if self.scaler is None:
            return None
        return pack(self.scaler.state_dict(), "scaler.state_dict()")

    def _extra(self) -> Any:
        if not self.extra.active:
            return None
        return pack(self.extra(), "extra_state()")

    def _put(self, side: dict[str, Any], key: str, value: Any, carried: str) -> None:
        if self.values.changed(carried, value):
            side[key] = value

    def _put_tensor(self, specs: list[Spec], name: str, tag: str, arr: np.ndarray,
                    zstd: int | None = None) -> None:
        if self.tensors.changed(name, arr):
            specs.append(raw_spec(name, tag, arr, zstd))

    def prime(self) -> None:
        """Carry the RNG states and buffers as they are now (the state of the first base)."""
        for name, arr in L.rng_states().items():
            self.tensors.set(name, arr)
        for name, b in self.buffers.items():
            tag, arr = to_bits(b, name)
            if self.on_host(b):
                self.tensors.set(name, arr)
            else:  # (before any record: the encoder thread reads it from then on)
                self._buf_last[name] = (tag, arr.reshape(-1).view(np.uint8))

    def forget(self) -> None:
        """The next record states every value (after a resume)."""
        self.values.forget()
        self.tensors.forget()
        self._ef_logged = {}
        self._buf_last = {}  # (a new one: records still being encoded keep the old)

    def before_step(self, side: dict[str, Any]) -> None:
        """The pre-step hook: the hyperparameters the step runs with."""
        self._put(side, "hyper", L.hyper_of(self.optimizer), "hyper")

    def buffers_after_step(self, specs: list[Spec], release: list[torch.Tensor]) -> None:
        """After the step (grad mode): the module buffers that changed. A host buffer is
        compared bit for bit with the last logged value, here. A device buffer is never
        read back on the training thread (a synchronization per buffer per step): every
        device buffer goes out in the step's batch (one non-blocking copy; its host
        buffers join ``release``) and is compared with the last logged bits on the
        writer's encoder thread, which leaves an unchanged one out of the record
        (:class:`~lowdiff_store.torch.core.step_batch.ChangedBitsMessage`)."""
        batch: StepBatch | None = None
        for name, b in self.buffers.items():
            if self.on_host(b):
                tag, arr = to_bits(b, name)
                self._put_tensor(specs, name, tag, arr)
                continue
            batch = batch if batch is not None else StepBatch(self._pool)
            msg = ChangedBitsMessage(b, name, self._buf_last)
            specs.append(batch.spec(name, msg.tag, msg.shape, msg, None, msg.nbytes))
        if batch is not None:
            batch.ship()
            release.extend(batch.buffers)

    @staticmethod
    def on_host(t: torch.Tensor) -> bool:
        """Whether ``t`` is compared on the training thread (a CPU tensor: no
        synchronization) rather than on the writer's encoder thread (a device tensor)."""
        return local_of(t).device.type == "cpu"

    def after_step(self, specs: list[Spec], side: dict[str, Any],
                   release: list[torch.Tensor]) -> None:
        """After the step: RNG states, ``extra_state()`` (unless late), residuals (their
        host buffers join ``release``, given back once the record is written)."""
        for name, arr in L.rng_states().items():
            self._put_tensor(specs, name, "U8", arr)
        if not self.extra.late:
            self._put(side, "extra", self._extra(), "extra")
        if self._ef:
            self._residuals(specs, release)

    def _residuals(self, specs: list[Spec], release: list[torch.Tensor]) -> None:
        comp, logged = self._compressor, self._ef_logged
        batch = StepBatch(self._pool)
        for name, ef, prm in self._ef:
            r: torch.Tensor | None = comp.residuals.get(prm)
            if r is None:
                continue
            last = logged.get(ef)
            if last is not None and last[0]() is r and last[1] == r._version:
                continue
            logged[ef] = (weakref.ref(r), r._version)
            msg = BitsMessage(r, name)
            specs.append(batch.spec(ef, msg.tag, msg.shape, msg, self._ef_zstd, msg.nbytes))
        batch.ship()
        release.extend(batch.buffers)

    def complete(self, side: dict[str, Any], *, skipped: bool, late_extra: bool) -> None:
        """At finalize (the scheduler and scaler ran): what changed since the step."""
        self._put(side, "hyper_after", L.hyper_of(self.optimizer), "hyper")
        self._put(side, "sched", self._sched(), "sched")
        self._put(side, "scaler", self._scaler(), "scaler")
        if skipped:
            side["skipped"] = True
        if late_extra and self.extra.late:
            self._put(side, "extra", self._extra(), "extra")

    def base_meta(self, step: int, opt: dict[str, Any], log: dict[str, Any]) -> dict[str, Any]:
        """The metadata of the base of ``step`` (the values carried now)."""
        v = self.values
        return base_meta(step, hyper=v.get("hyper"), sched=v.get("sched"),
                         scaler=v.get("scaler"), extra=v.get("extra"), opt=opt, log=log)


__all__ = ["SideChannel"]
