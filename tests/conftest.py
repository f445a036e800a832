"""Shared test configuration: hypothesis profiles and the small logs the log-layer tests use.

Hypothesis profiles, chosen with ``HYPOTHESIS_PROFILE`` (default: ``default``):

- ``default``: fast, for a developer's edit-test loop;
- ``ci``: what CI runs: derandomized (a failure reproduces from the seed alone), no example
  database, a few more examples than ``default``; the whole non-slow suite stays fast;
- ``slow``: long campaigns (``make test-slow`` runs the ``@pytest.mark.slow`` tests, which
  also pick up this profile's example count where they do not set their own).
- ``many``: a one-off hunt, not for CI: not derandomized (each run draws new examples), no
  deadline, ``HYPOTHESIS_MANY_EXAMPLES`` examples (default 2000) per test; the codec
  property tests (``tests/codecs/profile.py``) raise their own counts to it. For example
  ``HYPOTHESIS_PROFILE=many pytest tests/codecs``.

Tests that set ``max_examples`` themselves keep it under every profile (the codec property
tests: their count or the profile's, the larger).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.slow_staging import ENV as SLOW_STAGING_ENV
from tests.helpers.slow_staging import slow_staging

settings.register_profile(
    "default", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow", max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "many",
    max_examples=int(os.environ.get("HYPOTHESIS_MANY_EXAMPLES", "2000")),
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# --------------------------------------------------------------------------- small logs


@dataclass
class SmallLog:
    """A closed log with one segment, a base at step 0 and four records of different sizes
    and codecs. ``tensors[step][name]`` are the decoded values (storage dtype) each read
    must return; ``ends[step]`` is the offset in the segment where the record ends."""

    path: Path
    tensors: dict[int, dict[str, np.ndarray]]
    base: dict[str, np.ndarray]
    base_meta: dict[str, Any]
    ends: dict[int, int] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)

    @property
    def segment(self) -> Path:
        return self.path / "seg-0000000000000000.ldlog"

    @property
    def index(self) -> Path:
        return self.path / "seg-0000000000000000.ldidx"

    @property
    def manifest(self) -> Path:
        return self.path / "MANIFEST"

    @property
    def base_file(self) -> Path:
        return self.path / "base-0000000000000000.safetensors"

    def copy_to(self, dst: Path) -> SmallLog:
        """A copy of the log in ``dst`` (which must not exist)."""
        shutil.copytree(self.path, dst)
        return SmallLog(dst, dict(self.tensors), dict(self.base), dict(self.base_meta),
                        dict(self.ends), dict(self.starts))


def build_small_log(path: Path) -> SmallLog:
    """Write the reference log of the corruption tests (deterministic values)."""
    from lowdiff_store import LogReader, LogWriter, tensor_input

    rng = np.random.default_rng(1234)
    base = {"w": rng.standard_normal(10).astype("<f4"),
            "steps": np.arange(3, dtype="<i8")}
    base_meta = {"optimizer": "SGD", "lr": 0.1}
    g1 = rng.standard_normal(7).astype("<f4")
    g2 = np.zeros(100, "<f4")
    g2[[3, 50, 99]] = [1.5, -2.0, 3.25]
    g3 = rng.integers(0, 1000, 300).astype("<i4")
    g4 = rng.integers(0, 0xFFFF, 33).astype("<u2")
    h4 = np.zeros(64, "<f4")
    h4[[0, 7]] = [0.5, -0.25]
    with LogWriter(path, meta={"mode": "grad"}) as w:
        w.write_base(0, {n: (("F32" if a.dtype == np.float32 else "I64"), a)
                         for n, a in base.items()}, meta=base_meta)
        w.append(1, [tensor_input("g", g1, "F32")], kind="grad", side={"lr": 0.1})
        w.append(2, [tensor_input("g", g2, "F32", "sparse")], kind="grad")
        w.append(3, [tensor_input("g", g3, "I32", zstd=3)], kind="grad")
        w.append(4, [tensor_input("g", g4, "BF16"),
                     tensor_input("h", h4, "F32", "sparse", zstd=1)], kind="weight",
                 side={"scale": 65536.0})
        w.sync()
    tensors = {1: {"g": g1}, 2: {"g": g2}, 3: {"g": g3}, 4: {"g": g4, "h": h4}}
    log = SmallLog(path, tensors, base, base_meta)
    with LogReader(path) as r:
        for s in tensors:
            _p, off, ln = r.record_location(s)
            log.starts[s], log.ends[s] = off, off + ln
    return log


@pytest.fixture(scope="session")
def pristine_log(tmp_path_factory: pytest.TempPathFactory) -> SmallLog:
    """The reference log, built once per session. Tests must not modify it: use
    ``small_log`` for a private copy."""
    return build_small_log(tmp_path_factory.mktemp("pristine") / "log")


@pytest.fixture
def small_log(pristine_log: SmallLog, tmp_path: Path) -> SmallLog:
    """A private copy of the reference log."""
    return pristine_log.copy_to(tmp_path / "log")


def read_everything(path: Path | str, log: SmallLog, *, mode: str = "mmap") -> list[int]:
    """Open ``path`` strictly and read every record, tensor and base; compare each value
    with the original bit for bit. Returns the steps found. LowdiffError propagates; any
    other exception, or a value that differs, fails the test."""
    from lowdiff_store import LogReader

    with LogReader(path, strict=True, mode=mode) as r:  # type: ignore[arg-type]
        steps = [int(s) for s in r.steps]
        for s in steps:
            rec = r.record(s)
            want = log.tensors[s]
            assert sorted(rec.names) == sorted(want), (s, rec.names)
            for name, arr in want.items():
                got = rec.tensor(name)
                assert got.dtype == arr.dtype, (s, name)
                assert got.shape == arr.shape, (s, name)
                assert got.tobytes() == arr.tobytes(), (s, name)
        for b in r.bases:
            with r.base(b) as bf:
                assert sorted(bf.names) == sorted(log.base), bf.names
                for name, arr in log.base.items():
                    assert bf.tensor(name).tobytes() == arr.tobytes(), name
                assert bf.meta() == log.base_meta
        return steps


@pytest.fixture
def read_all() -> Callable[..., list[int]]:
    """:func:`read_everything` as a fixture (test modules do not import conftest)."""
    return read_everything


# --------------------------------------------------------------------------- parallel runs
#
# ``make test`` runs the suite on pytest-xdist workers with ``--dist loadgroup``: tests are
# handed out one by one, except those of one ``xdist_group``, which run on one worker. The
# groups are derived here, so a new test needs no marker of its own:
#
# - a test that uses a module- or class-scoped fixture runs with the rest of its module
#   (the fixture, often a whole training launch, is then built once, not once per worker);
# - every test that uses the S3 server (the ``s3_server`` fixture, directly or through
#   ``s3_env`` / ``s3_bucket`` / ``s3_url``) runs on one worker: one SeaweedFS server per
#   test run, not one per worker.
#
# Without xdist the marker is inert (it is declared in pyproject.toml for --strict-markers).

_SHARED_SCOPES = ("module", "class", "package")


#: ``@pytest.mark.consistent_bases`` (a whole file: ``pytestmark``): the test is about
#: consistent bases (their steps, files, staging, compaction of them), written before
#: streamed bases became the default on CPU; it runs with ``LOWDIFF_BASE_SLICES=1``, set
#: before its fixtures (module-scoped training runs included) and inherited by the
#: processes it starts. Every other test runs with the default.
_BASE_SLICES_ENV = "LOWDIFF_BASE_SLICES"
_BASE_SLICES_GIVEN = os.environ.get(_BASE_SLICES_ENV)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("consistent_bases") is not None:
        os.environ[_BASE_SLICES_ENV] = "1"
    elif _BASE_SLICES_GIVEN is None:
        os.environ.pop(_BASE_SLICES_ENV, None)
    else:
        os.environ[_BASE_SLICES_ENV] = _BASE_SLICES_GIVEN


@pytest.fixture(autouse=True)
def _slow_staging_everywhere(request: pytest.FixtureRequest) -> None:
    """``LOWDIFF_TEST_SLOW_STAGING=<seconds>``: every base staging buffer is made that late
    (see tests/helpers/slow_staging.py), to find tests that assume a quiet machine; not
    in the staging tests themselves (test_base_staging*.py), which drive the pool."""
    delay = os.environ.get(SLOW_STAGING_ENV)
    if delay and "torch" in sys.modules and \
            not request.node.path.name.startswith("test_base_staging"):
        slow_staging(request.getfixturevalue("monkeypatch"), float(delay))


def _xdist_group(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    if "s3_server" in names:
        return "s3-server"
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    for name in names:
        if any(d.scope in _SHARED_SCOPES for d in defs.get(name, ())):
            return f"module:{item.nodeid.split('::', 1)[0]}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test that shares an expensive fixture in its xdist group (see above)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = _xdist_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


# --------------------------------------------------------------------------- CPU census
#
# ``LOWDIFF_TEST_CPU=FILE``: each test appends one JSON line to FILE, the CPU seconds its
# worker spent on it (setup, call and teardown) and those of the processes it started and
# reaped (``RUSAGE_CHILDREN``; a fork server's runs count when the server is reaped, at
# its fixture's teardown). ``python tools/test_cpu.py FILE`` sums them by file: where CI's
# CPU goes, which --durations (wall time, inflated by whatever else runs) cannot say.

_CPU_CENSUS = os.environ.get("LOWDIFF_TEST_CPU")


def _cpu_now() -> tuple[float, float]:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not _CPU_CENSUS:
        yield
        return
    import json
    import time

    own0, kids0 = _cpu_now()
    t0 = time.monotonic()
    yield
    own1, kids1 = _cpu_now()
    with open(_CPU_CENSUS, "a", encoding="utf-8") as f:
        f.write(json.dumps({"test": item.nodeid, "own": round(own1 - own0, 3),
                            "children": round(kids1 - kids0, 3),
                            "wall": round(time.monotonic() - t0, 3)}) + "\n")
