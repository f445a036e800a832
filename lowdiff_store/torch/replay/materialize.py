"""Bases: what one holds, built the same way from live objects (:class:`DiffCheckpointer`)
and from the log (:func:`materialize_base`, used by compaction and by background bases).

A base at step t holds the full state after step t (docs/torch.md, "Bases"): model tensors
in the log's model order, optimizer state tensors (``@opt/NAME/KEY``, parameters in optimizer
order, keys sorted), RNG states (``@rng/cpu`` then ``@rng/cuda/I`` by device index),
compressor residuals (``@ef/NAME``), and msgpack metadata under ``"torch"``. The order of
tensors and metadata keys is canonical, so a base made from the log is byte for byte the
one the checkpointer writes at the same step (same log id), whatever order the optimizer
created its state in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...log import LogReader
from ...progress import ProgressFn
from ...torchmeta import OptLayout
from ..core import schema as L
from ..core.tensors import bits_view, to_bits
from .engine import Outcome, Replayer, base_hyper, log_meta, target_step
from .restore import OptimizerFactory, blank_objects

#: A base's tensors: name -> (format dtype tag, array of the bits, owned).
BaseTensors = dict[str, tuple[str, np.ndarray]]


def _rng_order(name: str) -> tuple[int, int]:
    if name == L.RNG_CPU:
        return (0, 0)
    tail = name[len(L.RNG_CUDA):]
    return (1, int(tail)) if name.startswith(L.RNG_CUDA) and tail.isdigit() else (2, 0)


def base_arrays(model: Mapping[str, tuple[str, np.ndarray]],
                names: Sequence[str],
                opt_tensors: Mapping[str, Mapping[str, tuple[str, np.ndarray]]],
                opt_values: Mapping[str, Mapping[str, Any]],
                rng: Mapping[str, np.ndarray],
                residuals: Mapping[str, tuple[str, np.ndarray]]
                ) -> tuple[BaseTensors, dict[str, Any]]:
    """The tensors of a base and its optimizer layout (``meta["torch"]["opt"]``), in
    canonical order, from bits already copied out of the state.

    Args:
        model: model tensors (canonical names, the log's model order).
        names: parameter names in optimizer order.
        opt_tensors: per parameter, optimizer state tensors by key.
        opt_values: per parameter, packed non-tensor optimizer state by key.
        rng: RNG states (uint8) by tensor name.
        residuals: error-feedback residuals by parameter name.
    """
    out: BaseTensors = dict(model)
    for n in names:
        st = opt_tensors.get(n)
        if st:
            for key in sorted(st):
                out[L.opt_name(n, key)] = st[key]
    for r in sorted(rng, key=_rng_order):
        out[r] = ("U8", rng[r])
    for n in names:
        if n in residuals:
            out[L.EF + n] = residuals[n]
    layout = {"tensors": {n: sorted(opt_tensors[n]) for n in names if n in opt_tensors},
              "values": {n: dict(sorted(opt_values[n].items())) for n in names
                         if n in opt_values}}
    return out, layout


def live_base_arrays(model: Mapping[str, torch.Tensor], names: Sequence[str],
                     params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                     residuals: Mapping[str, torch.Tensor],
                     rng: Mapping[str, np.ndarray] | None = None, *, copy: bool = True,
                     bits: Callable[[torch.Tensor, str], tuple[str, np.ndarray]] | None = None
                     ) -> tuple[BaseTensors, dict[str, Any]]:
    """:func:`base_arrays` of live objects: a consistent copy of the state now. ``rng``: the
    RNG states to store (default: this process's, now). ``copy=False``: views of CPU
    tensors instead of copies, for objects nobody changes before the base is written (a
    replica). ``bits(tensor, what)``: how each tensor becomes (tag, array), instead (the
    checkpointer's stager, which copies later)."""
    bits_of = bits if bits is not None else to_bits if copy else bits_view
    opt_t: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    opt_v: dict[str, dict[str, Any]] = {}
    for name, prm in zip(names, params, strict=True):
        st = optimizer.state.get(prm)
        if not st:
            continue
        t, v = L.split_state(st, f"optimizer.state[{name!r}]")
        opt_t[name] = {k: bits_of(x, f"{name}/{k}") for k, x in t.items()}
        opt_v[name] = v
    model_bits = {n: bits_of(t, n) for n, t in model.items()}
    res = {n: bits_of(r, n) for n, r in residuals.items()}
    return base_arrays(model_bits, names, opt_t, opt_v, L.rng_states() if rng is None else rng, res)


def base_meta(step: int, *, hyper: Any, sched: Any, scaler: Any, extra: Any,
              opt: Mapping[str, Any], log: Mapping[str, Any],
              ef_approx: bool = False) -> dict[str, Any]:
    """The metadata of a base (``{"torch": {...}}``; values packed as in records)."""
    inner: dict[str, Any] = {"step": step, "hyper": hyper, "sched": sched, "scaler": scaler,
                             "extra": extra, "opt": dict(opt), "log": dict(log)}
    if ef_approx:
        inner["ef_approx"] = True
    return {"torch": inner}


def materialize_base(reader: LogReader, step: int, *, progress: ProgressFn | None = None,
                     verify: bool = True,
                     optimizer_factory: OptimizerFactory | None = None
                     ) -> tuple[BaseTensors, dict[str, Any]]:
    """The base of ``step`` rebuilt from the log: ``(tensors, meta)`` for
    :func:`lowdiff_store.log.base.write_base`, identical to what :class:`DiffCheckpointer`
    writes at that step.

    Replays from the newest base at or before ``step`` on the CPU, like
    :func:`replay_state` (grad mode: through an allow-listed optimizer rebuilt from the
    recorded class, or ``optimizer_factory``; delta mode: applying the diffs), checking
    every recorded digest on the way (``verify``). The caller's RNG state is not changed.

    Error-feedback residuals: exact when the log holds them every step
    (``ef_state="step"``) or ``step`` is already a base. With ``ef_state="base"`` the
    residual at a later step is not in the log; the base then holds what :func:`restore`
    gives at that step (the last base's residual with every entry sent since zeroed) and is
    marked ``ef_approx``, so restoring from it reports ``exact=False`` as restoring from
    the original log does, and every step after it restores to the same bits.

    ``progress(done, total)`` is called as diffs are replayed.
    """
    meta = log_meta(reader)
    step = target_step(reader, step)  # past the newest durable step: refused before any work
    hyper = base_hyper(reader, step, meta)  # checks shapes against the base first
    objs = blank_objects(meta, hyper, optimizer_factory, reader.path)
    replayer = Replayer(reader, meta, objs, verify=verify, progress=progress)
    replayer.apply_rng = False  # the RNG states go into the base, not into this process
    out: Outcome = replayer.run(step)
    fin = out.final
    assert fin is not None
    rng = {n: np.array(a, dtype=np.uint8) for n, a in fin.rng.items()}
    if objs.optimizer is not None:
        # the replica is private to this call: its tensors are written as they are
        tensors, layout = live_base_arrays(objs.model, objs.names, objs.params,
                                           objs.optimizer, out.residuals or {}, rng,
                                           copy=False)
    else:
        tensors, layout = _delta_base_arrays(out.state, fin.layout, objs.names,
                                             [n for n, _t, _s in meta.model], rng)
    approx = not out.result.exact
    bm = base_meta(step, hyper=fin.hyper, sched=fin.sched, scaler=fin.scaler,
                   extra=fin.extra, opt=layout, log=meta.as_written(), ef_approx=approx)
    return tensors, bm


def _delta_base_arrays(state: Mapping[str, tuple[str, np.ndarray]], lay: OptLayout,
                       names: Sequence[str], model: Sequence[str],
                       rng: Mapping[str, np.ndarray]) -> tuple[BaseTensors, dict[str, Any]]:
    """A delta-mode base's tensors and layout from replay's reconstructed ``state``."""
    model_bits = {n: _owned(state[n]) for n in model}
    opt_t = {n: {k: _owned(state[L.opt_name(n, k)]) for k in keys}
             for n, keys in lay.tensors.items()}
    return base_arrays(model_bits, names, opt_t, lay.values, rng, {})


def _owned(entry: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
    tag, arr = entry
    return tag, np.array(arr, copy=True, order="C")


def residual_tensors(names: Sequence[str], params: Sequence[torch.Tensor],
                     residuals: Mapping[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compressor's residuals keyed by parameter name (those it holds)."""
    out: dict[str, torch.Tensor] = {}
    for n, p in zip(names, params, strict=True):
        r = residuals.get(p)
        if r is not None:
            out[n] = r
    return out


__all__ = ["BaseTensors", "base_arrays", "base_meta", "live_base_arrays", "materialize_base",
           "residual_tensors"]
