"""Meeting the checkpoint ecosystem, with the real libraries: exports to DCP
(``torch.distributed.checkpoint.load`` reads them back bitwise) and to Hugging Face sharded
safetensors (``transformers``' ``from_pretrained``), and logs that start from an existing
DCP or safetensors checkpoint without copying it (reference bases), including the hostile
cases: the external checkpoint replaced, truncated or removed after the log started, a DCP
``.metadata`` that does not match its files, an index naming a missing shard."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lowdiff_store import LowdiffError, Reason, StorageError
from lowdiff_store.compaction import compact
from lowdiff_store.log import LogReader
from lowdiff_store.log.reference import ReferenceBase
from lowdiff_store.storage import atomic_publish_dir
from lowdiff_store.torch import (
    DiffCheckpointer,
    InitialBase,
    TorchMaterializer,
    export_state,
    replay_state,
    restore,
)
from tests.helpers.cli import run_cli as cli_run
from tests.helpers.tiny import build, train

ROOT = Path(__file__).resolve().parent.parent.parent




def same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            same_state(x, y)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype, k
            assert x.shape == y.shape, k
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), k
        else:
            assert x == y, k


def opt_tensors(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {str(i): {k: v for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}




def one_line(e: BaseException | str, *needles: str) -> None:
    text = str(e).strip()
    assert "\n" not in text, text
    assert "Traceback" not in text, text
    for n in needles:
        assert n in text, (n, text)


@pytest.fixture
def trained_log(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    m, opt = build()
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=3):
        train(m, opt, 0, 5)
    return tmp_path / "log", m, opt


def dcp_save(path: Path, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=str(path), no_dist=True)


def dcp_load_into(path: Path, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """What a DCP user does: state dicts of the live objects, load, set."""
    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: this process alone
        dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, opt, sd["optim"])


# ------------------------------------------------------------------------ export: DCP


def test_export_dcp_loads_bitwise_into_a_plain_model(trained_log: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    log, m, opt = trained_log
    out = tmp_path / "dcp"
    rc, stdout, err = cli_run(["replay", str(log), "--out", str(out), "--format", "dcp",
                               "--with-optimizer", "--json"], capsys)
    assert rc == 0, err
    summary = json.loads(stdout)
    assert summary["format"] == "dcp"
    assert summary["step"] == 5
    assert summary["model_tensors"] == 6
    assert summary["optimizer_tensors"] == 18
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
    m2, opt2 = build(seed=7)
    dcp_load_into(out, m2, opt2)
    same_state(m2.state_dict(), m.state_dict())
    same_state(opt_tensors(opt2), opt_tensors(opt))
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert opt2.param_groups[0]["weight_decay"] == 0.01
    # training on from the loaded objects is training on from the original ones
    train(m, opt, 5, 8)
    train(m2, opt2, 5, 8)
    same_state(m2.state_dict(), m.state_dict())
    # the model alone, by the API
    res = export_state(replay_state(log)[0], tmp_path / "model_only", format="dcp")
    assert (res.model_tensors, res.optimizer_tensors) == (6, 0)
    sd = {"model": {k: torch.empty_like(v) for k, v in m.state_dict().items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "model_only"), no_dist=True)
    same_state(sd["model"], replay_state(log)[0])


def test_export_directory_refusals(trained_log: Any, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    log, _m, _o = trained_log
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_bytes(b"keep")
    rc, _out, err = cli_run(["replay", str(log), "--out", str(taken), "--format", "dcp"],
                            capsys)
    assert rc == 1
    one_line(err, str(taken), "io_error")
    assert os.listdir(taken) == ["x"]
    rc, _out, err = cli_run(["replay", str(log), "--out", str(tmp_path / "h"), "--format",
                             "hf", "--with-optimizer"], capsys)
    assert rc == 2
    assert not (tmp_path / "h").exists()
    one_line(err, "--format dcp")
    rc, _out, err = cli_run(["replay", str(log), "--out", str(tmp_path / "h"), "--format",
                             "hf", "--max-shard-size", "lots"], capsys)
    assert rc == 2
    assert not (tmp_path / "h").exists()
    rc, _out, err = cli_run(["replay", str(log), "--out", str(tmp_path / "no" / "d"),
                             "--format", "dcp"], capsys)
    assert rc == 1
    one_line(err, "does not exist")
    (tmp_path / "empty_ok").mkdir()
    rc, _o, _e = cli_run(["replay", str(log), "--out", str(tmp_path / "empty_ok"),
                          "--format", "dcp"], capsys)
    assert rc == 0


def test_failed_directory_publish_leaves_nothing(tmp_path: Path) -> None:
    def fill(tmp: str) -> None:
        Path(tmp, "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(StorageError) as ei:
        atomic_publish_dir(tmp_path / "out", fill)
    assert ei.value.errno == errno.ENOSPC
    one_line(ei.value, str(tmp_path / "out"), "io_error")
    assert os.listdir(tmp_path) == []


def test_killed_export_leaves_nothing_that_looks_complete(trained_log: Any,
                                                          tmp_path: Path) -> None:
    log, _m, _o = trained_log
    out = tmp_path / "exp" / "hf"
    out.parent.mkdir()
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from lowdiff_store.torch import export_state, replay_state
from lowdiff_store.torch.replay import checkpoint_dirs
real = checkpoint_dirs.safetensors_chunks
calls = []
def dying(part, meta):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(part, meta)
checkpoint_dirs.safetensors_chunks = dying
export_state(replay_state({str(log)!r})[0], {str(out)!r}, format="hf", max_shard_bytes=64)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    left = os.listdir(out.parent)
    assert not out.exists()
    assert len(left) == 1
    assert left[0].startswith(".hf.")
    assert left[0].endswith(".tmp")


# ------------------------------------------------------------------------ export: HF


def _gpt2(seed: int) -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return cfg, transformers.GPT2LMHeadModel(cfg)


def _gpt2_train(model: Any, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for t in range(start, stop):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(t))
        opt.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()
        opt.step()


def test_export_hf_sharded_loads_with_from_pretrained(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    cfg, model = _gpt2(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=2):
        _gpt2_train(model, opt, 0, 3)
    conf = tmp_path / "config.json"
    conf.write_text(cfg.to_json_string())
    out = tmp_path / "hf"
    rc, _o, err = cli_run(["replay", str(tmp_path / "log"), "--out", str(out), "--format",
                           "hf", "--max-shard-size", "10KB", "--hf-config", str(conf)],
                          capsys)
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors"
                                 for k in range(1, n + 1)]
    assert sorted(os.listdir(out)) == sorted([*shards, "config.json",
                                              "model.safetensors.index.json"])
    total = 0
    for s in shards:
        with safe_open(str(out / s), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                     for k in f.keys()]
        assert sum(sizes) <= 10_000 or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    same_state(dict(loaded.state_dict()), dict(model.state_dict()))


# ------------------------------------------------------- starting from a DCP checkpoint


@pytest.fixture
def dcp_start(tmp_path: Path) -> dict[str, Any]:
    """A run trained 3 steps and saved with torch's own dcp.save, then a new log started
    from that checkpoint (the import: switching checkpoint libraries mid-run), trained on
    to step 4, next to the original run trained on without any checkpointer."""
    src_m, src_opt = build(0)
    train(src_m, src_opt, 0, 3)
    ck = tmp_path / "ck"
    dcp_save(ck, src_m, src_opt)
    m, opt = build(seed=5)  # other weights: the checkpoint must replace them
    ckpt = DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=100, initial_base=ck)
    same_state(m.state_dict(), src_m.state_dict())
    same_state(opt_tensors(opt), opt_tensors(src_opt))
    start = {k: v.clone() for k, v in m.state_dict().items()}
    train(m, opt, 3, 7)
    ckpt.close()
    train(src_m, src_opt, 3, 7)
    return {"ck": ck, "log": tmp_path / "log", "model": m, "opt": opt, "src": src_m,
            "start": start}


def test_initial_base_dcp_is_referenced_not_copied(dcp_start: dict[str, Any]) -> None:
    log, m = dcp_start["log"], dcp_start["model"]
    same_state(m.state_dict(), dcp_start["src"].state_dict())  # same run, other library
    with LogReader(log) as r:
        assert r.bases == [0]
        with r.base(0) as b:
            assert isinstance(b, ReferenceBase)
            assert b.file.names == ["@rng/cpu"]  # every tensor of the state is referenced
            ref = b.reference
            assert ref.kind == "dcp"
            assert ref.root == str(dcp_start["ck"])
            assert [f.name for f in ref.files] == [".metadata", "__0_0.distcp"]
            assert ref.files[1].size == os.path.getsize(dcp_start["ck"] / "__0_0.distcp")
            assert {t.name: t.key for t in ref.tensors}["0.weight"] == "model.0.weight"
            assert {t.name: t.key for t in ref.tensors}["@opt/3.bias/exp_avg_sq"] == \
                "optim.state.3.bias.exp_avg_sq"
            assert len(ref.tensors) == 6 + 18
            b.verify_all()
    base_file = log / "base-0000000000000000.safetensors"
    assert os.path.getsize(base_file) < 12_000
    m2, opt2 = build(seed=9)
    res = restore(log, m2, opt2)
    assert (res.step, res.base_step, res.exact) == (4, 0, True)
    same_state(m2.state_dict(), m.state_dict())
    same_state(opt_tensors(opt2), opt_tensors(dcp_start["opt"]))
    same_state(replay_state(log, 0)[0], dcp_start["start"])


def test_initial_base_inspect_verify_and_compaction(dcp_start: dict[str, Any],
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    log, ck = dcp_start["log"], dcp_start["ck"]
    rc, out, _e = cli_run(["inspect", str(log), "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    assert info["health"] == "ok"
    assert info["references"]["0"]["kind"] == "dcp"
    assert info["references"]["0"]["root"] == str(ck)
    assert info["references"]["0"]["tensors"] == 24
    rc, out, _e = cli_run(["inspect", str(log)], capsys)
    assert f"dcp checkpoint {ck}" in out
    assert "not copied" in out
    rc, out, _e = cli_run(["verify", str(log)], capsys)
    assert rc == 0, out
    before = {p: (ck / p).read_bytes() for p in os.listdir(ck)}
    res = compact(str(log), keep_bases=1, materializer=TorchMaterializer(log))
    assert res.plan.delete_bases == [0]
    assert res.plan.new_base == 4
    with LogReader(log) as r:
        assert r.bases == [4]
        with r.base(4) as b:
            assert not isinstance(b, ReferenceBase)
            assert "0.weight" in b.names
    rc, out, _e = cli_run(["inspect", str(log), "--json"], capsys)
    assert json.loads(out)["references"] == {}
    assert {p: (ck / p).read_bytes() for p in os.listdir(ck)} == before  # never touched
    shutil.rmtree(ck)  # the log no longer needs it
    m2, opt2 = build(seed=3)
    restore(log, m2, opt2)
    same_state(m2.state_dict(), dcp_start["model"].state_dict())


def _replace_weights(ck: Path, data_only: bool = False) -> None:
    """Save other weights (one step more: same names, shapes and file sizes) over ``ck``;
    ``data_only``: only the data file is replaced, the recorded .metadata stays."""
    m, opt = build(0)
    train(m, opt, 0, 4)
    other = ck.parent / "other"
    dcp_save(other, m, opt)
    if data_only:
        shutil.copyfile(other / "__0_0.distcp", ck / "__0_0.distcp")
    else:
        shutil.rmtree(ck)
        other.rename(ck)


@pytest.mark.parametrize("how", ["replaced", "truncated", "removed", "metadata_removed"])
def test_changed_external_checkpoint_is_one_line_error(dcp_start: dict[str, Any], how: str,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    log, ck = dcp_start["log"], dcp_start["ck"]
    data = ck / "__0_0.distcp"
    if how == "replaced":  # a new dcp.save: its .metadata differs first (and is not read)
        _replace_weights(ck)
        reason, where = "reference_changed", ck / ".metadata"
    elif how == "truncated":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) - 1)
        reason, where = "reference_changed", data
    elif how == "removed":
        data.unlink()
        reason, where = "missing_file", data
    else:
        (ck / ".metadata").unlink()
        reason, where = "missing_file", ck / ".metadata"
    m2, opt2 = build(seed=9)
    snapshot = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(LowdiffError) as ei:
        restore(log, m2, opt2)
    assert ei.value.reason.value == reason
    one_line(ei.value, str(where), reason)
    same_state(m2.state_dict(), snapshot)  # nothing half-loaded
    with pytest.raises(LowdiffError) as ei:
        replay_state(log)
    one_line(ei.value, str(where), reason)
    rc, out, _e = cli_run(["verify", str(log)], capsys)
    assert rc == 3
    assert any(str(where) in line and reason in line for line in out.splitlines()), out
    rc, out, _e = cli_run(["inspect", str(log), "--json"], capsys)
    if how != "replaced":  # inspect reads no content: it sees files missing or resized
        assert json.loads(out)["health"] == "corrupt"
    rc, _o, err = cli_run(["replay", str(log), "--out", str(log.parent / "x.pt")], capsys)
    assert rc == 1
    assert not (log.parent / "x.pt").exists()
    one_line(err, str(where), reason)


def test_replaced_external_with_equal_sizes_found_by_tensor_and_file_crc(
        dcp_start: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    log, ck = dcp_start["log"], dcp_start["ck"]
    sizes = {p: os.path.getsize(ck / p) for p in os.listdir(ck)}
    _replace_weights(ck, data_only=True)
    assert {p: os.path.getsize(ck / p) for p in os.listdir(ck)} == sizes
    with LogReader(log) as r, r.base(0) as b:  # sizes match: opening succeeds
        with pytest.raises(LowdiffError) as ei:
            b.tensor("0.weight")
        one_line(ei.value, str(ck / "__0_0.distcp"), "reference_changed", "'model.0.weight'")
        with pytest.raises(LowdiffError) as ei:
            b.verify_all()
        assert ei.value.reason is Reason.REFERENCE_CHANGED


# ------------------------------------------------- refused before anything is written


def _nothing_written(log: Path) -> None:
    assert not log.exists() or os.listdir(log) == []


def test_dcp_metadata_not_matching_its_files(tmp_path: Path) -> None:
    m, opt = build(0)
    ck = tmp_path / "ck"
    dcp_save(ck, m, opt)
    data = ck / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(100)
    m2, opt2 = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m2, opt2, initial_base=ck)
    assert ei.value.reason is Reason.TRUNCATED
    one_line(ei.value, str(data), "does not match its files")
    _nothing_written(tmp_path / "log")
    data.unlink()
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m2, opt2, initial_base=ck)
    assert ei.value.reason is Reason.MISSING_FILE
    one_line(ei.value, str(data))
    (ck / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m2, opt2, initial_base=ck)
    assert ei.value.reason is Reason.BAD_METADATA
    one_line(ei.value, str(ck / ".metadata"))
    _nothing_written(tmp_path / "log")
    same_state(m2.state_dict(), build(1)[0].state_dict())


def test_checkpoint_without_a_parameter_is_refused(tmp_path: Path) -> None:
    m, _opt = build(0)
    ck = tmp_path / "ck"
    sd = {k: v for k, v in get_model_state_dict(m).items() if k != "3.bias"}
    dcp.save({"model": sd}, checkpoint_id=str(ck), no_dist=True)
    m2, opt2 = build(1)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", m2, opt2, initial_base=ck)
    assert ei.value.reason is Reason.STATE_MISMATCH
    one_line(ei.value, "'3.bias'", "'model.3.bias'")
    _nothing_written(tmp_path / "log")
    with pytest.raises(LowdiffError) as ei:  # an existing log is not restarted
        m3, o3 = build(0)
        DiffCheckpointer(tmp_path / "log2", m3, o3).close()
        DiffCheckpointer(tmp_path / "log2", m2, opt2, initial_base=ck)
    assert ei.value.reason is Reason.HISTORY_CONFLICT


# ---------------------------------------- starting from (sharded) safetensors checkpoints


def test_initial_base_hf_sharded_safetensors(tmp_path: Path) -> None:
    _cfg, src = _gpt2(0)
    hf = tmp_path / "hf"
    src.save_pretrained(str(hf), max_shard_size="10KB")
    shards = sorted(p for p in os.listdir(hf) if p.endswith(".safetensors"))
    assert len(shards) >= 3
    assert (hf / "model.safetensors.index.json").exists()
    _cfg, model = _gpt2(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100,
                          initial_base=InitialBase(str(hf)))
    same_state(dict(model.state_dict()), dict(src.state_dict()))
    _gpt2_train(model, opt, 0, 3)
    ck.close()
    with LogReader(tmp_path / "log") as r, r.base(0) as b:
        assert isinstance(b, ReferenceBase)
        assert b.reference.kind == "safetensors"
        assert sorted(f.name for f in b.reference.files) == shards
        keys = {t.key for t in b.reference.tensors}
        assert "transformer.wte.weight" in keys
        assert "lm_head.weight" not in keys
    _cfg, again = _gpt2(2)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    restore(tmp_path / "log", again, opt2)
    same_state(dict(again.state_dict()), dict(model.state_dict()))
    # a shard replaced after the log started
    victim = hf / shards[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x01
    victim.write_bytes(bytes(raw))
    _cfg, third = _gpt2(3)
    with pytest.raises(LowdiffError) as ei:
        restore(tmp_path / "log", third, torch.optim.AdamW(third.parameters(), lr=1e-3))
    assert ei.value.reason is Reason.REFERENCE_CHANGED
    one_line(ei.value, str(victim))


def test_safetensors_index_naming_a_missing_shard(tmp_path: Path) -> None:
    _cfg, src = _gpt2(0)
    hf = tmp_path / "hf"
    src.save_pretrained(str(hf), max_shard_size="10KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (hf / gone).unlink()
    _cfg, model = _gpt2(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", model, opt, initial_base=hf)
    assert ei.value.reason is Reason.MISSING_FILE
    one_line(ei.value, str(hf / gone))
    _nothing_written(tmp_path / "log")
    same_state(dict(model.state_dict()), before)
    index["weight_map"]["transformer.wpe.weight"] = "../outside.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LowdiffError) as ei:
        DiffCheckpointer(tmp_path / "log", model, opt, initial_base=hf)
    assert ei.value.reason is Reason.UNSAFE_NAME
    _nothing_written(tmp_path / "log")


def test_initial_base_single_safetensors_file_with_a_buffer_it_lacks(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    m, _o = build(0)
    f = tmp_path / "w.safetensors"
    save_file({k: v for k, v in m.state_dict().items() if k != "1.bias"}, str(f))
    m2, opt2 = build(1)
    with pytest.raises(LowdiffError):  # 1.bias is a parameter: required
        DiffCheckpointer(tmp_path / "log", m2, opt2, initial_base=f)
    m3 = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    save_file({k: v for k, v in m3.state_dict().items() if "running" not in k}, str(f))
    torch.manual_seed(4)
    m4 = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    m4[1].running_mean.fill_(0.5)
    opt4 = torch.optim.SGD(m4.parameters(), lr=0.1)
    with DiffCheckpointer(tmp_path / "log", m4, opt4, initial_base=f) as ck:
        assert torch.equal(m4[0].weight, m3[0].weight)
        assert torch.equal(m4[1].running_mean, torch.full((5,), 0.5))  # not in the file: kept
        for t in range(3):
            opt4.zero_grad()
            m4(torch.randn(4, 6, generator=torch.Generator().manual_seed(t))).sum().backward()
            opt4.step()
        ck.flush()
    with LogReader(tmp_path / "log") as r, r.base(0) as b:
        assert "1.running_mean" in b.file.names
        assert "0.weight" not in b.file.names
    torch.manual_seed(8)
    m5 = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    restore(tmp_path / "log", m5, torch.optim.SGD(m5.parameters(), lr=0.1))
    same_state(m5.state_dict(), m4.state_dict())


def test_dcp_metadata_rewritten_in_place_is_not_handed_to_torch(
        dcp_start: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``.metadata`` is a pickle torch unpickles: a changed one (same size) is refused by its
    recorded CRC before torch's reader sees it."""
    from torch.distributed.checkpoint import filesystem

    log, ck = dcp_start["log"], dcp_start["ck"]
    meta = ck / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    meta.write_bytes(bytes(raw))
    read: list[str] = []
    real = filesystem.FileSystemReader.read_metadata

    def spy(self: Any, *a: Any, **k: Any) -> Any:
        read.append(str(self.path))
        return real(self, *a, **k)

    monkeypatch.setattr(filesystem.FileSystemReader, "read_metadata", spy)
    m2, opt2 = build(seed=9)
    with pytest.raises(LowdiffError) as ei:
        restore(log, m2, opt2)
    assert ei.value.reason is Reason.REFERENCE_CHANGED
    one_line(ei.value, str(meta), "not read")
    assert read == []


def test_import_by_copy(tmp_path: Path) -> None:
    """``InitialBase(path, copy=True)``: the same import, with base 0 an owned copy: the
    log outlives the checkpoint it came from."""
    src, src_opt = build(0)
    train(src, src_opt, 0, 3)
    ck = tmp_path / "ck"
    dcp_save(ck, src, src_opt)
    m, opt = build(seed=5)
    with DiffCheckpointer(tmp_path / "log", m, opt, initial_base=InitialBase(str(ck),
                                                                              copy=True)):
        same_state(opt_tensors(opt), opt_tensors(src_opt))
        train(m, opt, 3, 5)
    shutil.rmtree(ck)
    with LogReader(tmp_path / "log") as r, r.base(0) as b:
        assert not isinstance(b, ReferenceBase)
        assert "0.weight" in b.names
    m2, opt2 = build(seed=9)
    restore(tmp_path / "log", m2, opt2)
    same_state(m2.state_dict(), m.state_dict())
