"""Golden logs (issue 23): logs written by an earlier version of the code must still open,
verify, inspect and restore bit for bit.

``tests/golden/logs/<case>/`` were written by ``tools/make_golden_logs.py`` (per case in
``expected.json``: ``written_by``, the commit, and ``written_on``, the machine's numerics)
and are never rewritten by a refactoring: regenerate them only for a deliberate format
change. The SGD, DeMo and delta cases are the code of d13c252 on an AMD EPYC; the AdamW and
Adam cases were rewritten on an Intel Xeon for issue 48 with ``fused=True`` (no MKL op:
their bits are every x86-64 vendor's), and ``grad_adamw_foreach`` is a foreach AdamW log
whose replay reaches MKL's ``sqrt``: bitwise on its writer's vendor and MKL branch, refused
before the replay elsewhere (:func:`refusal`). Under a class of ATen kernels other than the
writer's (``ATEN_CPU_CAPABILITY=default``) every grad-mode restore is refused, or for a log
that records no numerics diverges naming this machine (:func:`bitwise_or_refused`).

Per case ``expected.json`` holds the recipe (``tests/golden/recipes.py`` rebuilds the
objects from it) and the canonical state after step 3 and step 7 (a sha256 of parameters,
buffers, optimizer state and hyperparameters, with a short sha per entry to name what
differs), what a restore sets besides (scheduler, scaler, compressor residuals, RNG) and
the restore's ``base_step``, ``exact`` and ``extra``.

Only the public API is used: ``lowdiff_store`` (``verify``, ``cli``), ``lowdiff_store.torch``
and the command line. Every log is copied to ``tmp_path`` first. The 2-rank cases are
restored in this process (a job of one rank reshards them); restoring them on 2 spawned
ranks (gloo) is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lowdiff_store import cli  # noqa: E402
from lowdiff_store.torch import DiffCheckpointer, describe_log, replay_state, restore  # noqa: E402
from lowdiff_store.torch.core.schema import current_class_name  # noqa: E402
from lowdiff_store.verify import inspect_log, verify_log  # noqa: E402
from tests.golden import recipes as R  # noqa: E402
from tests.helpers.tiny import one_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXPECTED: dict[str, Any] = json.loads((GOLDEN / "expected.json").read_text())["cases"]
#: the cases whose log is a directory here (the s3 case is a dump of a bucket)
ON_DISK = sorted(k for k, v in EXPECTED.items() if v["kind"] != "s3")
SHARDED = sorted(k for k, v in EXPECTED.items() if v["kind"] == "sharded")
#: exit code of ``verify`` when it found problems (README, "CLI")
EXIT_CORRUPT = 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as the logs were written; restore sets the global RNG: put it back."""
    yield from one_thread()


def golden_copy(case: str, tmp_path: Path) -> str:
    """A private copy of the case's log (the golden files are never opened in place)."""
    dst = tmp_path / case
    shutil.copytree(GOLDEN / "logs" / case, dst)
    return str(dst)


def check_state(what: str, got: R.Entries, want: dict[str, Any]) -> None:
    """``got`` (full entry shas) is the golden state ``want``; else name the entries."""
    if R.digest(got) == want["sha256"]:
        return
    short, exp = R.short(got), want["entries"]
    bad = sorted(k for k in set(short) | set(exp) if short.get(k) != exp.get(k))
    pytest.fail(f"{what} differs from the golden state: {bad or 'digest only'}")


def restore_case(case: str, path: str, step: int | None) -> tuple[Any, R.Entries, R.Entries]:
    """Restore ``step`` of the case into fresh objects (one process, no wrapper)."""
    exp = EXPECTED[case]
    o = R.build(exp["recipe"], layout="plain")
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                  compressor=o.compressor, step=step)
    return res, R.live_entries(o), R.aux_entries(o, rng=exp["kind"] != "sharded")


def here() -> dict[str, Any]:
    """This process's numerics, as ``expected.json`` records a case's ``written_on``."""
    from lowdiff_store.torch.core.numerics import current
    n = current("cpu")
    return {"cpu_vendor": n.cpu_vendor, "aten_cpu": n.aten_cpu, "mkl_vml": n.mkl_vml}


def _vector(cap: str | None) -> bool:
    return cap in ("AVX2", "AVX512")


def refusal(case: str, path: str) -> tuple[bool, bool]:
    """``(must, may)``: whether replaying the case here must be refused before it starts
    (``numerics_mismatch``), and whether it may be (docs/torch.md "Exactness across
    machines"): another class of ATen kernels; another CPU vendor where the replay reaches
    MKL; MKL on another branch, once MKL ran in this process. A log of an earlier version
    records no numerics: it is never refused, and under another kernel class it may
    diverge with ``replay_diverged`` naming this machine instead (:func:`bitwise_or_refused`)."""
    runs = describe_log(path)["numerics"]
    if not runs or EXPECTED[case]["recipe"]["checkpointer"].get("mode") == "delta":
        return False, False
    wrote, now = EXPECTED[case]["written_on"], here()
    cap = _vector(wrote["aten_cpu"]) != _vector(now["aten_cpu"])
    mkl = any(r["mkl_use"] is not None for r in runs)
    vendor = mkl and wrote["cpu_vendor"] != now["cpu_vendor"]
    branch = mkl and wrote["mkl_vml"] != now["mkl_vml"]
    return cap or vendor, cap or vendor or branch


def bitwise_or_refused(case: str, path: str, check: Any) -> None:
    """``check()`` (restores compared with the golden states) passes here, or is refused
    with the documented reason where this machine gives other bits than the writer's."""
    from lowdiff_store.errors import LowdiffError
    must, may = refusal(case, path)
    old = not describe_log(path)["numerics"]
    try:
        check()
    except LowdiffError as e:
        if e.reason == "numerics_mismatch" and may:
            return
        if e.reason == "replay_diverged" and old and "records no numerics" in str(e) \
                and _vector(EXPECTED[case]["written_on"]["aten_cpu"]) != \
                _vector(here()["aten_cpu"]):
            return
        raise
    assert not must, f"{case}: replayed where its bits are not this machine's"


def check_restores(case: str, path: str) -> None:
    """Every expected restore of ``case`` (the newest step through the default), or the
    refusal of :func:`bitwise_or_refused`."""
    bitwise_or_refused(case, path, lambda: _check_restores(case, path))


def _check_restores(case: str, path: str) -> None:
    exp = EXPECTED[case]
    last = exp["recipe"]["steps"]
    for step, want in exp["restore"].items():
        res, got, aux = restore_case(case, path, None if int(step) == last else int(step))
        assert res.step == int(step)
        assert (res.base_step, res.exact, res.extra) == (
            want["base_step"], want["exact"], want["extra"]), res.notes
        check_state(f"{case}: restore of step {step}", got, exp["steps"][step])
        check_state(f"{case}: restore of step {step}, scheduler/scaler/residuals/RNG", aux,
                    want["aux"])


def check_replay_states(case: str, path: str) -> None:
    """``replay_state`` of every expected step (grad mode: the recorded optimizer class is
    rebuilt from the allow-list, DeMo included, without an optimizer_factory), or the
    refusal of :func:`bitwise_or_refused`."""
    bitwise_or_refused(case, path, lambda: _check_replay_states(case, path))


def _check_replay_states(case: str, path: str) -> None:
    for step, want in EXPECTED[case]["steps"].items():
        state, opt = replay_state(path, int(step), with_optimizer=True)
        check_state(f"{case}: replay_state of step {step}", R.replayed_entries(state, opt),
                    want)


# ---------------------------------------------------------------------------- every case


@pytest.mark.parametrize("case", ON_DISK)
def test_verify(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = golden_copy(case, tmp_path)
    rep = verify_log(path)
    assert rep.ok, [str(p) for p in rep.problems]
    assert rep.records >= EXPECTED[case]["recipe"]["steps"]
    assert rep.bases >= 2
    assert cli.main(["verify", path]) == 0, capsys.readouterr()


@pytest.mark.parametrize("case", ON_DISK)
def test_inspect(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = golden_copy(case, tmp_path)
    want = EXPECTED[case]["inspect"]
    info = inspect_log(path)
    assert info["durable_step"] == want["durable_step"]
    assert info["health"] == "ok"
    if "bases" in want:
        assert info["bases"] == want["bases"]
    else:
        assert (info["sharded"], info["world_size"]) == (True, want["world_size"])
    d = describe_log(path)
    # inspect names the class the log's optimizer resolves to today: a class that moved
    # since the log was written (DeMo: lowdiff_store.torch.demo_optim -> compressors.demo)
    # is shown under its current name
    assert (d["mode"], d["optimizer"]) == (want["mode"], current_class_name(want["optimizer"]))
    assert cli.main(["inspect", "--json", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["durable_step"] == want["durable_step"]
    assert out["torch"]["optimizer"] == current_class_name(want["optimizer"])


@pytest.mark.parametrize("case", ON_DISK)
def test_restore_bitwise(case: str, tmp_path: Path) -> None:
    """The newest step (base 4 + 3 diffs) and step 3 (base 0 + 3 diffs), into fresh
    objects; a 2-rank case into a plain model in this one process (resharded)."""
    check_restores(case, golden_copy(case, tmp_path))


@pytest.mark.parametrize("case", ON_DISK)
def test_replay_state_bitwise(case: str, tmp_path: Path) -> None:
    check_replay_states(case, golden_copy(case, tmp_path))


def test_cli_processes(tmp_path: Path) -> None:
    """``python -m lowdiff_store``: verify exits 0 on a single log and an FSDP2 checkpoint;
    ``replay --to-step 3`` writes step 3's parameters and buffers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for case in ("grad_adamw", "fsdp2"):
        path = golden_copy(case, tmp_path)
        p = subprocess.run([sys.executable, "-m", "lowdiff_store", "verify", path], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (case, p.stdout, p.stderr)
    out = tmp_path / "s3.safetensors"
    p = subprocess.run([sys.executable, "-m", "lowdiff_store", "replay",
                        str(tmp_path / "grad_adamw"), "--to-step", "3", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    if refusal("grad_adamw", str(tmp_path / "grad_adamw"))[0]:  # other kernels here
        assert (p.returncode, p.stderr.count("\n")) == (1, 1), (p.stdout, p.stderr)
        assert "numerics_mismatch" in p.stderr
        assert not out.exists()
        return
    assert p.returncode == 0, (p.stdout, p.stderr)
    from safetensors.torch import load_file

    got = {f"model/{k}": R.entry_sha(v)[:16] for k, v in load_file(str(out)).items()}
    want = EXPECTED["grad_adamw"]["steps"]["3"]["entries"]
    assert got == {k: v for k, v in want.items() if k.startswith("model/")}


# ---------------------------------------------------------------------------- it can fail


@pytest.mark.parametrize(("case", "file"), [
    ("grad_adamw", "seg-0000000000000000.ldlog"),
    ("grad_adamw", "base-0000000000000004.safetensors"),
    ("ddp_allreduce", "rank-00001/seg-0000000000000000.ldlog"),
])
def test_flipped_byte_is_reported(case: str, file: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One byte flipped in a copy of a golden log (mid-segment: a record with valid ones
    after it; or inside a base's last tensor): verify names the file, the CLI exits 3."""
    path = golden_copy(case, tmp_path)
    target = Path(path) / file
    data = bytearray(target.read_bytes())
    at = len(data) // 2 if file.endswith(".ldlog") else len(data) - 3
    data[at] ^= 0x40
    target.write_bytes(bytes(data))
    rep = verify_log(path)
    assert not rep.ok
    assert any(Path(file).name in str(p) for p in rep.problems), [str(p) for p in rep.problems]
    capsys.readouterr()
    assert cli.main(["verify", path]) == EXIT_CORRUPT
    assert Path(file).name in capsys.readouterr().out


# ---------------------------------------------------------------------------- background


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_background_log_continues_with_the_worker(tmp_path: Path, writer: str) -> None:
    """The log written with ``base_mode="background"``, restored and continued with
    background bases to step 9: the worker process makes base 8, and the log restores to
    the state training had after step 9. ``process``: continued through a writer process
    (a log an earlier version wrote, opened, merged and grown by it)."""
    case = "background"
    exp = EXPECTED[case]
    recipe = exp["recipe"]
    path = golden_copy(case, tmp_path)
    if refusal(case, path)[0]:
        pytest.skip("this machine's kernels give other bits than the writer's: every "
                    "restore of the case is refused here (test_restore_bitwise says so)")
    o = R.build(recipe)
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler)
    assert res.step == recipe["steps"]
    o.extra.update(res.extra)
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, **R.checkpointer_kwargs(recipe, o),
                            writer_process=writer == "process")
    for t in range(recipe["steps"] + 1, exp["continue"]["step"] + 1):
        R.train_step(recipe, o, t)
    ckpt.close()
    st = ckpt.stats()
    assert (st["background_done"], st["background_failed"]) == (1, 0), st
    assert st["writer_process"] == (1.0 if writer == "process" else 0.0)
    # continued under other numerics than the writer's (another ATen capability or MKL
    # branch), the log records a second run and starts it with a base at step 7
    runs = describe_log(path)["numerics"]
    wrote, now = exp["written_on"], here()
    assert (len(runs) == 1) == all(runs[0][k] == now[k] for k in now), (runs, now)
    assert (len(runs) == 1) == (wrote == {**wrote, **now})
    assert inspect_log(path)["bases"] == ([0, 4, 8] if len(runs) == 1 else [0, 4, 7, 8])
    assert verify_log(path).ok
    trained = R.live_entries(o)
    o2 = R.build(recipe)
    assert restore(path, o2.model, o2.optimizer, scheduler=o2.scheduler).step == 9
    assert R.live_entries(o2) == trained, "restore of step 9 is not the state trained"
    if trains_like_the_writer():
        check_state("background: training continued to step 9", trained, exp["continue"])


def trains_like_the_writer() -> bool:
    """Training's own bits (forward and backward: MKL's matrix products) are those of the
    machine that wrote the background case (``written_on``): its CPU vendor, MKL branch
    and class of ATen kernels. Elsewhere steps trained after a restore give other bits, and
    the test compares the restore with the training it did itself."""
    wrote, now = EXPECTED["background"]["written_on"], here()
    return (wrote["cpu_vendor"], wrote["mkl_vml"], _vector(wrote["aten_cpu"])) == \
        (now["cpu_vendor"], now["mkl_vml"], _vector(now["aten_cpu"]))


# ---------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is needed")
@pytest.mark.parametrize("case", SHARDED)
def test_two_rank_restore_bitwise(case: str, tmp_path: Path) -> None:
    """Each 2-rank checkpoint restored by 2 spawned ranks into the layout it was written
    with (DDP, ZeRO, FSDP2): the gathered state and each rank's RNG, scheduler, extra."""
    exp = EXPECTED[case]
    path = golden_copy(case, tmp_path)
    if refusal(case, path)[0]:
        pytest.skip("this machine's kernels give other bits than the writer's: the restore "
                    "is refused here (test_restore_bitwise checks the refusal)")
    ranks = R.launch("restore", exp["recipe"], path, str(tmp_path / "out"))
    for step, want in exp["steps"].items():
        check_state(f"{case}: 2-rank restore of step {step}",
                    R.merge_ranks([r[step]["entries"] for r in ranks]), want)
    last = str(exp["recipe"]["steps"])
    for r, (got, want) in enumerate(zip(ranks, exp["ranks"], strict=True)):
        check_state(f"{case}: rank {r} aux", got[last]["aux"], want["aux"])
        assert got[last]["extra"] == want["extra"]


# ---------------------------------------------------------------------------- s3


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("boto3", reason="boto3 (lowdiff-store[s3]) is not installed")
    home = str(tmp_path_factory.mktemp("moto"))
    with R.moto_server(home) as endpoint:
        yield endpoint, home


def test_s3_log_from_a_fresh_bucket(moto_endpoint: tuple[str, str],
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The dumped objects of the ``s3://`` log uploaded into a fresh bucket: verify, inspect,
    restore and replay_state from ``s3://`` give the golden states."""
    endpoint, home = moto_endpoint
    case = "s3"
    exp = EXPECTED[case]
    for var in R.S3_UNSET:
        monkeypatch.delenv(var, raising=False)
    for k, v in R.s3_environ(endpoint, home).items():
        monkeypatch.setenv(k, v)
    client = R.s3_client(endpoint)
    bucket = f"golden-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    objects = GOLDEN / "logs" / case / "objects"
    files = sorted(p for p in objects.rglob("*") if p.is_file())
    assert files
    for f in files:
        client.put_object(Bucket=bucket, Key=f.relative_to(objects).as_posix(),
                          Body=f.read_bytes())
    url = f"s3://{bucket}/{exp['s3']['prefix']}"
    rep = verify_log(url)
    assert rep.ok, [str(p) for p in rep.problems]
    assert cli.main(["verify", url]) == 0
    assert inspect_log(url)["bases"] == exp["inspect"]["bases"]
    assert describe_log(url)["optimizer"] == exp["inspect"]["optimizer"]
    capsys.readouterr()
    assert cli.main(["inspect", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["durable_step"] == exp["inspect"]["durable_step"]
    check_restores(case, url)
    check_replay_states(case, url)
