"""The numerics record of a log (``meta.torch.numerics``, torch-free): parsed and checked,
continued by a later run, and compared with a process's numerics (which differences refuse
a replay, which are only reported). The processes themselves: tests/torch/test_numerics.py."""

from __future__ import annotations

from typing import Any

import pytest

from lowdiff_store.errors import FormatError
from lowdiff_store.torchmeta.checks import Ctx
from lowdiff_store.torchmeta.numerics import (
    Numerics,
    NumericsRun,
    compare,
    continued,
    parse_runs,
    runs_between,
)

AMD = Numerics(device="cpu", torch="2.13.0+cpu", torch_git="cf30", cpu_vendor="AuthenticAMD",
               cpu_model="AMD EPYC", aten_cpu="AVX512", mkl_vml=0)
INTEL = Numerics(device="cpu", torch="2.13.0+cpu", torch_git="cf30",
                 cpu_vendor="GenuineIntel", cpu_model="Intel Xeon", aten_cpu="AVX512",
                 mkl_vml=5)
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
    (m,) = compare(AMD, INTEL)
    assert (m.what, m.changes_bits) == ("mkl_vml", True)
    assert "MKL_CBWR=COMPATIBLE" in m.remedy
    (m,) = compare(INTEL, AMD)
    assert m.changes_bits
    assert "only on an Intel CPU" in m.remedy
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
