"""One rank of a torchtitan training run of the debug model on CPU, in its own process.

``python titan_worker.py ASSETS DUMP OUT MODE STEPS INTERVAL [KILL_AT] [RANK WORLD PORT]``
(without RANK WORLD PORT: a job of one rank on a free port; with them: rank RANK of a job
of WORLD ranks, FSDP2 over gloo, rendezvous on 127.0.0.1:PORT; KILL_AT ``-`` for none):

- MODE ``dcp``: torchtitan's own ``CheckpointManager``; ``log``: ``LowDiffCheckpointManager``
  (its log under ``DUMP/lowdiff``, its bases torchtitan's checkpoints); ``own``: the same
  with ``bases="own"`` (a base of its own every 4 steps); all save DCP checkpoints every
  INTERVAL steps under ``DUMP/checkpoint``;
- every logged step appends ``{"step", "loss", "grad_norm", "lr"}`` to ``OUT.losses.jsonl``
  (one line, flushed: a killed run leaves the steps it finished);
- at the end, ``OUT.npz`` (no pickle) holds the model, the optimizer state and the
  learning rate, and ``OUT.json`` the train state, the data loader position and the step
  the run resumed from;
- with KILL_AT the process SIGKILLs itself inside step KILL_AT+1, after its backward and
  gradient clipping, before the optimizer step; on several ranks rank 0 does so after its
  optimizer step and learning-rate step of that step instead (there is no collective in
  between), once its log holds step KILL_AT durable (completed by that optimizer step), so
  its shard holds one step more than the others'.

The same script is run again after a kill, as a job restarted by its scheduler would be.

``TITAN_TWEAKS`` (JSON, optional) changes the job: ``lr`` (the optimizer's),
``n_layers`` (the model's), ``checkpoint`` (fields of the checkpoint config), ``loader``
(``"unrecordable"``: the data set's state holds a NumPy generator; ``"refuses"``: it
raises when its state is loaded), ``kill_in_dcp_save`` (a step: SIGKILL inside
torchtitan's DCP save of that step, after the data files are written, before
``.metadata``).

``TITAN_REFUSALS`` (JSON, a list of such tweaks; one rank, no KILL_AT): instead of one run,
one job per entry, each built in turn in this process and expected to be refused when it
starts (``ConfigError`` from ``load()``, before training); each refusal's message is
appended to ``OUT.refusals.jsonl`` and a job that is not refused ends the process (exit 1).
One process for them all: its imports cost most of a refused job's time.

``python titan_worker.py --serve ASSETS [RANK WORLD]`` (default: rank 0 of 1): a fork
server (``tests/helpers/fork_server.py``) for runs of that rank on ASSETS: it makes their
imports and adjustments once (``prepare``, as ``main`` would), then forks a process for
each run, which runs ``main`` as the script would.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.integrations import titan_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(assets: Path, dump: Path, mode: str, steps: int, interval: int, world: int = 1,
          tweaks: dict[str, Any] | None = None) -> Any:
    """The trainer (torchtitan adjusted for CPU by the caller); MODE ``own``: the log with
    bases of its own (``bases="own"``, every 4 steps)."""
    from torchtitan.components.checkpoint import CheckpointManager

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    tw = tweaks or {}
    common = {"enable": True, "interval": interval, "last_save_model_only": False,
              **tw.get("checkpoint", {})}
    if mode == "dcp":
        ckpt = CheckpointManager.Config(**common)
    else:
        own = {"bases": "own", "snapshot_every": 4} if mode == "own" else {}
        ckpt = LowDiffCheckpointManager.Config(**common, **own)

    def change(cfg: Any) -> None:
        if "lr" in tw:
            cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] = tw["lr"]
        if "n_layers" in tw:
            cfg.model_spec.model.layers = cfg.model_spec.model.layers[:tw["n_layers"]]

    cfg = titan_cpu.debug_config(assets=assets, dump=dump, steps=steps, checkpoint=ckpt,
                                 world=world, tweak=change)
    return cfg.build()


def tweak_loader(trainer: Any, how: str) -> None:
    """The data set's state made one the log cannot record, or one it refuses to load."""
    dataset = trainer.dataloader.dataset
    if how == "unrecordable":
        state = dataset.state_dict
        dataset.state_dict = lambda: {**state(), "rng": np.random.default_rng(0)}
    elif how == "refuses":
        def refuse(_state: Any) -> None:
            raise KeyError("inputs_buffer: this data set keeps its position elsewhere")
        dataset.load_state_dict = refuse


def kill_in_dcp_save(trainer: Any, step: int) -> None:
    """SIGKILL inside torchtitan's DCP save of ``step``: its data files are written,
    ``.metadata`` (written last by DCP's ``finish``) is not; the log holds ``step - 1``
    durable first (its record is written beside the save: a slow machine must not decide
    the durable step)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    finish = FileSystemWriter.finish

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        if trainer.step == step:
            _wait_durable(trainer, step - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(self, *args, **kwargs)

    FileSystemWriter.finish = dying  # type: ignore[method-assign]


def record_losses(trainer: Any, path: Path) -> None:
    mp = trainer.metrics_processor
    log = mp.log

    def logged(step: int, loss: float, max_loss: float, grad_norm: float,
               extra_metrics: dict[str, Any] | None = None) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm,
                                 "lr": (extra_metrics or {}).get("lr/AdamW")}) + "\n")
        log(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics)

    mp.log = logged


def _wait_durable(trainer: Any, step: int, deadline_s: float = 600.0) -> None:
    """Wait until the log holds ``step`` durable (a hang bound, not a duration); exit 3
    (not a SIGKILL: the test fails) if it never does."""
    ckpt = trainer.checkpointer.checkpointer
    end = time.monotonic() + deadline_s
    while ckpt.durable_step < step:
        if time.monotonic() > end:
            print(f"step {step} never became durable ({ckpt.durable_step})", flush=True)
            os._exit(3)
        time.sleep(0.01)


def kill_in_step(trainer: Any, step: int, after_optimizer: bool = False) -> None:
    """SIGKILL this process inside ``step``: before its optimizer step, or right after its
    optimizer and learning-rate steps once the log holds the previous step durable."""
    def kill_at(obj: Any, name: str) -> None:
        call = getattr(obj, name)

        def maybe_kill() -> None:
            if trainer.step == step and not after_optimizer:
                os.kill(os.getpid(), signal.SIGKILL)
            call()
            if trainer.step == step and after_optimizer:
                _wait_durable(trainer, step - 1)
                os.kill(os.getpid(), signal.SIGKILL)

        setattr(obj, name, maybe_kill)

    if after_optimizer:
        kill_at(trainer.lr_schedulers, "step")
    else:
        kill_at(trainer.checkpointer, "maybe_wait_for_staging")


def _full(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).numpy()


def final_state(trainer: Any, out: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    arrays: dict[str, np.ndarray] = {}
    model = trainer.model_parts[0]
    for k, v in model.state_dict().items():
        arrays[f"model/{k}"] = _full(v)
    opt = trainer.optimizers.optimizers[0]
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            arrays[f"opt/{names[p]}/{k}"] = _full(torch.as_tensor(v))
    arrays["lr"] = np.array([g["lr"] for g in opt.param_groups])
    np.savez(str(out) + ".npz", **arrays)
    resumed = getattr(trainer.checkpointer, "resumed_step", None)
    with open(str(out) + ".json", "w") as fh:
        json.dump({"train_state": trainer.state_dict(), "resumed": resumed,
                   "dataloader": StatefulDataLoader.state_dict(trainer.dataloader)}, fh)


def refusals(assets: Path, dump: Path, out: Path, mode: str, steps: int, interval: int,
             cases: list[dict[str, Any]]) -> None:
    """Each job of ``cases`` (tweaks) started in turn on one rank, on a fresh process group,
    and refused at ``load()``; the messages go to ``OUT.refusals.jsonl``, in order."""
    from lowdiff_store import ConfigError

    for tweaks in cases:
        titan_cpu.rank_env(_free_port())
        trainer = build(assets, dump, mode, steps, interval, 1, tweaks)
        try:
            if "loader" in tweaks:
                tweak_loader(trainer, tweaks["loader"])
            try:
                trainer.train()
            except ConfigError as e:
                with open(str(out) + ".refusals.jsonl", "a") as fh:
                    fh.write(json.dumps({"tweaks": tweaks, "error": str(e)}) + "\n")
            else:
                sys.exit(f"the job {tweaks} was not refused")
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


class _NoSleep:
    """``time`` for ``torchtitan.trainer``, whose ``sleep`` returns at once."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(_seconds: float) -> None:
        return None


def _hf_env(assets: Path, rank: int) -> None:
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "HF_DATASETS_CACHE": str(assets / f"hf-cache-{rank}")})


def prepare(assets: Path, rank: int, world: int) -> None:
    """What a run does before it builds its job: torch on one thread, the Hugging Face
    libraries offline with a cache of the rank's own under ``assets`` (read when they are
    imported), torchtitan imported and adjusted for CPU (``titan_cpu.adjust``), without
    the 2 s sleep that ends its ``train()`` on rank 0 ("for other ranks to complete":
    every rank is past its last collective of training by then, and the workers' ends
    are collectives or wait for the ranks themselves)."""
    torch.set_num_threads(1)
    _hf_env(assets, rank)
    titan_cpu.adjust(world)
    import torchtitan.trainer

    torchtitan.trainer.time = _NoSleep()  # type: ignore[assignment]
    # The objects the imports made (torch, inductor, datasets: millions) leave the cyclic
    # garbage collector's reach: each full collection, and those of the interpreter's exit,
    # would walk them all again (seconds of CPU a run). Nothing of the run exists yet, and
    # all of it stays collectable.
    gc.freeze()


def main(argv: list[str], prepared: tuple[Path, int, int] | None = None) -> None:
    """One run (the script's arguments); ``prepared``: the (ASSETS, RANK, WORLD) a fork
    server prepared this process for, instead of :func:`prepare`."""
    assets, dump, out, mode = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3]
    steps, interval = int(argv[4]), int(argv[5])
    kill_at = int(argv[6]) if len(argv) > 6 and argv[6] != "-" else None
    rank, world, port = (int(a) for a in argv[7:10]) if len(argv) > 7 else (0, 1, _free_port())
    if prepared is None:
        prepare(assets, rank, world)
    elif prepared != (assets, rank, world):
        sys.exit(f"a fork server prepared for {prepared} cannot run {argv}")
    else:
        _hf_env(assets, rank)  # the environment prepare() gave the server
    if "TITAN_REFUSALS" in os.environ:
        if world != 1 or kill_at is not None:
            sys.exit("TITAN_REFUSALS: one rank, no KILL_AT")
        refusals(assets, dump, out, mode, steps, interval,
                 json.loads(os.environ["TITAN_REFUSALS"]))
        return
    titan_cpu.rank_env(port, rank, world)
    tweaks = json.loads(os.environ.get("TITAN_TWEAKS", "{}"))
    trainer = build(assets, dump, mode, steps, interval, world, tweaks)
    try:
        record_losses(trainer, Path(str(out) + ".losses.jsonl"))
        if kill_at is not None:
            kill_in_step(trainer, kill_at + 1, after_optimizer=world > 1 and rank == 0)
        if "loader" in tweaks:
            tweak_loader(trainer, tweaks["loader"])
        if "kill_in_dcp_save" in tweaks:
            kill_in_dcp_save(trainer, tweaks["kill_in_dcp_save"])
        trainer.train()
        final_state(trainer, out)
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def serve(assets: Path, rank: int = 0, world: int = 1) -> None:
    """The fork server (see the module's docstring)."""
    from tests.helpers.fork_server import serve as fork_serve

    prepare(assets, rank, world)
    fork_serve(lambda argv: main(argv, prepared=(assets, rank, world)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]), *(int(a) for a in sys.argv[3:5]))
    else:
        main(sys.argv[1:])
