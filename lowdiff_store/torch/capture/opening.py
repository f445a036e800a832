"""Opening a log for a checkpointer: the torch metadata it records, and where it starts: a
new log at step 0, or an existing one continued from the step :func:`restore` put into
the objects."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...log.latest import latest_step
from ...log.manifest import load_manifest
from ...storage.orphans import wait_for_orphaned_writer
from ...torchmeta.numerics import PORTABLE, Numerics, continued, vml_name
from ..core import numerics as N
from ..core import schema as L
from ..core.registry import RestoreInfo
from ..core.tensors import ModelEntries, tag_of
from .bases.slices import plan_slices
from .layout import Layout
from .options import CheckpointerOptions
from .process_sink import ProcessSink
from .sink import LogSink, Sink, manifest_exists

_log = logging.getLogger(__name__)


def make_log_meta(options: CheckpointerOptions, optimizer: torch.optim.Optimizer,
                  names: list[str], params: Sequence[torch.Tensor], entries: ModelEntries,
                  *, compressor: Any, scheduler: Any, scaler: Any,
                  snapshot_every: int, layout: Layout | None = None) -> dict[str, Any]:
    """The ``torch`` metadata of a log of every parameter ``names`` of ``optimizer`` and
    every tensor of the model (``entries``), written in ``layout``; with ``base_slices``,
    whether its bases are streamed (:func:`~.bases.slices.plan_slices`, with
    :meth:`Layout.streamed_why`)."""
    comp = None
    if compressor is not None:
        comp = {**compressor.config(), "ef_state": options.ef_state}
    meta = {
        "schema": L.SCHEMA,
        "mode": options.mode,
        "capture": options.capture,
        "optimizer": L.class_name(optimizer),
        "params": names,
        "groups": [len(g["params"]) for g in optimizer.param_groups],
        "model": [[n, tag_of(t, n), list(t.shape)] for n, t in entries.tensors.items()],
        "buffers": list(entries.buffers),
        "aliases": entries.aliases,
        "state_dict": entries.order,
        "compressor": comp,
        "grad_codec": compressor.grad_codec if compressor is not None else "raw",
        "grad_zstd": options.grad_zstd,
        "delta_codec": options.delta_codec if options.mode == "delta" else None,
        "digest_every": options.digest_every,
        "snapshot_every": snapshot_every,
        "scheduler": L.class_name(scheduler) if scheduler is not None else None,
        "scaler": L.class_name(scaler) if scaler is not None else None,
        "torch_version": torch.__version__,
        "device": params[0].device.type if params else "cpu",
        # what replay's bits depend on, per run of the writer (resume_point appends)
        "numerics": [run_numerics(options, optimizer, params, comp).as_record(0)],
    }
    plan_slices(meta, options, layout.streamed_why() if layout is not None else None)
    return meta


def run_numerics(options: CheckpointerOptions, optimizer: torch.optim.Optimizer,
                 params: Sequence[torch.Tensor], comp: Mapping[str, Any] | None
                 ) -> Numerics:
    """This run's numerics with what of its log's replay reaches MKL; where something does
    (a CPU optimizer's ``sqrt``, a compressor's matrix products), said once, with the
    path whose logs replay on every x86-64 vendor."""
    here = N.current(params[0].device if params else "cpu")
    use = N.run_mkl_use(optimizer, params, compressor=comp["kind"] if comp else None,
                        mode=options.mode, optimizer_name=L.class_name(optimizer))
    if use is not None:
        _log.warning("lowdiff-store: this log replays bitwise only on %s CPUs under MKL's "
                     "%s branch: its replay reaches MKL (%s); %s", here.vendor or "such",
                     vml_name(here.mkl_vml) if here.mkl_vml is not None else "no",
                     use, PORTABLE)
    return dataclasses.replace(here, mkl_use=use)


def resume_point(path: str, meta: dict[str, Any], params: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer, info: RestoreInfo | None,
                 layout: Layout) -> tuple[int, bool, bool, bool]:
    """``(step, base_now, existed, start_over)``: the step the objects hold, whether a base
    of it must be written first (step 0, a restore that was not exact, or a run whose
    numerics differ from the log's last run: no replay spans two numerics), whether ``path``
    already held a log, and whether that log is to be started over: a leftover of a stopped
    job setup (:func:`setup_leftover`), or records of this run with no base (it crashed
    before its first base was published, so ``latest_step`` is None and a script starts
    afresh: nothing of it was durable). An existing log with records must be the one ``info``
    restored, with the same metadata, into objects untouched since (their digest).
    ``meta["numerics"]`` of a continued log becomes the log's runs up to that step and this
    run after it. A writer process whose trainer died is waited for first (it is still
    making the steps it was handed durable)."""
    wait_for_orphaned_writer(path)
    if setup_leftover(path, meta, info, layout.unpublished):
        return 0, True, True, True
    if not manifest_exists(path):
        return 0, True, False, False
    with LogReader(path) as r:
        log_id, last, bases = r.log_id, r.last_step, list(r.bases)
        old = r.meta.get("torch")
    if last is None or last < 0:
        return 0, True, True, False
    if not bases and info is None:  # a run that crashed before its first base was
        check_compatible(path, meta, old)  # published: nothing in it was ever durable
        _log.warning("lowdiff-store: %s holds records up to step %d but no base (the run "
                     "crashed before its first base was published; nothing in it was "
                     "durable): starting it over", path, last)
        return 0, True, True, True
    if not bases:
        raise ConfigError(
            f"{path} holds records up to step {last} but no base (the run crashed before "
            f"its first base was published): nothing can be restored from it; remove it or "
            f"use another directory", reason=Reason.NO_BASE, path=path)
    check_compatible(path, meta, old)
    if info is None or info.log_id != log_id:
        raise ConfigError(
            f"{path} already holds a log up to step {last}: call restore(path, model, "
            f"optimizer, ...) first to continue it, or use an empty directory",
            reason=Reason.HISTORY_CONFLICT, path=path)
    if L.digest_objects(params, optimizer) != info.digest:
        raise ConfigError(f"model/optimizer changed since restore() put step {info.step} "
                          f"into them", reason=Reason.STATE_MISMATCH, path=path)
    meta["numerics"] = continued(old.get("numerics") if isinstance(old, dict) else None,
                                 meta["numerics"][-1], info.step + 1)
    # a run under other numerics than the log's last (or a log that recorded none) starts
    # with a base, so that no replay spans two numerics
    new_run = meta["numerics"][-1]["from_step"] == info.step + 1
    return info.step, not info.exact or new_run, True, False


def unpublished_job(root: str, path: str) -> bool:
    """``Layout.unpublished`` of the rank whose log is ``path`` in the job at ``root``: no
    step is durable on every rank (``latest_step(root)`` is None: no ``SHARDS``, or a rank
    without a log or a base), so no restore can continue the job and
    ``restore(..., missing_ok=True)`` tells a script to start afresh. A layout of several
    ranks reads it before its first agreement, when no rank of this open has written its
    log yet. The other ranks' logs are read only when this rank's log holds nothing but
    its step-0 base (the only log :func:`setup_leftover` starts over); otherwise False."""
    return _base0_only(path)[0] and latest_step(root) is None


def setup_leftover(path: str, meta: Mapping[str, Any], info: RestoreInfo | None,
                   unpublished: bool) -> bool:
    """Whether the log at ``path`` is a leftover of a job setup that was stopped: the job
    was never published (``unpublished``, see ``Layout.unpublished``: nothing can restore
    it), nothing was restored into the objects, and the log holds only its step-0 base (a
    rank that opened its log while another died before opening its own: docs/failures.md,
    "Round 5 (issue 42): leftovers", "Round 6 (issue 48): rank 0 killed after SHARDS").
    Such a log of the same run (else the refusal of :func:`check_compatible`) is started
    over from the live objects (``open_sink(..., start_over=True)``); anything holding a
    later step is never discarded here."""
    if not unpublished or info is not None:
        return False
    only, old = _base0_only(path)
    if not only:
        return False
    check_compatible(path, meta, old)
    return True


def _base0_only(path: str) -> tuple[bool, Any]:
    """Whether the log at ``path`` exists and holds only its step-0 base; its torch
    metadata. A log with another base is told by its manifest alone (its segments are
    not opened: every open of a layout of several ranks asks this)."""
    if not manifest_exists(path) or load_manifest(path).bases != [0]:
        return False, None
    with LogReader(path) as r:
        return (r.last_step == 0 and list(r.bases) == [0]), r.meta.get("torch")


def open_sink(path: str, meta: dict[str, Any], options: CheckpointerOptions, batch: int,
              step: int, existed: bool, *, start_over: bool = False) -> LogSink:
    """The writer of the log at ``path`` for objects holding ``step``: later steps of an
    existing log are discarded with ``resume="truncate"``, refused otherwise
    (``ConfigError(history_conflict)``); ``start_over`` (see :func:`resume_point`): every
    record and base is discarded (crash-safe: the manifest is swapped first), so base 0
    is written again from the objects; the log's metadata becomes ``meta``."""
    sink: LogSink
    holds = existed or start_over  # (else resume_point found no manifest: a new log)
    if writer_in_process(options.writer_process, meta["device"]):
        sink = ProcessSink(path, meta={"torch": meta}, batch=batch, options=options.writer,
                           ring_bytes=options.ring_bytes, existed=holds,
                           nice=options.writer_nice)
    else:
        sink = Sink(path, meta={"torch": meta}, batch=batch, options=options.writer)
    try:
        if start_over:
            sink.truncate_after(-1)
        if holds and sink.last_step > step:
            if options.resume != "truncate":
                raise ConfigError(
                    f"the objects hold step {step} but the log goes on to step "
                    f"{sink.last_step}: training now would mix two histories. Pass "
                    f"resume='truncate' to discard steps {step + 1}..{sink.last_step}",
                    reason=Reason.HISTORY_CONFLICT, path=path)
            sink.truncate_after(step)
        if existed:
            sink.update_meta({"torch": meta})
    except BaseException:
        sink.close_quietly()
        raise
    return sink


def writer_in_process(option: bool | str, device: str) -> bool:
    """Whether the log is written by a writer process: ``writer_process`` when it is True or
    False; for ``"auto"`` (the default), whether the logged parameters are on CUDA
    (``device``: their device type, as the log's metadata records it). The measurements
    behind the rule (docs/torch.md, "The writer as a process"): a launch-bound training
    thread on a GPU loses to the writer's Python holding the GIL (H100, 940M: top-1% + log
    / top-1% alone 1.16-1.22 in-thread); on CPU the in-thread writer measured as well or better
    (dense: it takes the dropped gradients with no copy, where the process copies each
    step into the ring; top-k: inside the noise)."""
    return device == "cuda" if option == "auto" else bool(option)


def check_compatible(path: str, meta: Mapping[str, Any], old: Any) -> None:
    """The log's torch metadata ``old`` describes the same run as ``meta``."""
    if not isinstance(old, dict):
        raise ConfigError(f"{path} is not a log written by DiffCheckpointer",
                          reason=Reason.STATE_MISMATCH, path=path)
    for key in ("mode", "optimizer", "params", "groups", "model", "compressor"):
        mine = meta[key]
        theirs = old.get(key)
        if key == "optimizer" and isinstance(theirs, str):
            theirs = L.current_class_name(theirs)
        if theirs != mine:
            raise ConfigError(f"the log's {key} ({_short(theirs)}) differs from this "
                              f"run's ({_short(mine)})", reason=Reason.STATE_MISMATCH,
                              path=path)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


__all__ = ["check_compatible", "make_log_meta", "open_sink", "resume_point", "setup_leftover",
           "unpublished_job", "writer_in_process"]
