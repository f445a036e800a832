"""What the bits of a grad-mode replay depend on besides the log: the machine's numerics.

Replay runs the training's optimizer on the logged gradients, so it gives training's bits
only where the ops it runs give the same bits as training's did. On CPU, measured with
``shared/tools/cpu_bits.py`` on an Intel Xeon and an AMD EPYC (docs/torch.md "Exactness
across machines"), that is decided by:

- **MKL, where the replay reaches it.** torch's CPU ``sqrt`` (and ``exp``, ``log``,
  ``tanh``, ``erf`` on float32/float64) is MKL's vector math (VML), and its matrix products
  are MKL's BLAS. Both run a code path MKL picks by CPU vendor and ``MKL_CBWR``, and the
  paths give other bits: ``sqrt`` is correctly rounded only on Intel's AVX2 branch; MKL's
  generic branch gives other bits on AMD than on Intel, and no MKL setting on one vendor
  reproduces the other's. So MKL's bits belong to a (vendor, branch) pair. Whether a
  replay reaches MKL depends on the optimizer's implementation (:func:`mkl_use`): AdamW's
  single-tensor and foreach steps call ``sqrt``; ``fused=True`` runs ATen's own vector
  code (a correctly rounded ``sqrt``, as every x86-64 CPU's ``sqrtps`` gives); SGD,
  Adamax, ASGD and Rprop call none of it; delta mode runs no optimizer. A log whose replay
  never reaches MKL is not bound to a vendor or branch.
- **ATen's CPU kernel capability** (``DEFAULT``, ``AVX2``, ``AVX512``, ...): the scalar
  ``DEFAULT`` kernels give other bits than the vector ones for every optimizer (lerp,
  addcdiv, a scalar multiply); ``AVX2`` and ``AVX512`` gave the same bits for every
  optimizer, the gradient-norm reduction and GradScaler's unscale in torch 2.13. It is
  fixed for a process at its first kernel (``ATEN_CPU_CAPABILITY``).
- **The torch build**: another build may change any kernel.

On CUDA the kernels are torch's own; the GPU model and the CUDA version are recorded and a
difference is reported, not refused (the digests check the result).

A log records them per run of its writer (``meta.torch.numerics``, format_spec
"torch metadata"), with what of its replay reaches MKL (``mkl_use``): a run that continues
the log on another machine appends one entry from its first step, and starts with a base,
so that no replay spans two numerics. This module parses the record (:func:`parse_runs`),
says what reaches MKL (:func:`mkl_use`) and compares a run with the process
(:func:`compare`); it imports neither torch nor numpy. The torch side, which reads the
process's numerics and pins MKL's branch where that is possible, is
:mod:`lowdiff_store.torch.core.numerics`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import checks as C
from .checks import Ctx, short

#: MKL's VML branch codes (``mkl_vml_serv_cpu_detect``) and what each is, where known.
VML_BRANCHES: dict[int, str] = {
    0: "generic (MKL's compatible branch; every AMD CPU)",
    1: "SSE4.2",
    2: "AVX",
    3: "AVX2",
    4: "AVX-512 (Xeon Phi)",
    5: "AVX-512 (Intel)",
}
#: the ``MKL_CBWR`` value under which MKL runs VML branch code D on a CPU that has it
CBWR_NAMES: dict[int, str] = {0: "COMPATIBLE", 2: "AVX", 3: "AVX2", 5: "AVX512"}
#: ATen CPU capabilities whose kernels gave the same bits for every replayed op measured
#: (torch 2.13: AdamW/Adam/SGD/RMSprop/Adagrad steps, the gradient norm, AMP unscale)
SAME_BITS: tuple[frozenset[str], ...] = (frozenset({"AVX2", "AVX512"}),)
#: CPU vendor ids (``/proc/cpuinfo``) and the names messages use
VENDORS: dict[str, str] = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}

#: ``torch.optim`` classes whose CPU step calls ``sqrt`` on its float32/float64 state (MKL's
#: vector math) unless the group is ``fused`` (measured per implementation and dtype by
#: tests/torch/test_mkl_paths.py, on every class of the replay's allow-list)
VML_STEPS = frozenset({"Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adadelta"})
#: ``torch.optim`` classes whose CPU step reaches no MKL op in any implementation
NO_MKL_STEPS = frozenset({"SGD", "Adamax", "ASGD", "Rprop"})
#: compressors whose decode at replay runs matrix products (MKL's BLAS): DeMo's DCT
GEMM_COMPRESSORS = frozenset({"demo"})
#: the dtype tags whose CPU ``sqrt`` is MKL's (float16/bfloat16 run ATen's own vector code)
VML_DTYPES = frozenset({"F32", "F64"})
#: ``mkl_use`` of a run recorded before the record said (a log of round 5): assumed to
#: reach MKL when its optimizer may
UNRECORDED = "not recorded by the writer of this run"


@dataclass(frozen=True)
class Numerics:
    """The numerics of one process (or of one run of a log's writer).

    Attributes:
        device: the device type the optimizer ran on (``"cpu"``, ``"cuda"``, ...).
        torch: ``torch.__version__``; ``torch_git``: the build's commit, where known.
        cpu_vendor, cpu_model: the CPU (``/proc/cpuinfo``), where known.
        aten_cpu: ATen's CPU kernel capability (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``).
        mkl_vml: MKL's vector-math branch code (:data:`VML_BRANCHES`); None where torch has
            no MKL (or its entry points are not found).
        gpu, gpu_cc, cuda: the GPU's name and compute capability and the CUDA version
            (CUDA runs only).
        mkl_use: of a log's run, what of its replay reaches MKL (:func:`mkl_use`), None
            where nothing does (its bits then depend on neither MKL's branch nor the CPU
            vendor); :data:`UNRECORDED`-led text for a run recorded before the record said.
            None for a process.
    """

    device: str
    torch: str
    torch_git: str | None = None
    cpu_vendor: str | None = None
    cpu_model: str | None = None
    aten_cpu: str | None = None
    mkl_vml: int | None = None
    gpu: str | None = None
    gpu_cc: tuple[int, int] | None = None
    cuda: str | None = None
    mkl_use: str | None = None

    def as_record(self, from_step: int) -> dict[str, Any]:
        """The map a log records for a run whose first step is ``from_step``."""
        return {"from_step": from_step, "device": self.device, "torch": self.torch,
                "torch_git": self.torch_git, "cpu_vendor": self.cpu_vendor,
                "cpu_model": self.cpu_model, "aten_cpu": self.aten_cpu,
                "mkl_vml": self.mkl_vml, "gpu": self.gpu,
                "gpu_cc": None if self.gpu_cc is None else list(self.gpu_cc),
                "cuda": self.cuda, "mkl_use": self.mkl_use}

    @property
    def vendor(self) -> str | None:
        """The CPU vendor's short name (``"Intel"``, ``"AMD"``, or the id as read)."""
        return None if self.cpu_vendor is None else VENDORS.get(self.cpu_vendor,
                                                                 self.cpu_vendor)

    def where(self) -> str:
        """A short description for messages: ``cpu (AMD EPYC, AVX512, MKL generic)``."""
        if self.device != "cpu":
            return f"{self.device} ({self.gpu or 'unknown model'})"
        parts = [p for p in (self.cpu_model or self.cpu_vendor, self.aten_cpu) if p]
        if self.mkl_vml is not None:
            parts.append(f"MKL {vml_name(self.mkl_vml)}")
        return f"cpu ({', '.join(parts)})" if parts else "cpu"


@dataclass(frozen=True)
class NumericsRun:
    """One entry of a log's numerics record: the steps from ``from_step`` on (to the next
    entry's) were trained under ``numerics``."""

    from_step: int
    numerics: Numerics


@dataclass(frozen=True)
class Mismatch:
    """One way this process's numerics differ from a run's.

    Attributes:
        what: ``"device"``, ``"aten_cpu"``, ``"cpu_vendor"``, ``"mkl_vml"``, ``"torch"``
            or ``"gpu"``.
        recorded, here: the two values, as text.
        changes_bits: the difference is known to change the replayed bits (a replay checking
            digests is refused before it starts); False: it may (reported, digests decide).
        remedy: what makes the replay exact here, or where it can be.
    """

    what: str
    recorded: str
    here: str
    changes_bits: bool
    remedy: str

    def line(self) -> str:
        """One sentence naming the difference and its remedy."""
        return f"{self.what} {self.recorded} (log) vs {self.here} (here): {self.remedy}"


def vml_name(code: int) -> str:
    """The name of MKL's VML branch ``code``."""
    return VML_BRANCHES.get(code, f"branch {code}").split(" (")[0]


def mkl_use(optimizer: str, impls: Iterable[str] | None, dtypes: Iterable[str],
            compressor: str | None, mode: str) -> str | None:
    """What of a grad-mode replay reaches MKL, as text for messages; None where nothing does.

    ``optimizer``: the optimizer's qualified class name; ``impls``: the implementation of
    each param group (``"fused"``, ``"foreach"`` or ``"single"``; None: not known);
    ``dtypes``: the format's dtype tags of the trained parameters (``"F32"``, ``"BF16"``,
    ...); ``compressor``: the gradient compressor's kind; ``mode``: the log's mode (a
    delta-mode replay runs no optimizer). An optimizer outside the measured table
    (:data:`VML_STEPS`, :data:`NO_MKL_STEPS`) is assumed to reach MKL, so that a replay is
    never promised bits it may not give."""
    if mode != "grad":
        return None
    out = []
    if compressor in GEMM_COMPRESSORS:
        out.append(f"matrix products in the {compressor} compressor's decode (MKL BLAS)")
    module, _, name = optimizer.rpartition(".")
    if not module.startswith("torch.optim") or name not in VML_STEPS | NO_MKL_STEPS:
        out.append(f"{optimizer}'s step (not measured: assumed to)")
    elif name in VML_STEPS and not VML_DTYPES.isdisjoint(dtypes):
        if impls is None:
            out.append(f"sqrt in {name}'s step unless fused (MKL vector math; the "
                       f"implementation is {UNRECORDED})")
        elif slow := sorted(set(impls) - {"fused"}):
            out.append(f"sqrt in {name}'s {'/'.join(slow)} step (MKL vector math)")
    return "; ".join(out) or None


def parse_runs(c: Ctx, raw: Any, default_use: str | None = None
               ) -> tuple[NumericsRun, ...]:
    """A log's ``numerics`` record (absent in logs of earlier versions: empty), checked:
    a list of maps with strictly increasing ``from_step``; strings, small ints, a compute
    capability pair. One ``bad_metadata`` naming the entry otherwise. A run without
    ``mkl_use`` (recorded before it was) takes ``default_use``: what the log's optimizer
    may reach (:func:`mkl_use` without the implementation)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 1 << 16:
        raise c.fail(f"numerics {short(raw)} must be a list of runs")
    runs: list[NumericsRun] = []
    for i, e in enumerate(raw):
        what = f"numerics[{i}]"
        if not isinstance(e, dict):
            raise c.fail(f"{what} must be a map")
        C.integer(c, e.get("from_step"), f"{what}.from_step", 0, C.MAX_INT)
        if runs and e["from_step"] <= runs[-1].from_step:
            raise c.fail(f"{what}.from_step {e['from_step']} does not follow "
                         f"{runs[-1].from_step}")
        C.string(c, e.get("device"), f"{what}.device")
        C.string(c, e.get("torch"), f"{what}.torch")
        for k in ("torch_git", "cpu_vendor", "cpu_model", "aten_cpu", "gpu", "cuda",
                  "mkl_use"):
            C.string(c, e.get(k), f"{what}.{k}", none=True)
        C.integer(c, e.get("mkl_vml"), f"{what}.mkl_vml", 0, 1 << 16, none=True)
        cc = e.get("gpu_cc")
        if cc is not None and not (isinstance(cc, list) and len(cc) == 2 and all(
                type(x) is int and 0 <= x < 1 << 16 for x in cc)):
            raise c.fail(f"{what}.gpu_cc {short(cc)} must be [major, minor] or nil")
        runs.append(NumericsRun(e["from_step"], Numerics(
            device=e["device"], torch=e["torch"], torch_git=e.get("torch_git"),
            cpu_vendor=e.get("cpu_vendor"), cpu_model=e.get("cpu_model"),
            aten_cpu=e.get("aten_cpu"), mkl_vml=e.get("mkl_vml"), gpu=e.get("gpu"),
            gpu_cc=None if cc is None else (cc[0], cc[1]), cuda=e.get("cuda"),
            mkl_use=e["mkl_use"] if "mkl_use" in e else default_use)))
    return tuple(runs)


def continued(old: Any, mine: Mapping[str, Any], from_step: int) -> list[dict[str, Any]]:
    """The record of a log whose runs so far are ``old`` (as recorded; None for a log of an
    earlier version), continued from ``from_step`` by a run whose record is ``mine``
    (:meth:`Numerics.as_record`): the entries from later steps are dropped (that history is
    being replaced), and ``mine`` is appended from ``from_step`` unless the run before it
    was under the same numerics."""
    kept = [e for e in old if isinstance(e, dict) and isinstance(e.get("from_step"), int)
            and e["from_step"] < from_step] if isinstance(old, list) else []
    entry = {**mine, "from_step": from_step}
    if kept and {**kept[-1], "from_step": from_step} == entry:
        return kept
    return [*kept, entry]


def runs_between(runs: Sequence[NumericsRun], first: int, last: int) -> list[NumericsRun]:
    """The runs that trained steps ``first..last`` (the steps a replay applies)."""
    out = []
    for i, r in enumerate(runs):
        end = runs[i + 1].from_step - 1 if i + 1 < len(runs) else None
        if r.from_step <= last and (end is None or end >= first):
            out.append(r)
    return out


def compare(recorded: Numerics, here: Numerics) -> list[Mismatch]:
    """How ``here`` differs from ``recorded`` in what a grad-mode replay's bits depend on
    (``recorded.mkl_use`` says whether MKL's branch and the CPU vendor are among them)."""
    out: list[Mismatch] = []
    if recorded.device != here.device:
        out.append(Mismatch("device", recorded.device, here.device, True,
                            f"restore on a {recorded.device} device"))
        return out
    if recorded.torch != here.torch or (recorded.torch_git and here.torch_git
                                        and recorded.torch_git != here.torch_git):
        out.append(Mismatch("torch", recorded.torch, here.torch, False,
                            f"another torch build may change kernels; torch=="
                            f"{recorded.torch} gives the log's bits"))
    if recorded.device == "cpu":
        out.extend(_cpu(recorded, here))
    elif recorded.gpu != here.gpu and recorded.gpu is not None:
        out.append(Mismatch("gpu", str(recorded.gpu), str(here.gpu), False,
                            "another GPU model may change kernels"))
    return out


#: what a user wanting logs that replay on any x86-64 CPU does (messages and the warning)
PORTABLE = ("logs whose replay reaches no MKL op (fused=True for Adam, AdamW and Adagrad; "
            "SGD; delta mode) replay on every x86-64 vendor")


def _cpu(recorded: Numerics, here: Numerics) -> Iterable[Mismatch]:
    a, b = recorded.aten_cpu, here.aten_cpu
    if a is not None and b is not None and a != b \
            and not any(a in s and b in s for s in SAME_BITS):
        yield Mismatch("aten_cpu", a, b, True,
                       f"start the process with ATEN_CPU_CAPABILITY={a.lower()} (on a CPU "
                       f"that has it)")
    m, n = recorded.mkl_vml, here.mkl_vml
    if recorded.mkl_use is None or m is None:
        return  # the replay reaches no MKL op (or the writer ran no MKL)
    va, vb = recorded.vendor, here.vendor
    if n is None:
        yield Mismatch("mkl_vml", vml_name(m), "no MKL", True,
                       f"the replay reaches MKL ({recorded.mkl_use}): restore with a torch "
                       f"build that has MKL, on a {va or 'x86-64'} CPU")
    elif va is not None and vb is not None and va != vb:
        yield Mismatch("cpu_vendor", f"{va} (MKL {vml_name(m)})", f"{vb} (MKL "
                       f"{vml_name(n)})", True,
                       f"the replay reaches MKL ({recorded.mkl_use}), whose bits on {va} "
                       f"no MKL setting on {vb} reproduces: restore on an {va} CPU under "
                       f"MKL's {vml_name(m)} branch; {PORTABLE}")
    elif m != n:
        setting = CBWR_NAMES.get(m)
        how = (f"start the process with MKL_CBWR={setting}, or call "
               f"lowdiff_store.torch.pin_numerics(path) before torch runs any op"
               if setting else f"restore where MKL runs its {vml_name(m)} branch")
        yield Mismatch("mkl_vml", vml_name(m), vml_name(n), True,
                       f"the replay reaches MKL ({recorded.mkl_use}): {how}")


def needed_vml(runs: Sequence[NumericsRun], vendor: str | None) -> set[int]:
    """The MKL branches that the CPU runs ``runs`` whose replay reaches MKL trained under
    on this CPU's ``vendor`` (a branch of another vendor cannot be pinned to its bits)."""
    return {r.numerics.mkl_vml for r in runs
            if r.numerics.device == "cpu" and r.numerics.mkl_vml is not None
            and r.numerics.mkl_use is not None
            and (r.numerics.vendor is None or vendor is None or r.numerics.vendor == vendor)}


def describe_runs(runs: Sequence[NumericsRun]) -> list[Mapping[str, Any]]:
    """The runs as maps (``describe_log``, ``inspect``)."""
    return [r.numerics.as_record(r.from_step) for r in runs]


__all__ = ["CBWR_NAMES", "GEMM_COMPRESSORS", "NO_MKL_STEPS", "PORTABLE", "SAME_BITS",
           "UNRECORDED", "VENDORS", "VML_BRANCHES", "VML_DTYPES", "VML_STEPS", "Mismatch",
           "Numerics", "NumericsRun", "compare", "continued", "describe_runs", "mkl_use",
           "needed_vml", "parse_runs", "runs_between", "vml_name"]
