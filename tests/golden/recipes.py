"""The golden logs' models, training steps and canonical state digest (frozen with them).

``tools/make_golden_logs.py`` wrote ``tests/golden/logs/`` and ``expected.json`` (with the
code of each case's ``written_by``); ``tests/test_golden_logs.py`` proves the code of
today still opens, verifies and restores them bit for bit. Everything in this module is part of that
expectation: a model, a batch, a recipe key's meaning or the digest changed here breaks the
golden test on purpose (regenerate only for a deliberate format change).

A *recipe* (one per case, stored in ``expected.json``) is plain data: model name, optimizer
class and keyword arguments, scheduler, grad scaler, compressor, DiffCheckpointer options,
number of steps, layout (``plain``, ``ddp``, ``zero``, ``fsdp``) and DDP communication hook.
:func:`build` turns it into fresh objects, :func:`train_step` runs one step.

The *canonical state* is a map ``entry name -> sha256`` (:func:`state_entries`):
``model/<state_dict name>`` for parameters and buffers, ``opt/<parameter name>/<key>``
for optimizer state (tensors and scalars, keyed by parameter name so that every layout
compares), ``group/<i>/<key>`` for the param groups' hyperparameters. A tensor is hashed
as ``tensor <dtype> <shape>`` + newline + its raw bytes (row-major, native order); any
other value as ``value `` + canonical JSON. The digest of a state is the sha256 of its
sorted ``name sha`` lines (:func:`digest`). Only public names of lowdiff_store are used.

Run as a script (``PYTHONPATH=<repo> python tests/golden/recipes.py --phase train|restore
...``) this is one rank of the 2-rank cases (gloo, CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Recipe = dict[str, Any]
Entries = dict[str, str]

# ---------------------------------------------------------------------------- models


def _dropout(on: bool) -> torch.nn.Module:
    """Dropout 0.1 (draws from the global RNG, which every record then carries), or none."""
    return torch.nn.Dropout(0.1) if on else torch.nn.Identity()


class MLPBN(torch.nn.Module):
    """Linear(6, 16) -> BatchNorm -> ReLU -> [Dropout] -> Linear(16, 4): 212 parameters."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                                       torch.nn.ReLU(), _dropout(dropout),
                                       torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class TinyLM(torch.nn.Module):
    """Embedding(16, 8) -> one transformer layer [dropout] -> head tied to the embedding."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1 if dropout else 0.0,
                                                      batch_first=True)
        self.head = torch.nn.Linear(8, 16)
        self.head.weight = self.emb.weight  # tied: one tensor under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layer(self.emb(x)))
        return out


class DDPNet(torch.nn.Module):
    """Linear(8, 16) -> BatchNorm -> ReLU -> Linear(16, 16) -> ReLU -> [Dropout] -> Linear."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.drop = _dropout(dropout)
        self.fc3 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        out: torch.Tensor = self.fc3(self.drop(torch.relu(self.fc2(h))))
        return out


class FSDPNet(torch.nn.Module):
    """Linear(6, 12) -> LayerNorm -> ReLU -> [Dropout] -> Linear(12, 5) and a forward
    counter (5 rows split unevenly over 2 ranks)."""

    count: torch.Tensor

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.ln = torch.nn.LayerNorm(12)
        self.drop = _dropout(dropout)
        self.fc2 = torch.nn.Linear(12, 5)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        out: torch.Tensor = self.fc2(self.drop(torch.relu(self.ln(self.fc1(x)))))
        return out


MODELS: dict[str, Callable[[bool], torch.nn.Module]] = {
    "mlp_bn": MLPBN, "tiny_lm": TinyLM, "ddp_net": DDPNet, "fsdp_net": FSDPNet}


def _loss(name: str, model: Any, g: torch.Generator) -> torch.Tensor:
    """The loss of one batch drawn from ``g``."""
    if name == "tiny_lm":
        x = torch.randint(0, 16, (4, 9), generator=g)
        out = model(x[:, :-1])
        return torch.nn.functional.cross_entropy(out.reshape(-1, 16), x[:, 1:].reshape(-1))
    nin, nout, rows = {"mlp_bn": (6, 4, 16), "ddp_net": (8, 4, 16),
                       "fsdp_net": (6, 5, 8)}[name]
    x = torch.randn(rows, nin, generator=g)
    y = torch.randint(0, nout, (rows,), generator=g)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


# ---------------------------------------------------------------------------- objects


@dataclass
class Objects:
    """Everything a run of a recipe mutates (``model`` may be DDP- or FSDP-wrapped)."""

    model: Any
    optimizer: Any
    scheduler: Any = None
    scaler: Any = None
    compressor: Any = None
    hook: Any = None
    hook_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def inner(self) -> torch.nn.Module:
        """The user's module (DDP's ``module``)."""
        m: torch.nn.Module = getattr(self.model, "module", self.model)
        return m


def _optimizer(recipe: Recipe, params: Any, layout: str) -> Any:
    name, kw = recipe["optimizer"]
    if name == "DeMo":
        from lowdiff_store.torch import DeMo

        cls: Any = DeMo
    else:
        cls = getattr(torch.optim, name)
    if layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kw)
    return cls(params, **kw)


def _compressor(spec: Any) -> Any:
    if spec is None:
        return None
    import lowdiff_store.torch as lt

    name, kw = spec
    assert name in ("TopKCompressor", "TernGradCompressor", "QSGDCompressor",
                    "DeMoCompressor"), name
    return getattr(lt, name)(**kw)


def _hook(name: str | None) -> tuple[Any, Any]:
    """The DDP communication hook of ``name`` and its state."""
    if name is None:
        return None, None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    from lowdiff_store.torch import (
        QSGDState,
        TernGradState,
        TopKAllGatherState,
        qsgd_hook,
        terngrad_hook,
        topk_allgather_hook,
    )

    if name == "fp16":
        return D.fp16_compress_hook, None
    if name == "powersgd":
        return P.powerSGD_hook, P.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
            min_compression_rate=1.5, use_error_feedback=True, warm_start=True,
            random_seed=7)
    if name == "topk":
        return topk_allgather_hook, TopKAllGatherState(ratio=0.25, error_feedback=True)
    if name == "terngrad":
        return terngrad_hook, TernGradState(min_numel=64, seed=3)
    if name == "qsgd":
        return qsgd_hook, QSGDState(min_numel=64, seed=3, levels=3, bucket=32)
    raise ValueError(name)


def build(recipe: Recipe, rank: int = 0, world: int = 1, layout: str | None = None
          ) -> Objects:
    """Fresh objects of ``recipe`` (the same initial state every time) for ``rank`` of
    ``world``; ``layout`` overrides the recipe's (``plain``: no wrapper, one process)."""
    layout = layout or recipe.get("layout", "plain")
    torch.manual_seed(0)
    model: Any = MODELS[recipe["model"]](recipe["dropout"])
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if recipe.get("mp") else MixedPrecisionPolicy()
        for m in (model.fc1, model.fc2):
            fully_shard(m, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif layout in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=25 if recipe.get("hook") == "powersgd" else 0.001)
    opt = _optimizer(recipe, model.parameters(), layout)
    sched = None
    if recipe.get("scheduler") is not None:
        sname, skw = recipe["scheduler"]
        sched = getattr(torch.optim.lr_scheduler, sname)(opt, **skw)
    scaler = None
    if recipe.get("scaler") is not None:
        scaler = torch.amp.GradScaler("cpu", **recipe["scaler"])
    hook, hook_state = _hook(recipe.get("hook")) if layout in ("ddp", "zero") else (None, None)
    torch.manual_seed(100 + rank)  # dropout: each rank its own stream
    return Objects(model, opt, sched, scaler, _compressor(recipe.get("compressor")), hook,
                   hook_state, {"batches": 0})


def checkpointer_kwargs(recipe: Recipe, o: Objects) -> dict[str, Any]:
    """Keyword arguments of ``DiffCheckpointer(path, o.model, o.optimizer, **kw)``."""
    return {"scheduler": o.scheduler, "scaler": o.scaler, "compressor": o.compressor,
            "extra_state": lambda: dict(o.extra), **recipe["checkpointer"]}


def train_step(recipe: Recipe, o: Objects, t: int, rank: int = 0) -> None:
    """Step ``t`` (batches are a pure function of (t, rank, micro-batch))."""
    o.extra["batches"] = t
    o.optimizer.zero_grad(set_to_none=True)
    accum = int(recipe.get("accum", 1))
    amp = recipe.get("amp")
    for micro in range(accum):
        g = torch.Generator().manual_seed(1000 * t + 10 * rank + micro)
        if recipe.get("layout") == "fsdp" and accum > 1:
            o.model.set_requires_gradient_sync(micro == accum - 1)
        if amp is not None:
            with torch.autocast("cpu", dtype=getattr(torch, amp)):
                loss = _loss(recipe["model"], o.model, g)
        else:
            loss = _loss(recipe["model"], o.model, g)
        if t in recipe.get("inf_steps", ()):
            loss = loss * float("inf")  # the scaler skips this step
        (o.scaler.scale(loss) if o.scaler is not None else loss).backward()
    clip = recipe.get("clip")
    if o.scaler is not None:
        o.scaler.unscale_(o.optimizer)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(o.model.parameters(), clip)
        o.scaler.step(o.optimizer)
        o.scaler.update()
    else:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(o.model.parameters(), clip)
        o.optimizer.step()
    if o.scheduler is not None:
        o.scheduler.step()


# ---------------------------------------------------------------------------- digest


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective under FSDP), any tensor detached on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def _plain(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def entry_sha(v: Any) -> str:
    """sha256 of one value (see the module docstring)."""
    if isinstance(v, torch.Tensor):
        t = _full(v).contiguous()
        head = f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}\n".encode()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(head + raw).hexdigest()
    text = "value " + json.dumps(_plain(v), sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def digest(entries: Mapping[str, str]) -> str:
    """sha256 of the sorted ``name sha`` lines."""
    lines = "".join(f"{k} {entries[k]}\n" for k in sorted(entries))
    return hashlib.sha256(lines.encode()).hexdigest()


def short(entries: Mapping[str, str]) -> Entries:
    """Each entry's sha256 cut to 16 digits: enough to name what differs (expected.json
    keeps these and the full digest)."""
    return {k: v[:16] for k, v in entries.items()}


def state_entries(model_state: Mapping[str, torch.Tensor],
                  opt_state: Mapping[str, Mapping[str, Any]],
                  groups: list[Mapping[str, Any]]) -> Entries:
    """The canonical state: ``model_state`` (state_dict names), ``opt_state`` (per
    parameter name: its optimizer state) and the param groups' hyperparameters."""
    out = {f"model/{k}": entry_sha(v) for k, v in model_state.items()}
    for pname in opt_state:
        for k in sorted(opt_state[pname]):
            out[f"opt/{pname}/{k}"] = entry_sha(opt_state[pname][k])
    for i, g in enumerate(groups):
        for k in sorted(g):
            if k not in ("params", "param_names"):
                out[f"group/{i}/{k}"] = entry_sha(g[k])
    return out


def live_entries(o: Objects) -> Entries:
    """The canonical state of live objects (collective under FSDP: every rank calls it).
    Under ZeRO the optimizer state is this rank's partition."""
    m = o.inner
    model_state = {k: v for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    local = getattr(o.optimizer, "optim", o.optimizer)  # ZeroRedundancyOptimizer
    opt_state = {}
    for g in local.param_groups:
        for p in g["params"]:
            st = local.state.get(p)
            if st:
                opt_state[names[id(p)]] = st
    return state_entries(model_state, opt_state, list(o.optimizer.param_groups))


def replayed_entries(model_state: Mapping[str, torch.Tensor],
                     opt_state: Mapping[str, Any] | None) -> Entries:
    """The canonical state of ``replay_state(..., with_optimizer=True)``'s result."""
    assert opt_state is not None
    named: dict[str, Mapping[str, Any]] = {}
    for g in opt_state["param_groups"]:
        for i, name in zip(g["params"], g["param_names"], strict=True):
            if i in opt_state["state"]:
                named[name] = opt_state["state"][i]
    return state_entries(model_state, named, list(opt_state["param_groups"]))


def aux_entries(o: Objects, *, rng: bool = True) -> Entries:
    """What a restore sets besides the state: scheduler, grad scaler, compressor
    residuals (``ef/<parameter name>``) and the CPU RNG."""
    out: Entries = {}
    if o.scheduler is not None:
        for k, v in o.scheduler.state_dict().items():
            if k != "lr_lambdas":
                out[f"scheduler/{k}"] = entry_sha(v)
    if o.scaler is not None:
        for k, v in o.scaler.state_dict().items():
            out[f"scaler/{k}"] = entry_sha(v)
    if o.compressor is not None:
        names = {id(p): n for n, p in o.inner.named_parameters()}
        for p, r in o.compressor.residuals.items():
            out[f"ef/{names[id(p)]}"] = entry_sha(r)
    if rng:
        out["rng"] = entry_sha(torch.get_rng_state())
    return out


def merge_ranks(per_rank: list[Entries]) -> Entries:
    """One canonical state from the ranks': model and groups as rank 0 holds them (DDP
    broadcasts rank 0's buffers), optimizer state from whichever rank holds it (ZeRO);
    two ranks holding the same entry must agree."""
    out = {k: v for k, v in per_rank[0].items() if not k.startswith("opt/")}
    for ents in per_rank:
        for k, v in ents.items():
            if k.startswith("opt/"):
                assert out.setdefault(k, v) == v, f"ranks disagree on {k}"
    return out


# ---------------------------------------------------------------------------- s3 server


@contextlib.contextmanager
def moto_server(home: str) -> Iterator[str]:
    """``python -m moto.server`` on 127.0.0.1 and a free port (as tests/s3 run it); yields
    its endpoint, stopped on exit. ``home``: a directory for its output."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    endpoint = f"http://127.0.0.1:{port}"
    with open(os.path.join(home, "moto.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
    try:
        client = s3_client(endpoint)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited {proc.returncode}")
            try:
                client.list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_client(endpoint: str) -> Any:
    """A boto3 client on ``endpoint`` with moto's static credentials."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def s3_environ(endpoint: str, home: str) -> dict[str, str]:
    """The standard AWS variables pointing at ``endpoint`` and nothing else (set them in
    the environment; the variables that would change the log's behaviour are removed by
    the caller: LOWDIFF_S3_*)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.path.join(home, "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": os.path.join(home, "no-aws-credentials")}


#: variables that must not be set while the s3 case runs (they change what is written)
S3_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "LOWDIFF_S3_WAL_DIR",
            "LOWDIFF_S3_UPLOAD_INTERVAL_S", "LOWDIFF_S3_GC_GRACE_S", "LOWDIFF_S3_MAX_ATTEMPTS")


# ---------------------------------------------------------------------------- rank worker


def launch(phase: str, recipe: Recipe, ckpt_dir: str, out: str, *, world: int = 2,
           timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run this module on ``world`` ranks (``phase``: ``train`` writes ``ckpt_dir``,
    ``restore`` restores it); returns each rank's result. Every rank must exit 0."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    os.makedirs(out, exist_ok=True)
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--phase", phase, "--recipe",
         json.dumps(recipe), "--rank", str(r), "--world", str(world), "--port", str(port),
         "--dir", ckpt_dir, "--out", out, "--timeout", str(timeout)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.monotonic() + timeout + 30
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        outs.append(text.decode(errors="replace"))
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-4000:]}"
    results = []
    for r in range(world):
        with open(os.path.join(out, f"{phase}-{r}.json")) as fh:
            results.append(json.load(fh))
    return results



def _worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("train", "restore"), required=True)
    ap.add_argument("--recipe", required=True, help="the recipe as JSON")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.timeout, exit=True)  # a hung collective: fail loudly
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(a.rank),
                      WORLD_SIZE=str(a.world))
    import torch.distributed as dist

    from lowdiff_store.torch import DiffCheckpointer, restore

    dist.init_process_group("gloo")
    recipe: Recipe = json.loads(a.recipe)
    result: dict[str, Any] = {}
    if a.phase == "train":
        o = build(recipe, a.rank, a.world)
        ckpt = DiffCheckpointer(a.dir, o.model, o.optimizer, **checkpointer_kwargs(recipe, o))
        if o.hook is not None:
            o.model.register_comm_hook(o.hook_state, ckpt.wrap_comm_hook(o.hook))
        for t in range(1, recipe["steps"] + 1):
            train_step(recipe, o, t, a.rank)
            if t in (recipe["mid"], recipe["steps"]):
                result[str(t)] = live_entries(o)
        ckpt.close()
        result["aux"] = aux_entries(o)
        result["extra"] = dict(o.extra)
        result["stats"] = {k: v for k, v in ckpt.stats().items() if k.startswith("tee")}
    else:
        for step in (None, recipe["mid"]):
            o = build(recipe, a.rank, a.world)
            res = restore(a.dir, o.model, o.optimizer, scheduler=o.scheduler, step=step)
            result[str(res.step)] = {"entries": live_entries(o), "aux": aux_entries(o),
                                     "base_step": res.base_step, "exact": res.exact,
                                     "extra": res.extra}
    with open(os.path.join(a.out, f"{a.phase}-{a.rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()  # every rank is done with every collective
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: destroying gloo's threads at exit can abort the process
    os._exit(0)


if __name__ == "__main__":
    _worker()
