"""Where captured gradients live until the writer has them: host buffers, the layer-wise
copies made during backward, and the device-to-host copy events.

- :class:`~lowdiff_store.torch.core.step_batch.HostPool` recycles host buffers (pinned
  when copying from CUDA); a buffer goes back once the writer is done with the record
  holding it.
- :class:`GradStaging` is layer-wise capture (``capture="layerwise"``, LowDiff+): a
  gradient is copied as soon as backward produces it (on a side stream under CUDA), and at
  the optimizer step a staged copy is used only if the gradient is the same tensor with the
  same version counter and the same memory (``.data`` assignments swap the memory without
  bumping the counter); :meth:`GradStaging.claim` and :meth:`GradStaging.copy_claimed`
  make the dense copies otherwise.
- :func:`copies_done` marks the end of the non-blocking copies just issued.
- Dense copies of CPU gradients can run *beside* the optimizer step, on a helper thread
  (the copy releases the GIL), and the checkpointer's first post-step hook waits for
  them. Only for a step that never writes its gradients
  (:func:`~.optim_wrap.step_reads_grads_only`): a write during the copy would tear it.
  This is the CPU's counterpart of the non-blocking device-to-host copy under CUDA: it
  takes the copy off the training thread (``docs/design.md``, section 5).
- :class:`GradCapture` is one checkpointer's gradient capture at the optimizer step: it owns
  the staging, the step's :class:`~lowdiff_store.torch.core.step_batch.StepBatch` (the
  compressor's messages: one copy per device and dtype; the dense copies' events), the
  captured specs and buffers, and the identities of the gradients captured, from the
  pre-step hook until the step's record takes them. Every spec it makes is encoded on the
  writer's encoder thread, after the step's copies ended: the training thread neither
  waits for the device nor touches the host copies (``tests/torch/test_host_sync.py``).
  A :class:`GradSource` (the DDP tee) may supply some gradients in another form.

What is logged when is decided by :class:`~lowdiff_store.torch.DiffCheckpointer`.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ... import codecs
from ...errors import ConfigError, Reason
from ...threads import HelperPool, usable_cores
from ..core import schema as L
from ..core.optimizers import step_reads_grads_only
from ..core.specs import Spec, raw_spec
from ..core.step_batch import HostPool, StepBatch
from ..core.tensors import bits_view, local_of, tag_of, to_bits
from ..core.typed_msgpack import pack
from .in_flight import GATE_COUNTERS, RecordGate, Ticket, gate_for
from .lending import GradLender, LentGrad

#: What identifies a gradient's contents short of reading them: the tensor, its version
#: counter (bumped by in-place torch ops), its memory and layout (a ``.data`` assignment
#: keeps the tensor and the counter but swaps the memory).
GradIdent = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]


def grad_ident(g: torch.Tensor) -> GradIdent:
    """The :data:`GradIdent` of gradient ``g`` as it is now."""
    return (id(g), g._version, g.data_ptr(), tuple(g.shape), tuple(g.stride()))


def copies_done(sources: list[torch.Tensor], side: Mapping[torch.device, Any],
                devices: Iterable[torch.device] = ()) -> list[Any]:
    """Events marking the end of the non-blocking device-to-host copies just issued from
    ``sources`` and on ``devices`` (on each device's current stream, and its side stream for
    layer-wise copies); empty on CPU, where copies are synchronous. Waited for on the
    writer's encoder thread (:meth:`StepBatch.wait`)."""
    events = []
    devs = {t.device for t in sources if t.device.type == "cuda"}
    devs |= {d for d in devices if d.type == "cuda"}
    for dev in devs:
        stream = torch.cuda.current_stream(dev)
        if dev in side:
            stream.wait_stream(side[dev])
        ev = torch.cuda.Event()
        ev.record(stream)
        events.append(ev)
    return events


#: the helper thread for copies beside the step
_COPIER = HelperPool("lowdiff-grad-copy", lambda cores: 1)


class GradStaging:
    """Gradient copies for one checkpointer: layer-wise copies made during backward, and
    dense copies at the optimizer step, in buffers of :attr:`pool`."""

    def __init__(self) -> None:
        self.pool = HostPool()
        #: a side stream per CUDA device for layer-wise copies
        self.streams: dict[torch.device, Any] = {}
        #: name -> (host copy, identity of the gradient copied) made during backward
        self._staged: dict[str, tuple[torch.Tensor, GradIdent]] = {}
        #: dense copies claimed, made together by copy_claimed: (host buffer, gradient)
        self._todo: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the CPU copy running beside the step, and its sources' versions when it began
        #: (see :meth:`copy_claimed`)
        self._beside: Future[None] | None = None
        self._beside_srcs: list[tuple[torch.Tensor, int]] = []

    def stage(self, name: str, g: torch.Tensor) -> None:
        """Layer-wise: copy gradient ``g`` of parameter ``name`` now (backward just made it)."""
        old = self._staged.get(name)
        buf = old[0] if old is not None and old[0].shape == g.shape and \
            old[0].dtype == g.dtype else self.pool.take(g)
        if g.device.type == "cuda":
            stream = self.streams.get(g.device)
            if stream is None:
                stream = self.streams[g.device] = torch.cuda.Stream(g.device)
            stream.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(stream):
                buf.copy_(g, non_blocking=True)
            g.record_stream(stream)
        else:
            buf.copy_(g)
        self._staged[name] = (buf, grad_ident(g))

    def valid(self, name: str, g: torch.Tensor) -> bool:
        """The staged copy of ``name`` holds ``g`` as it is now (same tensor, same version,
        same memory)."""
        s = self._staged.get(name)
        return s is not None and s[1] == grad_ident(g)

    def rescaled(self, name: str, g: torch.Tensor) -> None:
        """``g`` was scaled in place by a recorded coefficient (clipping): its staged copy
        stays the pre-scale gradient, valid at the new version."""
        buf, _old = self._staged[name]
        self._staged[name] = (buf, grad_ident(g))

    def claim(self, name: str, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The host copy of ``g`` to log: the staged one if still valid (True), else a
        host buffer that :meth:`copy_claimed` fills (False)."""
        staged = self._staged.pop(name, None)
        if staged is not None and staged[1] == grad_ident(g):
            return staged[0], True
        if staged is not None:
            self.pool.give([staged[0]])
        buf = self.pool.take(g)
        self._todo.append((buf, local_of(g)))
        return buf, False

    def copy_claimed(self, *, beside: bool = False) -> None:
        """Make the dense copies claimed since the last call: one ``torch._foreach_copy_``
        per source device (non-blocking from CUDA into pinned buffers), not a Python call
        per tensor. With ``beside``, the CPU copy runs on a helper thread while the caller
        goes on (into the optimizer step): :meth:`wait` before the buffers are read or the
        gradients may change."""
        self.wait()  # one in flight at a time (a step that raised never waited for its own)
        todo, self._todo = self._todo, []
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for buf, src in todo:
            dst, srcs = by_device.setdefault(src.device, ([], []))
            dst.append(buf)
            srcs.append(src)
        helper = _COPIER.get() if beside else None
        for dev, (dst, srcs) in by_device.items():
            if dev in self.streams:  # a buffer given back by a stale layer-wise copy and
                # taken again: that copy (on the side stream) must land first
                torch.cuda.current_stream(dev).wait_stream(self.streams[dev])
            if dev.type == "cpu" and helper is not None:
                try:
                    self._beside_srcs = [(t, t._version) for t in srcs]
                    self._beside = helper[0].submit(torch._foreach_copy_, dst, srcs)
                    continue
                except RuntimeError:  # "cannot schedule new futures after shutdown"
                    self._beside_srcs = []
            torch._foreach_copy_(dst, srcs, non_blocking=dev.type == "cuda")

    def wait(self) -> bool:
        """Wait for the copy running beside the step, if any (re-raising its error).
        Returns False when an in-place torch op changed one of its sources meanwhile
        (the copy may be torn), else True."""
        fut, self._beside = self._beside, None
        srcs, self._beside_srcs = self._beside_srcs, []
        if fut is None:
            return True
        fut.result()
        return all(t._version == v for t, v in srcs)

    def drop_unclaimed(self) -> None:
        """Give back the staged copies no step consumed (parameters without a gradient)."""
        self.pool.give([b for b, _i in self._staged.values()])
        self._staged = {}


class DenseMessage:
    """A dense gradient's host copy (in a buffer of the pool): logged ``raw``; viewed as
    numpy on the encoder thread, once the step's copies ended."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def ship(self, batch: StepBatch) -> None:
        """Nothing to add: the dense copies are the capture's own (``_foreach_copy_``)."""

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``raw`` tensor (on the encoder thread)."""
        tag, arr = bits_view(self.buf)
        return codecs.Encoded("raw", {}, (codecs.Part(tag, arr.reshape(-1)),))

    def host_tensor(self) -> torch.Tensor:
        """The host tensor whose bits are logged (a writer process's ring copies it)."""
        return self.buf


class GradSource(Protocol):
    """Gradients that reach the log in another form than a dense copy of ``.grad`` (the
    DDP tee: what a communication hook produced). Without one, every gradient is copied."""

    def claim(self, names: Sequence[str], params: Sequence[torch.Tensor]
              ) -> Container[str] | None:
        """The parameters whose gradients this source supplies for the step about to run
        (the capture copies the others), or None for none."""

    def supply(self, cap: GradCapture, side: dict[str, Any]) -> None:
        """After the dense copies: add the claimed gradients (and this source's own state)
        to ``cap``'s specs, buffers and identities, and to the step's ``side``."""

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        """This source's state, for a base."""


@runtime_checkable
class DigestSource(Protocol):
    """A :class:`GradSource` whose state is part of the step digest (local-update
    training: DiLoCo's global parameters and outer momentum)."""

    def digest(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> int:
        """The step digest of ``params``, their ``optimizer`` state and this source's."""

    def digest_tensors(self) -> list[torch.Tensor]:
        """This source's tensors the digest reads (unchanged until the next step)."""


class GradCapture:
    """The gradients one optimizer step consumes, from its pre-step hook until the step's
    record takes them (then :meth:`reset`) or the step is skipped (:meth:`release`).

    ``names``/``params``: the optimizer parameters logged; ``compressor``: its compressed
    message is logged instead of the gradient; ``zstd``: level for dense gradients;
    ``source``: see :class:`GradSource`. Owns :attr:`staging` (host buffers, layer-wise
    copies) and the state of the step being captured: :attr:`specs`, :attr:`batch` (the
    step's :class:`StepBatch`), :attr:`bufs` (host buffers the record holds), :attr:`seen`
    (the identity of each gradient captured), :attr:`last` (no pre-step hook ran after the
    capture) and :attr:`refused` (a step that could not be logged: every later one is
    refused too). The copies' events are the batch's, waited for on the writer's encoder
    thread, never on the training thread."""

    def __init__(self, names: list[str], params: list[torch.Tensor], optimizer: Any, *,
                 compressor: Any, zstd: int | None, path: str,
                 source: GradSource | None = None) -> None:
        self.staging = GradStaging()
        self.pool = self.staging.pool
        self.names, self.params = names, params
        self.optimizer, self.compressor, self.zstd = optimizer, compressor, zstd
        self.path = path
        self.source = source
        self.last = True
        self.refused: ConfigError | None = None
        self._clip: tuple[torch.Tensor, dict[str, int]] | None = None
        self.specs: list[Spec] = []
        self.bufs: list[torch.Tensor] = []
        self.seen: dict[str, GradIdent] = {}
        self.batch = StepBatch(self.pool)
        #: lends dropped CPU gradients to their record instead of copying them
        self.lender = GradLender(names, params, self.pool, path)
        #: bounds the dense records in flight (:mod:`.in_flight`; None: not bounded, the
        #: records are a compressor's or a tee's); :attr:`ticket`: the place in flight of
        #: the step being captured, until its record takes it (:meth:`reset`)
        self.gate: RecordGate | None = None
        self.ticket: Ticket | None = None
        self._kept = 0.0  # lent gradients copied before training wrote them, so far
        #: the last capture lent gradients to its record (see :meth:`hand_over_now`)
        self.lent = False

    @property
    def refusal(self) -> ConfigError | None:
        """Why every step from now on is refused (one could not be logged: the log would
        skip it), or None: :attr:`refused`, or the lender's refusal."""
        return self.refused or self.lender.refused

    def lost(self, step: int, error: BaseException) -> None:
        """Step ``step`` could not be logged (``error`` finalizing it): every later step is
        refused (the log would skip one), with ``error`` if it is a ``ConfigError``."""
        if self.refusal is None:
            self.refused = error if isinstance(error, ConfigError) else ConfigError(
                f"step {step} could not be logged ({type(error).__name__}: {error}); the "
                f"checkpointer takes no later step", reason=Reason.STATE_MISMATCH,
                path=self.path)

    def hold(self) -> None:
        """Before the step's first buffer is taken or gradient lent: its place in flight
        (waits while the gate is full; kept by a capture repeated after a step that
        raised)."""
        if self.gate is not None and self.ticket is None:
            self.ticket = self.gate.enter()

    def stats(self) -> dict[str, float]:
        """The lender's counters, and the gate's (:mod:`.in_flight`; zeros without one)."""
        gate = self.gate.stats if self.gate is not None else dict.fromkeys(GATE_COUNTERS, 0)
        return {**self.lender.stats, **gate}

    def open_gate(self, mode: str, source: Any, options: Any, sink: Any) -> None:
        """Bound this capture's dense records in flight into ``sink`` (``mode`` and
        ``source``: the checkpointer's; ``options``: its :class:`.CheckpointerOptions`,
        for the writer options and ``records_in_flight``; see
        :func:`.in_flight.gate_for`)."""
        self.gate = gate_for(mode, self.compressor, source, self.params, options.writer, sink,
                             most=options.records_in_flight)
        self.lender.pad = options.heap_pad

    def gate_full(self) -> bool:
        """The next capture would wait for the writer (:meth:`RecordGate.full`)."""
        return self.gate is not None and self.gate.full()

    def hand_over_now(self) -> bool:
        """At the pre-step hook: hand the record just finalized to the writer now, not
        after the step. Now for a dense record (one the gate bounds) when the next capture
        would wait for the writer (:meth:`gate_full`), or when its gradients were lent or
        this capture lends (:meth:`.GradLender.lending`): a lent record's memory is
        gradients training dropped, freed only once written, so its write runs beside the
        step and the next forward and backward, done before the backward after that makes
        new gradients (one lent record alive between steps, not two). A record of copies
        waits for the post-step hook: its buffers are the pool's either way, and its CRC
        and page-cache copies then run beside forward and backward, not the memory-bound
        step; so does a compressor's (small) record, which no gate bounds."""
        return self.gate_full() or (self.gate is not None
                                    and (self.lent or self.lender.lending()))

    def take_ticket(self) -> Ticket | None:
        """The captured step's place in flight, handed to its record."""
        ticket, self.ticket = self.ticket, None
        return ticket

    def reset(self) -> None:
        """Forget the step's gradients: its record took :attr:`specs` and :attr:`bufs`
        (with the batch they came from), or :meth:`release` gave them back."""
        self.specs = []
        self.bufs = []
        self.seen = {}
        self.batch = StepBatch(self.pool)

    def capture(self, side: dict[str, Any]) -> None:
        """Capture the gradients the step is about to consume (the host buffers of a
        capture repeated after a step that raised go back with this one's record); a
        clipping scale or a grad scaler's state goes to ``side``."""
        self.hold()
        self.specs, self.seen = [], {}
        if self.batch.shipped:  # a capture repeated after a step that raised
            self.batch = StepBatch(self.pool)
        batch = self.batch
        src = self.source
        teed = src.claim(self.names, self.params) if src is not None else None
        lender = self.lender
        lender.observe()
        opt = self.optimizer
        lendable = src is None and self.last and step_reads_grads_only(
            opt, grad_scale=isinstance(getattr(opt, "grad_scale", None), torch.Tensor))
        lent: list[tuple[str, LentGrad]] = []
        copies: list[tuple[str, torch.Tensor]] = []
        sources: list[torch.Tensor] = []
        comp, zstd = self.compressor, self.zstd
        clip, self._clip = self._clip, None
        scaled: list[str] = []
        for name, p in zip(self.names, self.params, strict=True):
            g = p.grad
            if g is None or (teed and name in teed):
                continue
            if g.layout != torch.strided:
                raise ConfigError(f"parameter {name}: sparse gradients are not supported",
                                  reason=Reason.NOT_ALLOWED, path=self.path)
            self.seen[name] = grad_ident(g)
            lender.captured(name, g)
            logged = comp.specs(p, name, zstd, batch) if comp is not None else None
            if logged is not None:  # the compressor's message
                self.specs.extend(logged)
                continue
            if not self.staging.valid(name, g) and lender.may_lend(g, lendable):
                lent.append((name, lender.lend(name, g, self.bufs)))  # no copy
                continue
            buf, staged = self.staging.claim(name, g)
            if staged and clip is not None and clip[1].get(name) == g._version:
                scaled.append(name)  # the copy is the pre-clip gradient: replay rescales
            copies.append((name, buf))
            sources.append(local_of(g))
            self.bufs.append(buf)
        self.lent = bool(lent)
        kept = self.lender.stats["lent_copied"]
        if lent and not copies and self.gate is not None and kept == self._kept:
            # lending took over from copies (dense capture: the pool holds nothing else),
            # and no copy-on-write since the last capture took a buffer
            self.pool.trim()
        self._kept = kept
        batch.ship(record=False)
        self._copy(sources)
        self.bufs.extend(batch.buffers)
        for name, buf in copies:
            self.specs.append(batch.spec(L.GRAD + name, tag_of(buf), tuple(buf.shape),
                                         DenseMessage(buf), zstd, buf.nbytes))
        for name, lg in lent:
            g = lg.tensor
            self.specs.append(batch.spec(L.GRAD + name, tag_of(g), tuple(g.shape), lg, zstd,
                                         g.nbytes))
        if scaled:
            assert clip is not None
            side["clip"] = {"scale": pack(clip[0].cpu()), "params": scaled}
        amp = {k: pack(getattr(opt, k).detach().cpu()) for k in ("grad_scale", "found_inf")
               if isinstance(getattr(opt, k, None), torch.Tensor)}
        if amp:
            side["amp"] = amp
        if src is not None:
            src.supply(self, side)

    def _copy(self, sources: list[torch.Tensor]) -> None:
        # CPU copies run beside a step that only reads its gradients (waited for by the
        # first post-step hook), when nothing runs between this capture and the step's
        # code and a core is free for them; under CUDA they are non-blocking anyway
        opt = self.optimizer
        by_scaler = isinstance(getattr(opt, "grad_scale", None), torch.Tensor)
        self.staging.copy_claimed(beside=self.last
                                  and torch.get_num_threads() < usable_cores()
                                  and step_reads_grads_only(opt, grad_scale=by_scaler))
        self.staging.drop_unclaimed()
        self.batch.events = copies_done(sources, self.staging.streams, self.batch.devices)

    def copy_done(self, step: int) -> None:
        """Wait for the gradient copy running beside step ``step``. A step known to only
        read its gradients (``step_reads_grads_only``) that changed one anyway (its version
        moved) may have torn the copy (or changed a gradient lent to the record): the step
        is refused, and so is every later one (the log would run a step behind the
        optimizer); the steps before it stay."""
        if self.staging.wait() and self.lender.intact():
            return
        self.release()  # (its place in flight too: no record will hold it)
        self.refused = ConfigError(
            f"a gradient changed during optimizer.step() while it was being copied beside "
            f"the step ({type(self.optimizer).__name__} is known to only read its "
            f"gradients): step {step} cannot be logged, and the checkpointer "
            f"takes no later step; is another thread or a patched step writing gradients?",
            reason=Reason.STATE_MISMATCH, path=self.path)
        raise self.refused

    def release(self) -> None:
        """The step was skipped: its buffers go back to the pool once their copies end."""
        self.staging.wait()
        self.batch.wait()  # before the buffers can be reused
        self.pool.give(self.bufs)
        self.lender.pending = {}  # (lent gradients: nothing to give back)
        if (ticket := self.take_ticket()) is not None:
            ticket.leave()
        self.reset()

    def check(self, side: dict[str, Any]) -> None:
        """A gradient changed between the capture and the end of the step: when a pre-step
        hook ran after ours (:attr:`last` is False), it may have changed it before the step
        consumed it; capture it again. When ours ran last, the step itself changed it
        (foreach SGD with Nesterov momentum adds the momentum into ``.grad``) after
        consuming what we captured, and replay's step will change it again: the capture
        stands."""
        if self.last:
            return
        for name, p in zip(self.names, self.params, strict=True):
            g = p.grad
            now = None if g is None else grad_ident(g)
            if self.seen.get(name) == now:
                continue
            self.specs = [s for s in self.specs if s.name != L.GRAD + name]
            clip = side.get("clip")
            if clip is not None and name in clip["params"]:
                clip["params"].remove(name)
            if g is not None:
                tag, arr = to_bits(g, name)
                self.specs.append(raw_spec(L.GRAD + name, tag, arr, self.zstd))
                self.seen[name] = grad_ident(g)
            else:
                self.seen.pop(name, None)

    def stage_layer(self, name: str, p: torch.Tensor) -> None:
        """Layer-wise capture: copy a gradient as soon as backward has produced it."""
        if p.grad is not None:
            self.hold()
            self.staging.stage(name, p.grad)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach: bool | None, *, layerwise: bool) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the logged parameters; with
        ``layerwise`` the scale is recorded (the staged copies stay valid)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if not grads:
            return total
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        valid = {n for n, p in zip(self.names, self.params, strict=True)
                 if p.grad is not None and self.staging.valid(n, p.grad)}
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            torch._foreach_mul_(gs, coef.to(dev))
        if layerwise:
            after: dict[str, int] = {}
            for n, p in zip(self.names, self.params, strict=True):
                if n in valid and p.grad is not None:
                    self.staging.rescaled(n, p.grad)
                    after[n] = p.grad._version
            self._clip = (coef.detach(), after)
        return total



__all__ = ["DenseMessage", "DigestSource", "GradCapture", "GradIdent", "GradSource", "GradStaging",
           "HostPool", "copies_done", "grad_ident"]
