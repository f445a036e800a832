"""Metadata the torch layer parses once (:mod:`lowdiff_store.torchmeta`) where it used to
index raw maps: a crafted file gets one ``bad_metadata`` line naming it, never an internal
error, on the paths that indexed the raw map before (an alias to a non-name in the
manifest; a base without hyperparameters read by the resharding engine)."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import pytest
from _cases import build, ckpt_kwargs, run

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.cli import main as cli_main
from lowdiff_store.log import LogReader, write_base
from lowdiff_store.log.base import BaseFile
from lowdiff_store.log.manifest import update_manifest
from lowdiff_store.torch import DiffCheckpointer
from lowdiff_store.torch.distributed.reshard import Source, replay_pieces
from lowdiff_store.torch.replay.engine import log_meta
from lowdiff_store.verify import verify_log

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

BASE_STEP, TARGET = 3, 5


@pytest.fixture(scope="module")
def clean_log(tmp_path_factory: Any) -> str:
    """A grad-mode log (SGD + BatchNorm + StepLR), 6 steps, bases every 3 steps."""
    path = tmp_path_factory.mktemp("logs") / "sgd_bn"
    o = build("sgd_bn")
    kw = {**ckpt_kwargs("sgd_bn"), "snapshot_every": 3}
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, **kw) as ck:
        run("sgd_bn", o, 0, 6, ck)
    return str(path)


def _copy(clean_log: str, tmp_path: Any) -> str:
    path = str(tmp_path / "log")
    shutil.copytree(clean_log, path)
    return path


def test_an_alias_to_a_list_is_one_line_naming_the_manifest(clean_log: str, tmp_path: Any,
                                                            capsys: Any) -> None:
    """Was a TypeError (an unhashable alias target) reported as an internal error."""
    path = _copy(clean_log, tmp_path)
    update_manifest(path, lambda m: m.meta["torch"].__setitem__("aliases", {"x": ["w"]}))
    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    rc = cli_main(["replay", path, "--to-step", str(TARGET), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "bad_metadata" in err
    assert os.path.join(path, "MANIFEST") in err
    assert "alias 'x'" in err
    assert "internal error" not in err
    assert not out.exists()
    rep = verify_log(path)
    assert not rep.ok
    assert [p.reason for p in rep.problems] == [Reason.BAD_METADATA]


def test_a_base_without_hyperparameters_is_one_error_when_resharding(clean_log: str,
                                                                     tmp_path: Any) -> None:
    """The resharding engine read ``meta["torch"]["hyper"]`` of the raw base map (a
    KeyError for a crafted base); it now parses the base as replay does."""
    path = _copy(clean_log, tmp_path)
    bpath = os.path.join(path, f"base-{BASE_STEP:016d}.safetensors")
    with BaseFile(bpath) as bf:
        tensors = {n: (bf.info(n)[0], bf.tensor(n).copy()) for n in bf.names}
        meta = copy.deepcopy(bf.meta())
        log_id = bf.log_id
    del meta["torch"]["hyper"]
    write_base(bpath, BASE_STEP, tensors, meta, log_id)
    with LogReader(path) as reader:
        src = Source(path, [reader], [log_meta(reader)], "single")
        with pytest.raises(LowdiffError) as ei:
            replay_pieces(src, TARGET)
    err = ei.value
    assert err.reason is Reason.BAD_METADATA, str(err)
    assert err.path == bpath
    assert "hyper must hold one map per param group" in str(err)
    assert len(str(err).splitlines()) == 1
