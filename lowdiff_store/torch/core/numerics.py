"""The process's numerics, what of a log's replay reaches MKL, and MKL's branch pinned for
a replay.

What a grad-mode replay's bits depend on, and why, is written in
:mod:`lowdiff_store.torchmeta.numerics` (torch-free: the record, the table of what reaches
MKL, the comparison). Here: :func:`current` reads the process's numerics and
:func:`run_mkl_use` what of a checkpointer's replay will reach MKL (both recorded by every
checkpointer run), and :func:`prepare_replay` makes a replay run under the numerics its log
was trained under, or says before it starts why it cannot. It pins MKL's vector-math branch
to the log's where MKL has not run yet in the process and the log was trained on this CPU's
vendor (MKL's bits on one vendor are reproduced by no setting on another), and refuses
(``numerics_mismatch``) what cannot be changed in a running process (another vendor's MKL
bits, MKL's branch once it ran, ATen's kernel capability, the device type).

MKL is reached through its own entry points in torch's CPU library (``mkl_serv_cbwr_*``,
MKL's Conditional Numerical Reproducibility, and ``mkl_vml_serv_cpu_detect``); a torch
without MKL (ARM, macOS) has no such branch and nothing is pinned.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Sequence

import torch

from ...errors import Reason, ReplayError
from ...torchmeta.numerics import (
    VENDORS,
    Mismatch,
    Numerics,
    NumericsRun,
    compare,
    mkl_use,
    needed_vml,
    runs_between,
    vml_name,
)
from .tensors import TAG_OF

#: ``mkl_cbwr_get``'s argument asking for the branch setting
_CBWR_BRANCH = 1
#: the MKL CNR setting under which VML runs branch code D (``MKL_CBWR=COMPATIBLE`` for 0)
_CBWR_FOR: dict[int, int] = {0: 3, 2: 9, 3: 10, 5: 12}
#: the CNR settings that leave the branch to MKL: not set (0, 1) and ``MKL_CBWR=AUTO`` (2)
_CBWR_AUTO = (0, 1, 2)
#: the VML branch a CNR setting (or MKL's automatic choice, ``mkl_serv_cbwr_get_auto_branch``)
#: gives: 2 is the automatic choice on a CPU MKL does not tune for (AMD: generic), 14 an
#: Intel AVX-512 CPU's; 8 is ``MKL_CBWR=SSE4_2`` or ``AVX`` (measured on an Intel Xeon)
_VML_OF: dict[int, int] = {2: 0, 3: 0, 8: 2, 9: 2, 10: 3, 12: 5, 14: 5}
_ENTRY_POINTS = ("mkl_vml_serv_cpu_detect", "mkl_serv_cbwr_set", "mkl_serv_cbwr_get",
                 "mkl_serv_cbwr_get_auto_branch")


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's CPU library with MKL's entry points, or None (no MKL, or not found)."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        for name in _ENTRY_POINTS:
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
    lib.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
    return lib


def mkl_vml_branch() -> int | None:
    """The vector-math branch MKL runs in this process (None: no MKL). Asking makes MKL
    initialize: its branch can no longer be changed afterwards."""
    lib = _mkl()
    return None if lib is None else int(lib.mkl_vml_serv_cpu_detect())


def planned_vml_branch() -> int | None:
    """The branch MKL will run, asked without initializing it (None: not known)."""
    lib = _mkl()
    if lib is None:
        return None
    setting = int(lib.mkl_serv_cbwr_get(_CBWR_BRANCH))
    if setting in _CBWR_AUTO:  # MKL's own choice for this CPU
        setting = int(lib.mkl_serv_cbwr_get_auto_branch())
    return _VML_OF.get(setting)


def pin_mkl(branch: int) -> bool:
    """Make MKL run its vector-math ``branch`` in this process; True when it does.

    Possible until MKL first runs (any matrix product or float ``sqrt`` on CPU), and only
    for a branch the CPU may run (Intel's branches need an Intel CPU). A process already on
    ``branch`` is left alone: pinning when it is not needed would also move MKL's matrix
    products to another code path, which may be slower. A branch's bits belong to the CPU
    vendor they were measured on: pinning an AMD log's generic branch on an Intel CPU gives
    Intel's generic bits, not AMD's (:func:`prepare_replay` pins only on the log's
    vendor)."""
    lib = _mkl()
    if lib is None:
        return False
    if planned_vml_branch() != branch and branch in _CBWR_FOR:
        lib.mkl_serv_cbwr_set(_CBWR_FOR[branch])  # fails once MKL ran: checked below
    return mkl_vml_branch() == branch


@functools.cache
def _cpu_ids() -> tuple[str | None, str | None]:
    """(vendor, model name) of the CPU, from ``/proc/cpuinfo`` where there is one."""
    vendor = model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and vendor is None:
                    vendor = val.strip()[:256]
                elif key == "model name" and model is None:
                    model = val.strip()[:256]
                if vendor and model:
                    break
    except OSError:
        pass
    return vendor, model or (platform.processor()[:256] or None)


def current(device: torch.device | str = "cpu") -> Numerics:
    """The numerics of this process for an optimizer on ``device``. Reads MKL's branch
    (which initializes MKL: call :func:`prepare_replay` or :func:`pin_mkl` first where a
    pin is wanted)."""
    dev = torch.device(device)
    vendor, model = _cpu_ids()
    gpu = cc = cuda = None
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        gpu = torch.cuda.get_device_name(idx)
        cc = tuple(torch.cuda.get_device_capability(idx))
        cuda = torch.version.cuda
    return Numerics(
        device=dev.type, torch=torch.__version__,
        torch_git=getattr(torch.version, "git_version", None) or None,
        cpu_vendor=vendor, cpu_model=model,
        aten_cpu=torch.backends.cpu.get_cpu_capability(), mkl_vml=mkl_vml_branch(),
        gpu=gpu, gpu_cc=None if cc is None else (int(cc[0]), int(cc[1])), cuda=cuda)


def cpu_vendor() -> str | None:
    """This CPU's vendor, as :attr:`Numerics.vendor` names it (``"Intel"``, ``"AMD"``)."""
    vendor = _cpu_ids()[0]
    return None if vendor is None else VENDORS.get(vendor, vendor)


def implementation(group: dict[str, object]) -> str:
    """Which implementation of ``torch.optim`` a param group's step runs on CPU:
    ``"fused"``, ``"foreach"`` or ``"single"`` (``foreach=None`` is the single-tensor loop
    on CPU tensors)."""
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") \
        else "single"


def run_mkl_use(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
                compressor: str | None, mode: str, optimizer_name: str) -> str | None:
    """What of the replay of a log written by this run reaches MKL (None: nothing), from
    the optimizer's implementation per group and the trained parameters' dtypes
    (:func:`lowdiff_store.torchmeta.numerics.mkl_use`). Only CPU optimizers reach it."""
    if not params or params[0].device.type != "cpu":
        return None
    tags = {TAG_OF.get(p.dtype, str(p.dtype)) for p in params}
    return mkl_use(optimizer_name, [implementation(g) for g in optimizer.param_groups],
                   tags, compressor, mode)


def prepare_replay(runs: Sequence[NumericsRun], first: int, last: int,
                   device: torch.device | str, *, verify: bool, path: str | None
                   ) -> tuple[list[str], bool]:
    """Before a grad-mode replay of steps ``first..last`` on ``device``: pin MKL to the
    branch those steps were trained under where it can still be pinned, then compare.

    Returns ``(notes, exact)``: the remarks for the result and whether the replayed state
    can be bitwise. A difference known to change the bits raises
    ``ReplayError(numerics_mismatch)`` naming it and its remedy when ``verify`` (the
    replay would only fail later, after the work, at its first digest); without
    ``verify`` the replay goes on and ``exact`` is False. Logs of earlier versions record
    no numerics: nothing is checked (the digests still are)."""
    mine = runs_between(runs, first, last)
    if not mine:
        return [], True
    notes: list[str] = []
    dev = torch.device(device)
    need = needed_vml(mine, cpu_vendor()) if dev.type == "cpu" else set()
    if len(need) == 1:
        (branch,) = need
        if planned_vml_branch() != branch and pin_mkl(branch):
            notes.append(f"MKL's vector math was pinned to its {vml_name(branch)} branch, "
                         f"as the log was trained (MKL_CBWR): the process keeps it")
    here = current(dev)
    seen: dict[tuple[str, str], Mismatch] = {}
    for r in mine:
        for m in compare(r.numerics, here):
            seen.setdefault((m.what, m.recorded), m)
    blocking = [m for m in seen.values() if m.changes_bits]
    notes += [f"numerics differ: {m.line()}" for m in seen.values() if not m.changes_bits]
    if not blocking:
        return notes, True
    what = "; ".join(m.line() for m in blocking)
    if verify:
        raise ReplayError(
            f"the log was trained where replay gives other bits than here ({what}); or "
            f"replay with verify=False for a state that is not bitwise",
            reason=Reason.NUMERICS_MISMATCH, path=path)
    notes.append(f"not bitwise: the log was trained where replay gives other bits ({what})")
    return notes, False


__all__ = ["cpu_vendor", "current", "implementation", "mkl_vml_branch", "pin_mkl",
           "planned_vml_branch", "prepare_replay", "run_mkl_use"]
