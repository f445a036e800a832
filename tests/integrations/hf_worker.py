"""One Hugging Face Trainer run with ``LowDiffCallback`` (or without), in its own process.

``python hf_worker.py OUT CKPT VARIANT [KILL_AT]``: trains a tiny randomly initialised
GPT-2 (2 layers, dropout on, tied embeddings) and writes to OUT (an .npz, no pickle) the
final weights, the optimizer state and the logged losses. With KILL_AT the process
SIGKILLs itself in the middle of step KILL_AT+1 (after its forward and backward). CKPT
"-" trains without the callback. Every process of a test builds the same model and data
from fixed seeds, as a re-run training script would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import numpy as np
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from lowdiff_store.integrations.transformers import LowDiffCallback

VARIANTS: dict[str, dict[str, Any]] = {
    # 40 examples / batch 4 = 10 steps an epoch; 14 steps cross an epoch boundary
    "plain": {"max_steps": 14},
    "accum": {"max_steps": 9, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5},
    "bf16": {"max_steps": 12, "bf16": True, "max_grad_norm": 1.0},
    # the plain run with streamed bases (issue 50): each base in 2 slices
    "streamed": {"max_steps": 14},
}
#: the callback's options beyond ``snapshot_every=4``, per variant
CALLBACK_OPTIONS: dict[str, dict[str, Any]] = {"streamed": {"base_slices": 2}}


def dataset(n: int = 40, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 64, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(cfg)


class Kill(TrainerCallback):  # type: ignore[misc]
    """SIGKILL inside step ``at + 1``, after backward (its record is not complete)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def run(out: str, ckpt: str, variant: str, kill_at: int | None = None,
        workdir: str | None = None) -> Trainer:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    opts = VARIANTS[variant]
    args = TrainingArguments(
        output_dir=workdir or os.path.dirname(out), per_device_train_batch_size=4,
        learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="linear", weight_decay=0.01,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=7,
        dataloader_num_workers=0, disable_tqdm=True, **opts)
    callbacks: list[Any] = []
    if ckpt != "-":
        callbacks.append(LowDiffCallback(ckpt, snapshot_every=4,
                                         **CALLBACK_OPTIONS.get(variant, {})))
    if kill_at is not None:
        callbacks.append(Kill(kill_at))
    trainer = Trainer(model=model(), args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.train()
    save(out, trainer, callbacks[0] if ckpt != "-" else None)
    return trainer


def save(out: str, trainer: Trainer, cb: Any) -> None:
    arrays: dict[str, np.ndarray] = {}
    for k, v in trainer.model.state_dict().items():
        arrays[f"model/{k}"] = v.detach().float().numpy()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            arrays[f"opt/{i}/{k}"] = v.detach().float().numpy()
    losses = [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]
    arrays["losses"] = np.array(losses, dtype=np.float64)
    arrays["lr"] = np.array([pg["lr"] for pg in opt.param_groups])
    arrays["global_step"] = np.array(trainer.state.global_step)
    arrays["resumed"] = np.array(-1 if cb is None or cb.resumed_step is None
                                 else cb.resumed_step)
    np.savez(out, **arrays)
    with open(out + ".json", "w") as fh:
        json.dump({"log": [e for e in trainer.state.log_history if "loss" in e]}, fh)


if __name__ == "__main__":
    a = sys.argv[1:]
    run(a[0], a[1], a[2], int(a[3]) if len(a) > 3 else None)
