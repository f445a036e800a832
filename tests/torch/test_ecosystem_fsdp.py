"""DCP across world sizes with FSDP2 (gloo, 2 ranks on CPU): a DCP export of a 1-rank log
and of a 2-rank sharded FSDP2 log loads bitwise into FSDP2 models with
``torch.distributed.checkpoint.load``; an FSDP2 job starts its sharded log from a DCP
checkpoint written by ``dcp.save`` itself (every rank's base 0 references the boxes of the
external tensors its pieces are), trains, and restores bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store.log import LogReader
from lowdiff_store.log.reference import ReferenceBase
from lowdiff_store.log.shards import log_paths
from lowdiff_store.torch import DiffCheckpointer, export_state, replay_state
from tests.helpers import fork_server
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port
from tests.helpers.timing import scaled

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = HERE / "dcp_worker.py"
sys.path.insert(0, str(HERE))

from fsdp_worker import Net, differences  # noqa: E402

pytestmark = NEEDS_GLOO


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


#: this module's launches: forked by ``dcp_worker.py --serve`` servers (one per rank)
#: while ``_fork_servers`` holds them
LAUNCHER = fork_server.Launcher(WORKER, _env)


@pytest.fixture(scope="module", autouse=True)
def _fork_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fork servers of this module's launches (the worker's imports made once)."""
    with LAUNCHER.held(tmp_path_factory.mktemp("dcp-worker-servers")):
        yield


def launch(phase: str, d: Path, dcp_dir: Path, *args: str, world: int = 2,
           timeout: float = 150.0) -> None:
    """Run ``dcp_worker.py`` on ``world`` ranks (:data:`LAUNCHER`); every rank exits 0."""
    port = free_port()
    (d / "out").mkdir(parents=True, exist_ok=True)
    exits = LAUNCHER.run_ranks(lambda r: [
        "--phase", phase, "--rank", str(r), "--world", str(world), "--port", str(port),
        "--dir", str(d / "log"), "--out", str(d / "out"), "--dcp", str(dcp_dir),
        "--timeout", str(scaled(timeout)), *args], world, timeout=timeout)
    check_exits(exits)


def load_out(d: Path, name: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = torch.load(d / "out" / name, weights_only=True)
    return {k: v for k, v in sd.items() if k != "lr"}


def flat(model_state: dict[str, torch.Tensor], opt_state: dict[str, Any] | None
         ) -> dict[str, torch.Tensor]:
    """replay_state's output under the names ``fsdp_worker.gathered`` uses."""
    out = {f"model/{k}": v for k, v in model_state.items()}
    if opt_state is not None:
        names = [n for g in opt_state["param_groups"] for n in g["param_names"]]
        for i, st in opt_state["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"opt/{names[i]}/{k}"] = v
    return out


def plain_run(seed: int, steps: int, log: Path | None) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ck = DiffCheckpointer(log, model, opt, snapshot_every=3) if log is not None else None
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 7, (8,), generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if ck is not None:
        ck.close()
    return model, opt


def test_dcp_export_of_a_one_rank_log_loads_into_fsdp2_at_two_ranks(tmp_path: Path) -> None:
    plain_run(0, 5, tmp_path / "one")
    ms, os_ = replay_state(tmp_path / "one", with_optimizer=True)
    export_state(ms, tmp_path / "dcp", format="dcp", optimizer_state=os_)
    launch("load", tmp_path, tmp_path / "dcp")
    loaded = load_out(tmp_path, "loaded.pt")
    want = flat(ms, os_)
    assert len(want) == 7 + 6 * 3  # 6 parameters and a buffer; AdamW: 3 tensors each
    assert differences(loaded, want) == []


def test_fsdp2_log_started_from_dcp_then_exported_to_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    src, src_opt = plain_run(0, 2, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(
            src, src_opt)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    launch("start", tmp_path, tmp_path / "ck")
    start = load_out(tmp_path, "start.pt")
    src_flat = {f"model/{k}": v for k, v in src.state_dict().items()}
    names = {id(p): n for n, p in src.named_parameters()}
    for p, st in src_opt.state.items():
        src_flat.update({f"opt/{names[id(p)]}/{k}": v for k, v in st.items()})
    assert differences(start, src_flat) == []  # the checkpoint went into the pieces
    trained = load_out(tmp_path, "trained.pt")
    assert differences(load_out(tmp_path, "restored.pt"), trained) == []
    for rank, p in enumerate(log_paths(str(tmp_path / "log"))):
        with LogReader(p) as r, r.base(0) as b:
            assert isinstance(b, ReferenceBase), rank
            boxes = {t.name: t.box for t in b.reference.tensors}
            assert boxes["fc1.weight"] is not None
            offset, glob = boxes["fc1.weight"]
            assert glob == (30, 12)
            assert offset == (15 * rank, 0)
            assert "fc1.weight" not in b.file.names
    shown = subprocess.run([sys.executable, "-m", "lowdiff_store", "inspect",
                            str(tmp_path / "log")], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count(f"base 0 references dcp checkpoint {tmp_path / 'ck'}") == 2
    checked = subprocess.run([sys.executable, "-m", "lowdiff_store", "verify",
                              str(tmp_path / "log")], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ms0, _o = replay_state(tmp_path / "log", 0)  # the reference, merged over the shards
    assert differences(flat(ms0, None), {k: v for k, v in src_flat.items()
                                         if k.startswith("model/")}) == []
    # the 2-rank sharded log, exported to DCP, loads into FSDP2 at 2 ranks
    ms, os_ = replay_state(tmp_path / "log", with_optimizer=True)
    export_state(ms, tmp_path / "exported", format="dcp", optimizer_state=os_)
    d2 = tmp_path / "second"
    launch("load", d2, tmp_path / "exported")
    assert differences(load_out(d2, "loaded.pt"), trained) == []


def test_ddp_job_started_from_dcp(tmp_path: Path) -> None:
    """The replicated layout: the ranks split the parameters, each rank's base 0 references
    the ones it owns (whole tensors), and the job restores bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    src, _opt = plain_run(0, 2, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(src)}, checkpoint_id=str(tmp_path / "ck"),
                 no_dist=True)
    launch("start", tmp_path, tmp_path / "ck", "--layout", "ddp")
    start = load_out(tmp_path, "start.pt")
    want = {f"model/{k}": v for k, v in src.state_dict().items()}
    assert differences({k: v for k, v in start.items() if k.startswith("model/")}, want) == []
    assert differences(load_out(tmp_path, "restored.pt"), load_out(tmp_path, "trained.pt")) \
        == []
    referenced = []
    for p in log_paths(str(tmp_path / "log")):
        with LogReader(p) as r, r.base(0) as b:
            assert isinstance(b, ReferenceBase)
            assert all(t.box is None for t in b.reference.tensors)
            referenced += [t.name for t in b.reference.tensors]
    params = sorted(n for n, _p in src.named_parameters())
    assert sorted(n for n in referenced if n != "count") == params  # each exactly once
    assert referenced.count("count") == 2  # buffers: every rank keeps (and references) them
