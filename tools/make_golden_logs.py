#!/usr/bin/env python3
"""Write the golden logs of issue 23 (``tests/golden/logs/``, ``tests/golden/expected.json``).

Small logs written by the code of the day they were made (per case ``written_by`` and the
machine's numerics ``written_on`` in ``expected.json``: d13c252 on an AMD EPYC, the AdamW
and Adam cases again on an Intel Xeon for issue 48), frozen, so that
``tests/test_golden_logs.py`` proves later code still opens, verifies and restores them bit
for bit. **Regenerate only for a deliberate format change** (and say so in
``format_spec/CHANGES.md``): regenerating after a refactoring hides exactly the breakage
the logs are there to catch. ``.venv/bin/python tools/make_golden_logs.py``
rewrites every case (``--only CASE``: one of them; ``--out DIR``: elsewhere, to try it),
checking each log with the code that wrote it (restore and ``replay_state`` against the
live training state, the 2-rank cases also restored on 2 ranks). About 3 minutes on 2 cores.

Every case trains a tiny model (a few hundred to ~750 parameters, models and batches in
``tests/golden/recipes.py``, seeded) for 7 steps with a base every 4 (bases 0 and 4) and a
digest every 2 steps: restoring step 7 replays 5-7 from base 4, step 3 replays 1-3 from
base 0. The cases marked *dropout* draw from the global RNG every step, so their records
carry the RNG state (5 KB each; the others leave dropout out to keep the tree small,
about 2 MB). ``expected.json`` holds per case the recipe (how to rebuild the objects), the
canonical state after step 3 and step 7 (parameters, buffers, optimizer state tensors and
scalars, hyperparameters: a sha256 per entry and one of the whole), what a restore sets
besides (scheduler, scaler, residuals, RNG), the restore's ``base_step``/``exact``/
``extra``, and what ``inspect`` says. The expected states are the states *training had*
(taken from the live objects), checked here against the restore of the day; for lossy
delta codecs (and a residual kept only in bases) they are the restore's reconstruction,
whose recorded digests the restore verified.

Cases (one log each):

- ``grad_adamw``: dense default capture, AdamW (``fused=True``, as every AdamW/Adam case:
  no MKL op, so the bits are every x86-64 vendor's; issue 48), StepLR, clipping, tied
  embedding/head, dropout;
- ``grad_adamw_foreach``: the same with ``foreach=True``: its replay reaches MKL's
  ``sqrt``, so it replays bitwise only on its writer's vendor and MKL branch
  (``expected.json``: ``written_on``) and is refused before the replay elsewhere;
- ``grad_sgd_momentum``: SGD with Nesterov momentum and weight decay, BatchNorm buffers,
  dropout, gradients zstd-compressed (``grad_zstd=3``);
- ``grad_layerwise``: ``capture="layerwise"`` (LowDiff+), AdamW;
- ``grad_amp_fp16``: fp16 autocast with a GradScaler, steps 2 and 6 skipped (inf loss),
  dropout;
- ``grad_topk``, ``grad_topk_ef_base``, ``grad_topk_ef_step_sampled``: TopKCompressor
  without error feedback, with residuals in bases only (restore between bases not exact:
  recorded as such), with residuals every step and ``selector="sampled"`` (the tensors are
  below its size threshold, so the selection is exact's; the log records the selector);
- ``grad_terngrad_ef_step``, ``grad_qsgd``: TernGradCompressor (error feedback),
  QSGDCompressor (stochastic rounding streams as hyperparameters);
- ``grad_demo``: DeMo with DeMoCompressor; the log records the optimizer as
  ``lowdiff_store.torch.demo_optim.DeMo``, which ``replay_state`` must keep resolving
  without an ``optimizer_factory``;
- ``delta_xor``, ``delta_q8``, ``delta_topk``, ``delta_lcc``: weight-diff mode with every
  delta codec (``delta_min_numel=64`` so the lossy codecs apply to these small tensors;
  xor with dropout);
- ``ddp_allreduce``: 2 ranks (gloo), DDP without a hook: the ranks split the gradients,
  dropout (per-rank RNG);
- ``ddp_powersgd``, ``ddp_fp16``, ``ddp_terngrad_hook``, ``ddp_qsgd_hook``: DDP
  communication hooks teed into the log (PowerSGD P/Q factors from step 4, fp16 buffers,
  TernGrad and QSGD messages);
- ``zero_topk_allgather``: ZeroRedundancyOptimizer (layout ``zero``) with the top-k
  all-gather hook, residuals every step;
- ``fsdp2``: FSDP2 ``fully_shard`` on 2 ranks (gloo, CPU), bf16 mixed precision,
  clipping over DTensors, 2 micro-batches per step, uneven shards, dropout;
- ``s3`` (dropout): written to ``s3://golden/run`` on a moto_server, the bucket's objects dumped
  to ``logs/s3/objects/<key>`` (the test uploads them into a fresh bucket);
- ``background`` (dropout): ``base_mode="background"`` (base 4 made by the worker process
  ``python -m lowdiff_store.torch._worker``); also the state after steps 8-9, for the
  test that continues the log with background bases. The log itself names neither the
  worker nor the base mode (its bases are byte for byte foreground ones): what must keep
  working is the worker spawned when such a log is continued, which that test does.

Not frozen, and why: HSDP and 4-rank meshes (4 processes on 2 cores; the 2-rank FSDP2 log
has the same per-shard format); ``bf16_compress_hook`` (the fp16 path with another dtype);
``snapshot_every="auto"`` (its decisions depend on timings, so the log is not
reproducible; its records are ordinary records plus a tuning entry); the HF Trainer and
Lightning callbacks (they write through DiffCheckpointer with extra state, covered by
``extra`` here); local-update training (Local SGD, DiLoCo: design section 9) has no
implementation in this tree.

No pickle anywhere: the logs are the library's own format, expected.json is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from lowdiff_store.torch import DiffCheckpointer, describe_log, replay_state, restore  # noqa: E402
from lowdiff_store.verify import inspect_log, verify_log  # noqa: E402
from tests.golden import recipes as R  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden")
S3_BUCKET, S3_PREFIX = "golden", "run"

_CK = {"snapshot_every": 4, "digest_every": 2}
_BASE: dict[str, Any] = {"steps": 7, "mid": 3, "checkpointer": _CK}
_ADAMW = ["AdamW", {"lr": 0.01, "weight_decay": 0.1}]
#: AdamW's fused CPU step: ATen's own vector code, no MKL op, so its logs replay bitwise on
#: every x86-64 vendor (issue 48; docs/torch.md "Exactness across machines")
_ADAMW_FUSED = ["AdamW", {"lr": 0.01, "weight_decay": 0.1, "fused": True}]
_SGD = ["SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}]
_STEP = ["StepLR", {"step_size": 3, "gamma": 0.5}]


def _r(kind: str, dropout: bool = False, **kw: Any) -> dict[str, Any]:
    ck = {**_CK, **kw.pop("checkpointer", {})}
    return {"kind": kind, "recipe": {**copy.deepcopy(_BASE), **kw, "dropout": dropout,
                                     "checkpointer": ck}}


def _topk(**kw: Any) -> list[Any]:
    return ["TopKCompressor", {"ratio": 0.1, **kw}]


def _delta(codec: str, **kw: Any) -> dict[str, Any]:
    return _r("local", codec == "xor", model="mlp_bn", optimizer=_ADAMW, scheduler=_STEP,
              checkpointer={"mode": "delta", "delta_codec": codec, "delta_min_numel": 64,
                            **kw})


def _ddp(hook: str | None, layout: str = "ddp", **kw: Any) -> dict[str, Any]:
    return _r("sharded", hook is None, model="ddp_net", layout=layout, hook=hook,
              optimizer=["AdamW", {"lr": 0.01, "weight_decay": 0.01, "fused": True}],
              scheduler=["ExponentialLR", {"gamma": 0.9}], **kw)


CASES: dict[str, dict[str, Any]] = {
    "grad_adamw": _r("local", True, model="tiny_lm", optimizer=_ADAMW_FUSED, scheduler=_STEP,
                     clip=0.5),
    # foreach AdamW reaches MKL's sqrt: its bits belong to the writer's CPU vendor and MKL
    # branch (expected.json "written_on"); elsewhere its replay is refused up front
    "grad_adamw_foreach": _r("local", True, model="tiny_lm",
                             optimizer=["AdamW", {"lr": 0.01, "weight_decay": 0.1,
                                                  "foreach": True}],
                             scheduler=_STEP, clip=0.5),
    "grad_sgd_momentum": _r("local", True, model="mlp_bn", optimizer=_SGD,
                            scheduler=["ExponentialLR", {"gamma": 0.9}],
                            checkpointer={"grad_zstd": 3}),
    "grad_layerwise": _r("local", model="mlp_bn", optimizer=_ADAMW_FUSED,
                         checkpointer={"capture": "layerwise"}),
    "grad_amp_fp16": _r("local", True, model="mlp_bn",
                        optimizer=["Adam", {"lr": 0.01, "fused": True}],
                        scaler={"init_scale": 1024.0, "growth_interval": 2}, amp="float16",
                        inf_steps=[2, 6], clip=1.0),
    "grad_topk": _r("local", model="mlp_bn", optimizer=_SGD,
                    compressor=_topk(error_feedback=False)),
    "grad_topk_ef_base": _r("local", model="mlp_bn", optimizer=_SGD,
                            compressor=_topk(error_feedback=True)),
    "grad_topk_ef_step_sampled": _r("local", model="mlp_bn", optimizer=_SGD,
                                    compressor=_topk(error_feedback=True, selector="sampled"),
                                    checkpointer={"ef_state": "step"}),
    "grad_terngrad_ef_step": _r("local", model="mlp_bn", optimizer=_SGD,
                                compressor=["TernGradCompressor", {
                                    "min_numel": 64, "seed": 7, "error_feedback": True}],
                                checkpointer={"ef_state": "step"}),
    "grad_qsgd": _r("local", model="mlp_bn", optimizer=_SGD,
                    compressor=["QSGDCompressor", {"levels": 3, "bucket": 32,
                                                   "min_numel": 64, "seed": 7}]),
    "grad_demo": _r("local", model="mlp_bn", optimizer=["DeMo", {"lr": 0.01,
                                                                 "weight_decay": 0.01}],
                    scheduler=_STEP,
                    compressor=["DeMoCompressor", {"decay": 0.9, "topk": 4, "chunk": 8}],
                    checkpointer={"ef_state": "step"}),
    "delta_xor": _delta("xor"),
    "delta_q8": _delta("q8", delta_block=32),
    "delta_topk": _delta("topk", delta_ratio=0.25),
    "delta_lcc": _delta("lcc", delta_bits=3),
    "ddp_allreduce": _ddp(None),
    "ddp_powersgd": _ddp("powersgd"),
    "ddp_fp16": _ddp("fp16"),
    "ddp_terngrad_hook": _ddp("terngrad"),
    "ddp_qsgd_hook": _ddp("qsgd"),
    "zero_topk_allgather": _ddp("topk", layout="zero", checkpointer={"ef_state": "step"}),
    "fsdp2": _r("sharded", True, model="fsdp_net", layout="fsdp", mp=True, clip=0.05, accum=2,
                optimizer=["AdamW", {"lr": 0.01, "weight_decay": 0.01, "fused": True}],
                scheduler=["ExponentialLR", {"gamma": 0.9}]),
    "s3": _r("s3", True, model="mlp_bn", optimizer=_ADAMW_FUSED, scheduler=_STEP),
    "background": _r("local", True, model="mlp_bn", optimizer=_ADAMW_FUSED, scheduler=_STEP,
                     checkpointer={"base_mode": "background"}),
}
#: the background case's continuation: the state after this step is recorded too
CONTINUE_TO = 9


def _state(entries: dict[str, str]) -> dict[str, Any]:
    """The digest, and each entry's sha256 cut to 16 digits (to name what differs)."""
    return {"sha256": R.digest(entries), "entries": R.short(entries)}


def _same(what: str, got: dict[str, str], want: dict[str, str]) -> None:
    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    assert not bad, f"{what}: differs in {bad}"


def _inspect(path: str) -> dict[str, Any]:
    info = inspect_log(path)
    d = describe_log(path)
    out = {"durable_step": info["durable_step"], "mode": d["mode"],
           "optimizer": d["optimizer"]}
    if info.get("sharded"):
        out["world_size"] = info["world_size"]
    else:
        out["bases"] = info["bases"]
    return out


def _check_log(path: str) -> None:
    rep = verify_log(path)
    assert rep.ok, [str(p) for p in rep.problems]
    cli = subprocess.run([sys.executable, "-m", "lowdiff_store", "verify", path],
                         env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr


def _restored(recipe: dict[str, Any], path: str, step: int | None, layout: str | None,
              rng: bool) -> tuple[Any, dict[str, str], dict[str, str]]:
    o = R.build(recipe, layout=layout)
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                  compressor=o.compressor, step=step)
    return res, R.live_entries(o), R.aux_entries(o, rng=rng)


def _restores(recipe: dict[str, Any], path: str, live: dict[int, dict[str, Any]],
              lossy: bool, sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore each step into fresh objects, compare with training; the expectations."""
    steps: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for t in (recipe["steps"], recipe["mid"]):
        res, ent, aux = _restored(recipe, path, t, "plain" if sharded else None,
                                  rng=not sharded)
        assert res.step == t
        if not lossy:
            _same(f"restore of step {t}", ent, live[t]["entries"])
        else:
            assert res.verified, "lossy delta: the restore checked no digest"
        if not sharded:
            want = live[t]["aux"]
            if res.exact and not lossy:
                _same(f"restore of step {t}: aux", aux, want)
            else:  # what cannot be rebuilt: only residuals (and lossy state) may differ
                _same(f"restore of step {t}: aux", {k: v for k, v in aux.items()
                                                    if not k.startswith("ef/")},
                      {k: v for k, v in want.items() if not k.startswith("ef/")})
        state, opt = replay_state(path, t, with_optimizer=True)
        _same(f"replay_state of step {t}", R.replayed_entries(state, opt), ent)
        steps[str(t)] = _state(ent)
        rest[str(t)] = {"base_step": res.base_step, "exact": res.exact, "extra": res.extra,
                        "aux": _state(aux)}
    return steps, rest


def _train_local(name: str, case: dict[str, Any], path: str) -> dict[int, dict[str, Any]]:
    recipe = case["recipe"]
    o = R.build(recipe)
    ckpt = DiffCheckpointer(path, o.model, o.optimizer, **R.checkpointer_kwargs(recipe, o))
    live: dict[int, dict[str, Any]] = {}
    for t in range(1, recipe["steps"] + 1):
        R.train_step(recipe, o, t)
        if t in (recipe["mid"], recipe["steps"]):
            live[t] = {"entries": R.live_entries(o), "aux": R.aux_entries(o)}
    ckpt.close()
    if name == "background":
        st = ckpt.stats()
        assert st["background_done"] >= 1, st
        assert st["background_failed"] == 0, st
        for t in range(recipe["steps"] + 1, CONTINUE_TO + 1):  # without a checkpointer
            R.train_step(recipe, o, t)
        live[CONTINUE_TO] = {"entries": R.live_entries(o)}
    return live


def make_local(name: str, case: dict[str, Any], path: str) -> dict[str, Any]:
    recipe = case["recipe"]
    live = _train_local(name, case, path)
    _check_log(path)
    lossy = recipe["checkpointer"].get("delta_codec", "xor") != "xor"
    steps, rest = _restores(recipe, path, live, lossy, sharded=False)
    out = {**case, "lossy": lossy, "inspect": _inspect(path), "steps": steps,
           "restore": rest}
    if name == "background":
        out["continue"] = {"step": CONTINUE_TO, **_state(live[CONTINUE_TO]["entries"])}
    return out


def make_sharded(name: str, case: dict[str, Any], path: str) -> dict[str, Any]:
    recipe = case["recipe"]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = R.launch("train", recipe, path, tmp)
        for r in ranks:
            assert r["stats"].get("tee_fallbacks", 0) == 0, r["stats"]
        live = {t: {"entries": R.merge_ranks([r[str(t)] for r in ranks])}
                for t in (recipe["mid"], recipe["steps"])}
        _check_log(path)
        steps, rest = _restores(recipe, path, live, False, sharded=True)
        # the 2-rank restore (what the slow test runs): each rank's state and RNG
        back = R.launch("restore", recipe, path, os.path.join(tmp, "restore"))
    for t in (recipe["mid"], recipe["steps"]):
        _same(f"2-rank restore of step {t}",
              R.merge_ranks([b[str(t)]["entries"] for b in back]), live[t]["entries"])
    for rank, b in enumerate(back):
        _same(f"2-rank restore, rank {rank}: aux", b[str(recipe["steps"])]["aux"],
              ranks[rank]["aux"])
    return {**case, "lossy": False, "inspect": _inspect(path), "steps": steps,
            "restore": rest, "ranks": [{"aux": _state(r["aux"]), "extra": r["extra"]}
                                       for r in ranks]}


def make_s3(name: str, case: dict[str, Any], path: str) -> dict[str, Any]:
    recipe = case["recipe"]
    with tempfile.TemporaryDirectory() as tmp, R.moto_server(tmp) as endpoint:
        saved = {k: os.environ.get(k) for k in (*R.S3_UNSET, *R.s3_environ(endpoint, tmp))}
        for k in R.S3_UNSET:
            os.environ.pop(k, None)
        os.environ.update(R.s3_environ(endpoint, tmp))
        try:
            client = R.s3_client(endpoint)
            client.create_bucket(Bucket=S3_BUCKET)
            url = f"s3://{S3_BUCKET}/{S3_PREFIX}"
            live = _train_local(name, case, url)
            _check_log(url)
            steps, rest = _restores(recipe, url, live, False, sharded=False)
            info = _inspect(url)
            keys = []
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET):
                keys += [o["Key"] for o in page.get("Contents", [])]
            for key in keys:
                dst = os.path.join(path, "objects", *key.split("/"))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                body = client.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
                with open(dst, "wb") as fh:
                    fh.write(body)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return {**case, "lossy": False, "inspect": info, "steps": steps, "restore": rest,
            "s3": {"bucket": S3_BUCKET, "prefix": S3_PREFIX}}


MAKERS = {"local": make_local, "sharded": make_sharded, "s3": make_s3}


def _commit() -> str:
    """The commit of the code writing the logs (``+dirty``: lowdiff_store/ had changes)."""
    git = ["git", "-C", ROOT]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "lowdiff_store"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _written_on() -> dict[str, Any]:
    """The numerics of the machine writing a case (what the golden test compares with its
    own to expect bits or an up-front refusal): vendor, model, ATen capability, MKL branch."""
    from lowdiff_store.torch.core.numerics import current
    n = current("cpu")
    return {"cpu_vendor": n.cpu_vendor, "cpu_model": n.cpu_model, "aten_cpu": n.aten_cpu,
            "mkl_vml": n.mkl_vml}


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(CASES),
                    help="regenerate this case only (repeatable)")
    ap.add_argument("--out", default=GOLDEN,
                    help="where to write logs/ and expected.json (default: tests/golden)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    exp_path = os.path.join(a.out, "expected.json")
    expected: dict[str, Any] = {}
    if a.only and os.path.exists(exp_path):
        with open(exp_path) as fh:
            expected = json.load(fh)["cases"]
    for name in a.only or list(CASES):
        case = CASES[name]
        path = os.path.join(a.out, "logs", name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rng = torch.get_rng_state()
        expected[name] = MAKERS[case["kind"]](name, case, path)
        expected[name]["written_by"] = _commit()
        expected[name]["written_on"] = _written_on()
        torch.set_rng_state(rng)
        print(f"{name:28s} {_size(path) / 1024:8.1f} KiB", flush=True)
    doc = {"torch": torch.__version__, "cases": {k: expected[k] for k in sorted(expected)}}
    with open(exp_path, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"total {_size(a.out) / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
