"""torchtitan (0.3.0) on CPU with gloo, for the tests: the adjustments torchtitan does not
make itself, and small assets its wheel does not ship (a tokenizer, a text data set).

:func:`adjust` must run before anything of torchtitan is imported (its modules read the
device type at import). What it changes on one rank, and why:

- a stand-in ``triton`` module when triton is not installed: ``torchtitan.trainer``
  imports it at the top, for GPU kernels this run never calls (``triton.jit`` leaves the
  function as it is, ``triton.language.constexpr`` is a plain annotation);
- the device type forced to ``"cpu"`` (torchtitan falls back to ``"cuda"`` when no
  accelerator is found) with a device module that answers the memory-monitor calls
  ``torch.cpu`` lacks (zeros, 1 GiB capacity);
- ``set_pg_timeouts`` skipped (it calls ``barrier(device_ids=...)``, which gloo refuses,
  and ``torch.distributed.set_timeout``, which torch 2.13 lacks).

On several ranks (``adjust(world)``, FSDP2 over gloo), also:

- FSDP's sum reductions forced (``set_force_sum_reduction_for_comms``) where torchtitan
  turns FSDP's gradient division off: with a divide factor of 1 FSDP would reduce-scatter
  with ``PREMUL_SUM``, which gloo lacks; a sum, then a division by 1, is the same.

:func:`debug_config` swaps the debug model's FlexAttention (no CPU backward) for
``ScaledDotProductAttention``; with ``world > 1`` it sets
``parallelism.spmd_backend="partial_dtensor"`` (the default ``spmd_types`` path wants every
parameter a DTensor on the full SPMD mesh before ``fully_shard``, which the debug model's
plain initialisation does not give).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: characters of the stand-in tokenizer's vocabulary (one token each), after <s> and </s>
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


class _Anything:
    """Annotations of kernel signatures (``tl.pointer_type(tl.int64)``): callable, any
    attribute, never used."""

    def __call__(self, *_: Any, **__: Any) -> _Anything:
        return self

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def _triton_stand_in() -> None:
    def jit(fn: Any = None, **_: Any) -> Any:
        return fn if callable(fn) else (lambda f: f)

    def missing(default: Any) -> Callable[[str], Any]:
        def get(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return default
        return get

    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int  # type: ignore[attr-defined]
    language.__getattr__ = missing(_Anything())  # type: ignore[method-assign]
    triton.jit = jit  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    triton.__getattr__ = missing(jit)  # type: ignore[method-assign]
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = language


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` plus the memory-monitor calls it lacks."""

    def __init__(self) -> None:
        super().__init__("cpu_device_stand_in")
        import torch

        self._cpu = torch.cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cpu, name)

    def get_device_name(self, *_: Any) -> str:
        return "cpu"

    def get_device_properties(self, *_: Any) -> Any:
        return types.SimpleNamespace(total_memory=1 << 30, name="cpu")

    def memory_stats(self, *_: Any) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, *_: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def set_device(self, *_: Any) -> None:
        return None

    def device_count(self) -> int:
        return 1


def adjust(world: int = 1) -> None:
    """Make torchtitan run on CPU with gloo (call before importing torchtitan); ``world``:
    the job's number of ranks."""
    if "torchtitan.trainer" in sys.modules:
        raise RuntimeError("titan_cpu.adjust() must run before torchtitan is imported")
    import torchtitan.tools.utils as tutils  # imports no triton, reads the device type

    tutils.device_type, tutils.device_module = "cpu", _CpuDevice()  # type: ignore[assignment]
    stand_in = importlib.util.find_spec("triton") is None
    if stand_in:
        # torch looks for triton when these are first imported (torchtitan's import runs
        # torch.compile): they must see none
        import torch._dynamo.repro.after_dynamo
        import torch._inductor.compile_fx
        import torch._inductor.runtime.triton_compat  # noqa: F401

        _triton_stand_in()
    try:
        import torchtitan.distributed.utils as dutils
        import torchtitan.trainer as trainer_mod
    finally:
        if stand_in:
            for name in ("triton", "triton.language"):
                sys.modules.pop(name, None)
    dutils.set_pg_timeouts = lambda *a, **k: None  # type: ignore[assignment]
    trainer_mod.dist_utils.set_pg_timeouts = dutils.set_pg_timeouts  # type: ignore[attr-defined]
    if world > 1:
        _sum_reductions()


def _sum_reductions() -> None:
    """FSDP reduce-scatters with a plain sum where torchtitan sets a divide factor of 1
    (``apply_fsdp_to_decoder`` calls ``disable_fsdp_gradient_division``, looked up in its
    module at each call)."""
    import torchtitan.distributed.fsdp as tfsdp
    from torch.distributed.fsdp import FSDPModule

    disable = tfsdp.disable_fsdp_gradient_division

    def disable_and_sum(model: Any) -> None:
        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tfsdp.disable_fsdp_gradient_division = disable_and_sum  # type: ignore[assignment]


def make_assets(root: Path) -> tuple[Path, Path]:
    """A character tokenizer (``tokenizer.json``) and a small text data set (JSON lines) under
    ``root``; returns ``(tokenizer_dir, dataset_dir)``. Deterministic."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(ALPHABET)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
         "add_eos_token": True}))
    words = ["alpha", "beta", "gamma", "delta", "theta", "kappa", "sigma", "omega"]
    with open(data_dir / "train.jsonl", "w") as fh:
        for i in range(400):
            text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(5 + i % 11))
            fh.write(json.dumps({"text": text + "."}) + "\n")
    return tok_dir, data_dir


def debug_config(*, assets: Path, dump: Path, steps: int, checkpoint: Any,
                 seq_len: int = 64, local_batch_size: int = 2, world: int = 1,
                 tweak: Callable[[Any], None] | None = None) -> Any:
    """torchtitan's ``llama3_debugmodel`` config for a short CPU run: SDPA attention, no
    activation checkpointing, no validation, ``checkpoint`` as the checkpoint config."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    for layer in cfg.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.hf_assets_path = str(assets / "tokenizer")
    cfg.dataloader.dataset_path = str(assets / "data")
    cfg.dump_folder = str(dump)
    cfg.training.steps = steps
    cfg.training.seq_len = seq_len
    cfg.training.local_batch_size = local_batch_size
    cfg.training.disable_cuda_graphs = True
    cfg.activation_checkpoint = None
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1
    cfg.debug.seed = 42
    cfg.checkpoint = checkpoint
    if world > 1:
        cfg.parallelism.spmd_backend = "partial_dtensor"
    if tweak is not None:
        tweak(cfg)
    return cfg


def rank_env(port: int, rank: int = 0, world: int = 1) -> None:
    """The environment ``torchrun`` would give rank ``rank`` of a job of ``world`` ranks on
    one node."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
