"""The suite's xdist groups take effect (tests/conftest.py derives them; ``make test`` runs
``--dist loadgroup``): a test that shares a module fixture carries its group in its node id
on a worker, which is what xdist's scheduler reads. pytest 9.2 with pytest-xdist 3.8 lost
it silently (the bound in requirements-dev.txt); this test fails if that happens again."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared() -> int:
    return 1


def test_a_module_fixture_puts_the_test_in_its_modules_group(
        request: pytest.FixtureRequest, shared: int) -> None:
    assert shared == 1
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["module:tests/test_xdist_groups.py"]
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker, loadgroup
        assert request.node.nodeid.endswith("@module:tests/test_xdist_groups.py"), \
            request.node.nodeid
