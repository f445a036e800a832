"""Every tensor-name prefix of a torch log, and the class names earlier versions recorded:
the one home of these names (``docs/torch.md``, "What is stored"). Capture, replay,
resharding, the DDP hooks and the schema checks import them from here; no other module
spells a prefix out (``tests/test_torchmeta.py`` greps the package for one).

Tensor names in records and bases:

- ``NAME``: a model tensor (parameter or persistent buffer) under its ``state_dict`` name;
- ``@grad/NAME``: the gradient the optimizer consumed for parameter NAME;
- ``@opt/NAME/KEY``: the optimizer state tensor KEY of parameter NAME;
- ``@ef/NAME``: a compressor's error-feedback residual for NAME;
- ``@rng/cpu``, ``@rng/cuda/I``: RNG states (uint8);
- ``@psgd/NAME/P``, ``@psgd/NAME/Q``: PowerSGD factors of NAME's gradient (a DDP hook);
- ``@hook/ef/NAME``, ``@hook/q/NAME``, ``@hook/meta``: a DDP hook's per-rank state.

Torch-free: the schema checks (:mod:`lowdiff_store.torchmeta`) use these names too.
"""

from __future__ import annotations

#: the gradient the optimizer consumed: ``@grad/NAME``
GRAD = "@grad/"
#: optimizer state tensors: ``@opt/NAME/KEY``
OPT = "@opt/"
#: a compressor's error-feedback residual: ``@ef/NAME``
EF = "@ef/"
#: RNG states: ``@rng/cpu``, ``@rng/cuda/I``
RNG = "@rng/"
#: the CPU generator's state
RNG_CPU = RNG + "cpu"
#: CUDA generators' states, by device index
RNG_CUDA = RNG + "cuda/"
#: PowerSGD factors of a parameter's gradient: ``@psgd/NAME/P``, ``@psgd/NAME/Q``
PSGD = "@psgd/"
#: hook state kept per rank in bases and records
HOOK = "@hook/"
#: a DDP hook's error feedback: ``@hook/ef/NAME``
HOOK_EF = HOOK + "ef/"
#: PowerSGD's warm-start Q: ``@hook/q/NAME``
HOOK_Q = HOOK + "q/"
#: a DDP hook's packed metadata (kind, iteration, RNG)
HOOK_META = HOOK + "meta"

#: Qualified names that earlier versions recorded for classes that have since moved: a log
#: naming one still means the class it named (logs are never rewritten).
MOVED_CLASSES: dict[str, str] = {
    "lowdiff_store.torch.demo_optim.DeMo": "lowdiff_store.torch.compressors.demo.DeMo",
}


def current_class_name(name: str) -> str:
    """The class a recorded qualified name means today (see :data:`MOVED_CLASSES`)."""
    return MOVED_CLASSES.get(name, name)


def opt_name(param: str, key: str) -> str:
    """Tensor name of optimizer state ``key`` of parameter ``param``."""
    return f"{OPT}{param}/{key}"


__all__ = ["EF", "GRAD", "HOOK", "HOOK_EF", "HOOK_META", "HOOK_Q", "MOVED_CLASSES", "OPT",
           "PSGD", "RNG", "RNG_CPU", "RNG_CUDA", "current_class_name", "opt_name"]
