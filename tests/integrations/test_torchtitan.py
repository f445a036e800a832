"""torchtitan + ``LowDiffCheckpointManager`` against the real package (0.3.0), on one CPU
rank and on two (FSDP2, gloo): the debug model trained by torchtitan's own ``Trainer``,
SIGKILLed in the middle of a checkpoint interval, run again, ends bitwise equal to an
uninterrupted run of torchtitan's own checkpoint manager (every logged loss and gradient
norm, learning rate, weights, optimizer state, ``train_state``, data loader position, on
every rank), the log's bases being torchtitan's DCP checkpoints by reference; the red team
(a kill inside torchtitan's DCP save, a DCP directory deleted or changed under the log,
another world size, another model or configuration, a data loader whose state cannot be
recorded or restored); the retention rule; and what the manager does not support is
refused when it is built. The CPU adjustments live in ``titan_cpu.py``. The runs (but
the one-rank job on the two ranks' log) are forked by a fork server per rank
(``titan_worker.py --serve``, tests/helpers/fork_server.py), which made torchtitan's
imports once: each run is a process of its own all the same, SIGKILLed as a job's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install "
                    "'lowdiff-store[torchtitan]', Python >= 3.11)")

from lowdiff_store import ConfigError, Reason, latest_step
from lowdiff_store.log import LogReader
from lowdiff_store.log.reference import ReferenceBase
from tests.helpers.dist import NEEDS_GLOO, check_exits, free_port
from tests.helpers.fork_server import ForkServer, run_ranks

from . import titan_cpu

pytestmark = pytest.mark.filterwarnings("ignore")  # torchtitan's and torchdata's notes
WORKER = Path(__file__).with_name("titan_worker.py")
STEPS, INTERVAL = 10, 5
#: the debug model's fused QKV weights (6 layers of 768 x 256 fp32): what a base holds
#: besides RNG states, torchtitan's checkpoint holding them split into wq / wk / wv
WQKV_BYTES = 6 * 768 * 256 * 4


def _env(tweaks: dict[str, Any] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
            "TITAN_TWEAKS": json.dumps(tweaks or {})}


def _argv(tmp: Path, assets: Path | None, dump: str, out: str, mode: str) -> list[str]:
    return [sys.executable, str(WORKER), str(assets or tmp / "assets"), str(tmp / dump),
            str(tmp / out), mode, str(STEPS), str(INTERVAL)]


def _server(assets: Path, log: Path, rank: int = 0, world: int = 1) -> ForkServer:
    """A fork server (tests/helpers/fork_server.py) for the runs of rank ``rank`` of
    ``world`` on ``assets``: their imports (torch, torchtitan, inductor, datasets: most of
    a short run's time) made once; each run a process of its own all the same."""
    return ForkServer([sys.executable, str(WORKER), "--serve", str(assets), str(rank),
                       str(world)], _env(), log)


#: the fork server of each assets directory a module fixture started one for
_SERVERS: dict[Path, ForkServer] = {}


def _launch(argv: list[str], env: dict[str, str], assets: Path, files: Path
            ) -> subprocess.CompletedProcess[str]:
    """``argv`` on one rank: by the fork server of ``assets`` if one runs, else in a
    process started for it."""
    server = _SERVERS.get(assets)
    if server is None:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    return server.run(argv[2:], env, files, 600)  # (a hang bound, as subprocess.run's)


def _run(tmp: Path, dump: str, out: str, mode: str, kill_at: int | None = None, *,
         assets: Path | None = None, tweaks: dict[str, Any] | None = None,
         rc: int | None = None) -> subprocess.CompletedProcess[str]:
    """The worker on one rank; the exit status must be ``rc`` (default: -9 with
    ``kill_at``, else 0)."""
    argv = _argv(tmp, assets, dump, out, mode)
    if kill_at is not None:
        argv.append(str(kill_at))
    proc = _launch(argv, _env(tweaks), assets or tmp / "assets", tmp / out)
    want = rc if rc is not None else (-9 if kill_at is not None else 0)
    assert proc.returncode == want, proc.stderr[-4000:]
    return proc


def _refusals(tmp: Path, dump: str, out: str, cases: list[dict[str, Any]], *,
              assets: Path) -> list[str]:
    """The jobs ``cases`` (tweaks), one rank each, started in turn in one worker process,
    each refused when it starts: their messages, in order."""
    env = {**_env(), "TITAN_REFUSALS": json.dumps(cases)}
    proc = _launch(_argv(tmp, assets, dump, out, "log"), env, assets, tmp / out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = [json.loads(ln) for ln in (tmp / f"{out}.refusals.jsonl").read_text().splitlines()]
    assert [g["tweaks"] for g in got] == cases
    return [g["error"] for g in got]


def _run_2(servers: list[ForkServer], tmp: Path, dump: str, out: str, mode: str,
           kill_at: int | None = None) -> None:
    """The worker on two ranks (FSDP2, gloo), each forked by its rank's server; rank r
    writes ``OUT-r<r>.*``. With ``kill_at`` both ranks SIGKILL themselves inside step
    ``kill_at + 1``: rank 1 before its optimizer step, rank 0 after it, once step
    ``kill_at`` is durable in its shard (see ``titan_worker.py``)."""
    port = free_port()

    def argv(rank: int) -> list[str]:
        return [str(tmp / "assets"), str(tmp / dump), str(tmp / f"{out}-r{rank}"), mode,
                str(STEPS), str(INTERVAL), "-" if kill_at is None else str(kill_at),
                str(rank), "2", str(port)]

    exits = run_ranks(servers, argv, 2, env=_env(), timeout=900)
    if kill_at is None:
        check_exits(exits)
    else:
        for e in exits:
            assert not e.timed_out, str(e)
            assert e.returncode == -9, str(e)


def _losses(p: Path) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in map(json.loads, p.read_text().splitlines())}


def _final(tmp: Path, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(tmp / f"{name}.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((tmp / f"{name}.json").read_text())


def _same_as_ref(ref: Path, ref_name: str, tmp: Path, name: str, durable: int) -> None:
    """The run ``name`` resumed at ``durable`` and ended as torchtitan's own uninterrupted
    run ``ref_name``: every later loss, gradient norm and learning rate, the final weights
    and optimizer state, ``train_state`` and data loader position, bitwise."""
    want = _losses(ref / f"{ref_name}.losses.jsonl")
    got = _losses(tmp / f"{name}.losses.jsonl")
    assert sorted(got) == list(range(durable + 1, STEPS + 1))
    bad = [s for s in got if got[s] != want[s]]
    assert not bad, f"losses, grad norms or lr differ at steps {bad}"
    ref_arrays, ref_json = _final(ref, ref_name)
    got_arrays, got_json = _final(tmp, name)
    assert set(ref_arrays) == set(got_arrays)
    assert any(k.startswith("opt/") for k in got_arrays)
    differ = sorted(k for k in ref_arrays if not np.array_equal(ref_arrays[k], got_arrays[k]))
    assert not differ, differ
    assert got_json["resumed"] == durable
    assert got_json["train_state"] == ref_json["train_state"]
    assert got_json["dataloader"] == ref_json["dataloader"]


def _reference_base(log: Path, step: int, dcp: Path) -> ReferenceBase:
    """The base of ``step`` of the log: a reference to ``dcp`` holding only the fused QKV
    weights and RNG states itself (returned closed: its table and names stay readable)."""
    with LogReader(log) as r:
        b = r.base(step)
    b.close()
    assert isinstance(b, ReferenceBase)
    assert b.reference.kind == "dcp"
    assert b.reference.root == str(dcp)
    stored = [n for n in b.file.names if not n.startswith("@")]
    assert sorted(stored) == [f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in range(6)]
    keys = {t.name: t.key for t in b.reference.tensors}
    assert keys["tok_embeddings.weight"] == "tok_embeddings.weight"
    assert keys["@opt/layers.0.attention.qkv_linear.wqkv.weight/exp_avg"] == \
        "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    return b


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The assets and torchtitan's own uninterrupted run on one rank (``ref``), shared by
    the one-rank tests, and the fork server their runs on these assets go through."""
    tmp = tmp_path_factory.mktemp("titan-1")
    titan_cpu.make_assets(tmp / "assets")
    server = _SERVERS[tmp / "assets"] = _server(tmp / "assets", tmp / "fork-server.log")
    try:
        _run(tmp, "dump-ref", "ref", "dcp")
        assert sorted(_losses(tmp / "ref.losses.jsonl")) == list(range(1, STEPS + 1))
        yield tmp
    finally:
        del _SERVERS[tmp / "assets"]
        server.close()


def test_killed_mid_interval_resumes_from_the_log_bitwise(one_rank: Path, tmp_path: Path
                                                         ) -> None:
    ref_losses = _losses(one_rank / "ref.losses.jsonl")
    kill_at = STEPS - 2  # killed inside step 9: torchtitan's newest checkpoint is step 5
    seg = {"checkpoint": {"log_options": {"segment_bytes": 60 << 20}}}  # 2 records each
    _run(tmp_path, "dump", "killed", "log", kill_at, assets=one_rank / "assets", tweaks=seg)
    ck = tmp_path / "dump" / "checkpoint"
    assert sorted(os.listdir(ck)) == [f"step-{INTERVAL}"]
    log = tmp_path / "dump" / "lowdiff"
    durable = latest_step(log)
    assert durable is not None
    # step 8's record is completed by step 9's optimizer step, which never ran
    assert INTERVAL < durable <= kill_at - 1, durable
    killed = _losses(tmp_path / "killed.losses.jsonl")
    assert sorted(killed) == list(range(1, kill_at + 1))
    assert all(killed[s] == ref_losses[s] for s in killed)  # the log changes nothing
    # the log's base of step 5 is torchtitan's checkpoint of step 5, by reference
    with LogReader(log) as r:
        assert r.bases[-1] == INTERVAL  # (base 0, a copy, dropped once base 5 is durable)
        assert min(r.steps) >= 3  # the segment of steps 1 and 2 too
    base = _reference_base(log, INTERVAL, ck / f"step-{INTERVAL}")
    data = (ck / f"step-{INTERVAL}" / "__0_0.distcp").stat().st_size
    assert WQKV_BYTES < base.nbytes < WQKV_BYTES + 200_000 < data / 10

    _run(tmp_path, "dump", "resumed", "log", assets=one_rank / "assets", tweaks=seg)
    _same_as_ref(one_rank, "ref", tmp_path, "resumed", durable)
    # the final full save (last_save_model_only=False) is the log's one base
    with LogReader(log) as r:
        assert r.bases == [STEPS]
        assert min(r.steps) == STEPS - 1  # the segments before it are gone
    _reference_base(log, STEPS, ck / f"step-{STEPS}")


def test_killed_inside_torchtitans_dcp_save_resumes_from_the_log(one_rank: Path,
                                                                tmp_path: Path) -> None:
    """SIGKILL inside torchtitan's own DCP save of step 8 (its data file written, not its
    ``.metadata``), checkpoints every 2 steps, ``keep_latest_k=2``: the log resumes at step
    7 from its base of step 6, ends bitwise equal to the uninterrupted run, and retention
    leaves torchtitan's two newest checkpoints and the log's one base."""
    ckpt = {"interval": 2, "keep_latest_k": 2}
    _run(tmp_path, "dump", "killed", "log", assets=one_rank / "assets", rc=-9,
         tweaks={"checkpoint": ckpt, "kill_in_dcp_save": 8})
    ck, log = tmp_path / "dump" / "checkpoint", tmp_path / "dump" / "lowdiff"
    assert sorted(os.listdir(ck / "step-8")) == ["__0_0.distcp"]  # no .metadata
    assert latest_step(log) == 7
    with LogReader(log) as r:
        assert r.bases[-1] == 6
    _reference_base(log, 6, ck / "step-6")

    _run(tmp_path, "dump", "resumed", "log", assets=one_rank / "assets",
         tweaks={"checkpoint": ckpt})
    _same_as_ref(one_rank, "ref", tmp_path, "resumed", 7)
    deadline = time.monotonic() + 60  # torchtitan deletes on its purge thread
    while sorted(os.listdir(ck)) != ["step-10", "step-8"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(os.listdir(ck)) == ["step-10", "step-8"]
    with LogReader(log) as r:
        assert r.bases == [STEPS]


def test_a_job_switching_to_the_log_refers_to_the_checkpoint_torchtitan_loaded(
        one_rank: Path, tmp_path: Path) -> None:
    """A job checkpointed by torchtitan alone, killed between its checkpoints of steps 5
    and 10 (what that leaves: its checkpoint of step 5, here the reference run's), rerun
    with the log on: torchtitan loads its checkpoint of step 5, and the log's first base
    refers to it (no copy); killed again inside step 9 and rerun, the job resumes from the
    log at step 7 and ends bitwise equal to the uninterrupted run."""
    assets = one_rank / "assets"
    ck, log = tmp_path / "dump" / "checkpoint", tmp_path / "dump" / "lowdiff"
    shutil.copytree(one_rank / "dump-ref" / "checkpoint" / "step-5", ck / "step-5")
    _run(tmp_path, "dump", "second", "log", 8, assets=assets)
    ref = _losses(one_rank / "ref.losses.jsonl")
    second = _losses(tmp_path / "second.losses.jsonl")
    assert sorted(second) == [6, 7, 8]  # torchtitan resumed at its step 5
    assert all(second[s] == ref[s] for s in second)
    with LogReader(log) as r:
        assert r.bases == [0]  # the log's step 0: the job's step 5
        assert r.durable_step == 2
    _reference_base(log, 0, ck / "step-5")
    _run(tmp_path, "dump", "third", "log", assets=assets)
    _same_as_ref(one_rank, "ref", tmp_path, "third", 7)


def test_initial_load_path_is_the_logs_first_base_by_reference(one_rank: Path,
                                                               tmp_path: Path) -> None:
    """``initial_load_path`` (a DCP directory: the reference run's checkpoint of step 5),
    loaded model only by torchtitan into a fresh job: the log's base 0 refers to its model
    tensors (the optimizer holds no state yet) and holds the fused QKV weights and RNG;
    killed inside step 4 and rerun, the job resumes from the log at step 2, and once its
    own checkpoints are bases the log needs ``initial_load_path`` no more."""
    start = one_rank / "dump-ref" / "checkpoint" / "step-5"
    tweaks = {"checkpoint": {"initial_load_path": str(start)}}
    assets = one_rank / "assets"
    _run(tmp_path, "dump", "killed", "log", 3, assets=assets, tweaks=tweaks)
    log = tmp_path / "dump" / "lowdiff"
    with LogReader(log) as r:
        assert r.bases == [0]
        base = r.base(0)
    base.close()
    assert isinstance(base, ReferenceBase)
    assert base.reference.root == str(start)
    keys = {t.name: t.key for t in base.reference.tensors}
    assert keys["tok_embeddings.weight"] == "tok_embeddings.weight"
    assert not any(n.startswith("@opt/") for n in base.names)
    assert sorted(n for n in base.file.names if not n.startswith("@")) == \
        [f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in range(6)]
    first = _losses(tmp_path / "killed.losses.jsonl")
    assert first[1]["loss"] < _losses(one_rank / "ref.losses.jsonl")[1]["loss"]  # trained
    _run(tmp_path, "dump", "resumed", "log", assets=assets, tweaks=tweaks)
    assert _final(tmp_path, "resumed")[1]["resumed"] == 2
    with LogReader(log) as r:
        assert r.bases == [STEPS]


def _refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of the ConfigError a refused run ended with."""
    lines = [ln for ln in proc.stderr.splitlines() if "lowdiff_store.errors.ConfigError: " in ln]
    assert lines, proc.stderr[-4000:]
    return lines[-1].split("lowdiff_store.errors.ConfigError: ", 1)[1]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_what_cannot_resume_exactly_is_refused_in_one_line(one_rank: Path,
                                                         tmp_path: Path) -> None:
    """After a kill inside step 9 (the log's base: torchtitan's checkpoint of step 5), each
    of these reruns is refused at ``load()`` with one line, before training, the log left
    as it was: another learning rate, a smaller model, a data loader that refuses the
    logged position, one whose state cannot be recorded (these four started in turn in one
    process), a changed and a deleted DCP checkpoint. Once the job is as it was, it resumes
    and ends bitwise."""
    assets = one_rank / "assets"
    _run(tmp_path, "dump", "killed", "log", STEPS - 2, assets=assets)
    log, step5 = tmp_path / "dump" / "lowdiff", tmp_path / "dump" / "checkpoint" / "step-5"
    durable = latest_step(log)
    assert durable is not None
    before = _files(log)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lr": 1e-3}, "the job's configuration differs from the one that wrote the log in "
                       "optimizer: not resumed"),
        ({"n_layers": 2}, "differs from the one that wrote the log in model_spec"),
        ({"loader": "refuses"}, f"the data loader refused the position logged at step "
                                f"{durable} (KeyError"),
        ({"loader": "unrecordable"}, "the data loader's position cannot be recorded every "
                                     "step: its state['dataset_state']['rng']: a "
                                     "numpy.random._generator.Generator cannot be stored"),
    ]
    lines = _refusals(tmp_path, "dump", "refused", [t for t, _ in cases], assets=assets)
    for (tweaks, words), line in zip(cases, lines, strict=True):
        assert words in line, (tweaks, line)
        assert "\n" not in line, line
    assert _files(log) == before
    data = step5 / "__0_0.distcp"
    raw = data.read_bytes()
    at = len(raw) // 2  # inside a tensor's bytes
    data.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])  # one bit
    line = _refusal(_run(tmp_path, "dump", "refused", "log", assets=assets, rc=1))
    assert line.startswith(f"{log}: reference_changed: the log cannot resume exactly: its "
                           f"base refers to torchtitan's DCP checkpoint file {data}"), line
    data.write_bytes(raw)
    shutil.move(step5, tmp_path / "aside")
    line = _refusal(_run(tmp_path, "dump", "refused", "log", assets=assets, rc=1))
    assert line.startswith(f"{log}: missing_file: the log cannot resume exactly: its base "
                           f"refers to torchtitan's DCP checkpoint file {step5}/.metadata, "
                           f"which was deleted or changed"), line
    assert "move the log aside to resume from torchtitan's own newest checkpoint" in line
    assert _files(log) == before
    shutil.move(tmp_path / "aside", step5)
    _run(tmp_path, "dump", "resumed", "log", assets=assets)
    _same_as_ref(one_rank, "ref", tmp_path, "resumed", durable)


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[list[ForkServer]]:
    """The assets in ``tmp_path``, and a fork server for each rank of a 2-rank job on
    them."""
    titan_cpu.make_assets(tmp_path / "assets")
    servers: list[ForkServer] = []
    try:
        for r in range(2):
            servers.append(_server(tmp_path / "assets", tmp_path / f"fork-server-{r}.log",
                                   r, 2))
        yield servers
    finally:
        for server in servers:
            server.close()


@NEEDS_GLOO
def test_two_fsdp2_ranks_killed_mid_interval_resume_from_the_log_bitwise(
        tmp_path: Path, two_servers: list[ForkServer]) -> None:
    _run_2(two_servers, tmp_path, "dump-ref", "ref", "dcp")
    ref = [_losses(tmp_path / f"ref-r{r}.losses.jsonl") for r in range(2)]
    assert sorted(ref[0]) == list(range(1, STEPS + 1))
    assert ref[0] == ref[1]  # the global loss, the same on both ranks
    kill_at = STEPS - 2  # killed inside step 9: torchtitan's newest checkpoint is step 5
    _run_2(two_servers, tmp_path, "dump", "killed", "log", kill_at)
    ck = tmp_path / "dump" / "checkpoint"
    assert sorted(os.listdir(ck)) == [f"step-{INTERVAL}"]
    log = tmp_path / "dump" / "lowdiff"
    assert sorted(os.listdir(log)) == ["SHARDS", "rank-00000", "rank-00001"]
    durable = latest_step(log)  # the newest step durable on both shards
    assert durable is not None
    assert INTERVAL < durable <= kill_at - 1, durable
    # rank 0's shard holds step 8 (completed by its step 9), rank 1's does not
    assert latest_step(log / "rank-00000") == kill_at
    assert latest_step(log / "rank-00001") == durable
    for r in range(2):
        killed = _losses(tmp_path / f"killed-r{r}.losses.jsonl")
        assert sorted(killed) == list(range(1, kill_at + 1))
        assert all(killed[s] == ref[r][s] for s in killed)  # the log changes nothing
    from lowdiff_store.torch import describe_log

    info = describe_log(log)
    assert (info["layout"], info["world_size"], info["mesh"]["shape"]) == ("fsdp", 2, [2])
    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"  # each rank logs its half
    assert info["placements"][wqkv] == {"placements": [["S", 0]], "global_shape": [768, 256]}
    assert [s["pieces"][wqkv] for s in info["shards"]] == [
        {"offset": [0, 0], "shape": [384, 256]}, {"offset": [384, 0], "shape": [384, 256]}]
    # each rank's base of step 5 refers to its boxes of torchtitan's checkpoint of step 5
    for r in range(2):
        base = _reference_base(log / f"rank-{r:05d}", INTERVAL, ck / f"step-{INTERVAL}")
        emb = {t.name: t for t in base.reference.tensors}["tok_embeddings.weight"]
        assert (emb.shape, emb.box) == ((1024, 256), ((1024 * r, 0), (2048, 256)))

    _run_2(two_servers, tmp_path, "dump", "resumed", "log")  # the same job again
    for r in range(2):
        _same_as_ref(tmp_path, f"ref-r{r}", tmp_path, f"resumed-r{r}", durable)
    loaders = [_final(tmp_path, f"resumed-r{r}")[1]["dataloader"] for r in range(2)]
    assert loaders[0] != loaders[1]  # each rank resumed its own data loader position
    # rank 0 dropped its step 8 and logged again from the job's step
    assert latest_step(log / "rank-00000") == latest_step(log / "rank-00001") == STEPS
    for r in range(2):
        with LogReader(log / f"rank-{r:05d}") as reader:
            assert reader.bases == [STEPS]
    # a job of one rank does not resume the two ranks' log (their data loader positions)
    line = _refusal(_run(tmp_path, "dump", "one", "log", rc=1))
    assert line == f"{log}: state_mismatch: {log} was written by 2 data parallel ranks, " \
        "this job has 1", line


# ---------------------------------------------------------------------- refusals


def _manager(monkeypatch: pytest.MonkeyPatch | None = None, *, world: int = 1,
             optimizers: int = 1, parts: int = 1, loader: Any = "ok", dp: int = 1,
             base_folder: str = "/nonexistent-never-written", **config: Any) -> Any:
    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    if monkeypatch is not None:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: world)
    if loader == "ok":
        loader = ParallelAwareDataloader(torch.utils.data.TensorDataset(torch.zeros(4)),
                                         dp_rank=0, dp_world_size=dp, batch_size=1)
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.AdamW(model.parameters()) for _ in range(optimizers)]
    cfg = LowDiffCheckpointManager.Config(**{"enable": True, **config})
    return LowDiffCheckpointManager(
        cfg, dataloader=loader, model_parts=[model] * parts,
        optimizers=SimpleNamespace(optimizers=opts),
        lr_schedulers=SimpleNamespace(schedulers=[
            torch.optim.lr_scheduler.LambdaLR(o, lambda _s: 1.0) for o in opts]),
        states={"train_state": object()},
        sd_adapter=None, base_folder=base_folder)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"optimizers": 2}, "2 optimizers"),
    ({"parts": 2}, "2 model parts"),
    ({"async_mode": "async"}, "async_mode"),
    ({"load_step": 3}, "load_step"),
    ({"exclude_from_loading": ["dataloader"]}, "exclude_from_loading"),
    ({"load_only": True}, "load_only"),
    ({"loader": None}, "ParallelAwareDataloader"),
    ({"log_options": {"base_slices": 3}}, "base_slices (streamed bases) needs bases='own'"),
])
def test_what_is_not_supported_is_refused_when_built(kwargs: dict[str, Any],
                                                     words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _manager(**kwargs)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert words in str(err.value)
    assert "\n" not in str(err.value)
    assert not os.path.exists("/nonexistent-never-written")


@pytest.mark.parametrize(("dp", "words"), [
    (1, "2 ranks with a data parallel degree of 1"),   # tensor / pipeline parallelism
    (2, "2 ranks, parameter weight is not a DTensor"),  # not torchtitan's FSDP2
])
def test_several_ranks_other_than_fsdp2_are_refused(monkeypatch: pytest.MonkeyPatch, dp: int,
                                                    words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _manager(monkeypatch, world=2, dp=dp)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert words in str(err.value)
    assert "only FSDP2 data parallel sharding over every rank" in str(err.value)
    assert "\n" not in str(err.value)
    assert not os.path.exists("/nonexistent-never-written")


def test_config_builds_the_manager_and_checks_its_fields() -> None:
    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    cfg = LowDiffCheckpointManager.Config(enable=True, interval=500)
    assert cfg._owner is LowDiffCheckpointManager
    assert (cfg.log_folder, cfg.bases, cfg.snapshot_every, cfg.log_batch) == \
        ("lowdiff", "dcp", 100, 1)
    with pytest.raises(ConfigError):
        LowDiffCheckpointManager.Config(snapshot_every=0)
    with pytest.raises(ConfigError):
        LowDiffCheckpointManager.Config(log_resume="sometimes")
    with pytest.raises(ConfigError, match="bases='both' must be one of"):
        LowDiffCheckpointManager.Config(bases="both")
    with pytest.raises(ConfigError, match=r"log_options \['batch'\] are set by the manager"):
        LowDiffCheckpointManager.Config(log_options={"batch": 4, "segment_bytes": 1 << 20})
    # a disabled manager checks nothing and does nothing, as torchtitan's own
    assert _manager(optimizers=2, enable=False).checkpointer is None


# --------------------------------------------------------------------- retention


def _dcp_save(path: Path, model: Any, opt: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path), no_dist=True)


def _gone(path: Path, deadline_s: float = 60.0) -> bool:
    """Whether ``path`` is deleted (torchtitan's purge thread deletes in the background);
    waits at most ``deadline_s`` (a hang bound)."""
    end = time.monotonic() + deadline_s
    while path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    return not path.exists()


def test_keep_latest_k_never_deletes_a_checkpoint_the_log_refers_to(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The retention rule: with ``keep_latest_k=2``, checkpoints of steps 1, 2, 3 and 5
    and the log's only base referring to step 1, torchtitan's purge deletes step 2 and
    keeps step 1 (``deferred``); once the log's base of step 6 (referring to torchtitan's
    checkpoint of step 6) is durable, the log drops its base 0 and the records before it,
    and steps 1 and 3 are deleted."""
    import torch

    from lowdiff_store.torch import DiffCheckpointer, InitialBase, restore
    from tests.helpers.tiny import build, train

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    dump = tmp_path / "dump"
    ck, log = dump / "checkpoint", dump / "lowdiff"
    model, opt = build()
    train(model, opt, 0, 2)
    _dcp_save(ck / "step-1", model, opt)  # the state the log starts from
    for step in (2, 3, 5):
        (ck / f"step-{step}").mkdir()
    ckpt = DiffCheckpointer(log, model, opt, snapshot_every=1 << 62, exact_bases=True,
                            base_slices=1,  # (refer_base: consistent bases)
                            initial_base=InitialBase(str(ck / "step-1"), load=False))
    train(model, opt, 2, 4)
    ckpt.close()
    mgr = _manager(base_folder=str(dump), keep_latest_k=2)
    try:
        mgr._purge_stale_checkpoints()
        assert _gone(ck / "step-2")
        assert mgr.deferred == [str(ck / "step-1")]
        assert (ck / "step-1" / ".metadata").exists()
        assert sorted(os.listdir(ck)) == ["step-1", "step-3", "step-5"]
        # the log moves on: its base of step 6 refers to torchtitan's checkpoint of it
        restore(log, model, opt)
        ckpt = DiffCheckpointer(log, model, opt, snapshot_every=1 << 62, exact_bases=True,
                                base_slices=1)
        train(model, opt, 4, 8)
        _dcp_save(ck / "step-6", model, opt)
        assert ckpt.refer_base(str(ck / "step-6"))
        train(model, opt, 8, 9)
        ckpt.close()
        with LogReader(log) as r:
            assert r.bases == [0, 6]
        mgr._awaiting = 6
        mgr._retain()
        assert _gone(ck / "step-1")
        assert _gone(ck / "step-3")
        assert mgr.deferred == []
        assert sorted(os.listdir(ck)) == ["step-5", "step-6"]
        with LogReader(log) as r:
            assert r.bases == [6]
        assert latest_step(log) == 7
    finally:
        mgr.close()


def test_a_checkpoint_that_cannot_be_read_back_is_not_referenced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DCP checkpoint whose scan fails (here: no ``.metadata``) is not made a base:
    training goes on with a warning, the log keeps its previous base."""
    from lowdiff_store import LowdiffError

    mgr = _manager(base_folder=str(tmp_path))
    asked: list[str] = []

    def refer_base(path: str) -> bool:
        asked.append(path)
        raise LowdiffError("not a DCP checkpoint (no .metadata)", reason=Reason.MISSING_FILE,
                           path=f"{path}/.metadata")

    fake = SimpleNamespace(refer_base=refer_base, step=5)
    with caplog.at_level("WARNING"):
        mgr._refer(fake, str(tmp_path / "step-5"))
    assert asked == [str(tmp_path / "step-5")]
    assert (mgr.referred, mgr._awaiting) == ([], None)
    assert "could not be made the log's base (LowdiffError" in caplog.text
    assert "the log keeps its previous base" in caplog.text
    fake.refer_base = lambda path: True
    mgr._refer(fake, str(tmp_path / "step-5"))
    assert (mgr.referred, mgr._awaiting) == ([str(tmp_path / "step-5")], 5)
