"""The numerics record of a log (``meta.torch.numerics``, torch-free): parsed and checked,
continued by a later run, and compared with a process's numerics (which differences refuse
a replay, which are only reported). The processes themselves: tests/torch/test_numerics.py."""

from __future__ import annotations

from typing import Any

import pytest

from lowdiff_store.errors import FormatError
from lowdiff_store.torchmeta.checks import Ctx
from lowdiff_store.torchmeta.numerics import (
    UNRECORDED,
    Numerics,
    NumericsRun,
    compare,
    continued,
    mkl_use,
    parse_runs,
    runs_between,
)

AMD = Numerics(device="cpu", torch="2.13.0+cpu", torch_git="cf30", cpu_vendor="AuthenticAMD",
               cpu_model="AMD EPYC", aten_cpu="AVX512", mkl_vml=0)
INTEL = Numerics(device="cpu", torch="2.13.0+cpu", torch_git="cf30",
                 cpu_vendor="GenuineIntel", cpu_model="Intel Xeon", aten_cpu="AVX512",
                 mkl_vml=5)
#: the same machines writing a log whose replay reaches MKL (foreach AdamW)
AMD_FOREACH = Numerics(**{**AMD.__dict__, "mkl_use": "sqrt in AdamW's foreach step"})
INTEL_FOREACH = Numerics(**{**INTEL.__dict__, "mkl_use": "sqrt in AdamW's foreach step"})
CTX = Ctx("LOG/MANIFEST", None, "meta.torch")


def test_a_record_round_trips() -> None:
    raw = [AMD.as_record(0), INTEL.as_record(7)]
    assert parse_runs(CTX, raw) == (NumericsRun(0, AMD), NumericsRun(7, INTEL))
    assert parse_runs(CTX, None) == ()


@pytest.mark.parametrize(("bad", "says"), [
    ("x", "must be a list"),
    ([1], "numerics[0] must be a map"),
    ([{**AMD.as_record(0), "from_step": -1}], "from_step"),
    ([{**AMD.as_record(0), "from_step": "0"}], "from_step"),
    ([AMD.as_record(3), INTEL.as_record(3)], "does not follow 3"),
    ([{**AMD.as_record(0), "device": 5}], "device"),
    ([{**AMD.as_record(0), "mkl_vml": "0"}], "mkl_vml"),
    ([{**AMD.as_record(0), "mkl_vml": True}], "mkl_vml"),
    ([{**AMD.as_record(0), "gpu_cc": [9]}], "gpu_cc"),
    ([{**AMD.as_record(0), "aten_cpu": ["AVX2"]}], "aten_cpu"),
])
def test_a_bad_record_is_one_line(bad: Any, says: str) -> None:
    with pytest.raises(FormatError) as e:
        parse_runs(CTX, bad)
    assert e.value.reason == "bad_metadata"
    assert says in str(e.value)
    assert str(e.value).startswith("LOG/MANIFEST")


def test_continued_appends_a_run_only_where_numerics_change() -> None:
    one = [AMD.as_record(0)]
    assert continued(one, AMD.as_record(0), 5) == one
    assert continued(one, INTEL.as_record(0), 5) == [AMD.as_record(0), INTEL.as_record(5)]
    # a continuation from an earlier step drops the runs of the replaced history
    two = [AMD.as_record(0), INTEL.as_record(5)]
    assert continued(two, AMD.as_record(0), 3) == [AMD.as_record(0)]
    # a log of an earlier version: the run is recorded from where it starts
    assert continued(None, INTEL.as_record(0), 9) == [INTEL.as_record(9)]


def test_runs_between() -> None:
    runs = (NumericsRun(0, AMD), NumericsRun(5, INTEL))
    assert runs_between(runs, 1, 4) == [runs[0]]
    assert runs_between(runs, 3, 5) == list(runs)
    assert runs_between(runs, 6, 9) == [runs[1]]


def test_compare() -> None:
    assert compare(AMD, AMD) == []
    # a foreach AdamW log: its replay reaches MKL's sqrt, whose bits belong to a vendor
    (m,) = compare(AMD_FOREACH, INTEL)
    assert (m.what, m.changes_bits) == ("cpu_vendor", True)
    assert "restore on an AMD CPU" in m.remedy
    assert "fused=True" in m.remedy
    assert "MKL_CBWR" not in m.remedy, "no MKL setting on Intel gives AMD's bits"
    (m,) = compare(INTEL_FOREACH, AMD)
    assert (m.what, m.changes_bits) == ("cpu_vendor", True)
    # the same vendor under another branch: MKL_CBWR (or a pin) gives the log's bits
    (m,) = compare(INTEL_FOREACH, Numerics(**{**INTEL.__dict__, "mkl_vml": 3}))
    assert (m.what, m.changes_bits) == ("mkl_vml", True)
    assert "MKL_CBWR=AVX512" in m.remedy
    assert "pin_numerics" in m.remedy
    # a log whose replay reaches no MKL op is not bound to a vendor or branch
    assert compare(AMD, INTEL) == []
    assert compare(INTEL, Numerics(**{**INTEL.__dict__, "mkl_vml": 0})) == []
    # AVX2 and AVX512 kernels give the same bits; DEFAULT's do not
    assert compare(AMD, Numerics(**{**AMD.__dict__, "aten_cpu": "AVX2"})) == []
    (m,) = compare(AMD, Numerics(**{**AMD.__dict__, "aten_cpu": "DEFAULT"}))
    assert m.changes_bits
    assert "ATEN_CPU_CAPABILITY=avx512" in m.remedy
    # another torch build or GPU model: reported, not refused
    (m,) = compare(AMD, Numerics(**{**AMD.__dict__, "torch": "2.14.0"}))
    assert (m.what, m.changes_bits) == ("torch", False)
    h100 = Numerics(device="cuda", torch="2.13.0", gpu="NVIDIA H100", gpu_cc=(9, 0))
    (m,) = compare(h100, Numerics(**{**h100.__dict__, "gpu": "NVIDIA A100"}))
    assert (m.what, m.changes_bits) == ("gpu", False)
    (m,) = compare(h100, AMD)
    assert (m.what, m.changes_bits) == ("device", True)


# ---------------------------------------------------------------------- the vendor rule


def _machine(vendor: str, branch: int, cap: str) -> Numerics:
    return Numerics(device="cpu", torch="2.13.0+cpu", cpu_vendor={
        "Intel": "GenuineIntel", "AMD": "AuthenticAMD"}[vendor], aten_cpu=cap,
        mkl_vml=branch)


@pytest.mark.parametrize(("path", "use"), [("adamw_single", "sqrt in AdamW's single step"),
                                           ("adamw_fused", None)])
def test_the_rule_against_both_vendors_measured_bits(path: str, use: str | None) -> None:
    """For every pair of machines measured (tests/helpers/cpu_bits.py ``MEASURED``: an
    Intel Xeon under each MKL branch and an AMD EPYC, each under vector and scalar
    kernels), a log of ``path`` written on one is refused on the other exactly where the
    two gave other bits for that path: a refusal is never needless, a replay never
    diverges."""
    from tests.helpers.cpu_bits import MEASURED

    cap = {"vector": "AVX512", "DEFAULT": "DEFAULT"}
    pairs = 0
    for (va, ba, ca), bits_a in MEASURED.items():
        for (vb, bb, cb), bits_b in MEASURED.items():
            if bits_a[path] is None or bits_b[path] is None:
                continue
            wrote = Numerics(**{**_machine(va, ba, cap[ca]).__dict__, "mkl_use": use})
            refused = any(m.changes_bits for m in compare(wrote, _machine(vb, bb, cap[cb])))
            assert refused == (bits_a[path] != bits_b[path]), ((va, ba, ca), (vb, bb, cb))
            pairs += 1
    assert pairs >= 36


@pytest.mark.parametrize(("optimizer", "impls", "dtypes", "comp", "mode", "reaches"), [
    ("torch.optim.adamw.AdamW", ["single"], {"F32"}, None, "grad", True),
    ("torch.optim.adamw.AdamW", ["foreach"], {"F32"}, None, "grad", True),
    ("torch.optim.adamw.AdamW", ["fused"], {"F32"}, None, "grad", False),
    ("torch.optim.adamw.AdamW", ["fused", "foreach"], {"F32"}, None, "grad", True),
    ("torch.optim.adamw.AdamW", ["single"], {"BF16"}, None, "grad", False),
    ("torch.optim.adamw.AdamW", None, {"F32"}, None, "grad", True),
    ("torch.optim.adamw.AdamW", ["single"], {"F32"}, None, "delta", False),
    ("torch.optim.sgd.SGD", ["single"], {"F32"}, None, "grad", False),
    ("torch.optim.sgd.SGD", None, {"F64"}, None, "grad", False),
    ("torch.optim.sgd.SGD", ["foreach"], {"F32"}, "demo", "grad", True),
    ("torch.optim.rmsprop.RMSprop", ["foreach"], {"F64"}, None, "grad", True),
    ("my.pkg.Lion", ["single"], {"F32"}, None, "grad", True),
])
def test_mkl_use(optimizer: str, impls: list[str] | None, dtypes: set[str],
                 comp: str | None, mode: str, reaches: bool) -> None:
    """The table of what reaches MKL, read as it is applied (measured for every class of
    the replay's allow-list by tests/torch/test_mkl_paths.py); an unknown optimizer, or an
    implementation not recorded, is assumed to."""
    got = mkl_use(optimizer, impls, dtypes, comp, mode)
    assert (got is not None) == reaches, got
    if impls is None and reaches:
        assert UNRECORDED in str(got)


def test_a_run_recorded_before_mkl_use_takes_the_logs_default() -> None:
    raw = [{k: v for k, v in INTEL.as_record(0).items() if k != "mkl_use"}]
    (run,) = parse_runs(CTX, raw, "sqrt in AdamW's step")
    assert run.numerics.mkl_use == "sqrt in AdamW's step"
    (run,) = parse_runs(CTX, [INTEL.as_record(0)], "ignored: the run says")
    assert run.numerics.mkl_use is None
