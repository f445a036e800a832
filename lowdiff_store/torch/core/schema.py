"""The torch-level schema of a log, shared by the capture side and the replay side: tensor
names, metadata keys, the state digest, and how optimizer state is flattened to named
tensors and rebuilt. Described for users in ``docs/torch.md`` ("What is stored").

Tensor names (in records and bases) are those of :mod:`lowdiff_store.torchmeta.names`
(re-exported here: ``GRAD``, ``OPT``, ``EF``, ``RNG``...); a model tensor goes under its
``state_dict`` name (``module.`` removed; tied tensors once, under their first name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import msgpack
import numpy as np
import torch

from ...errors import ConfigError, FormatError, Reason
from ...format.checksum import crc32c_parallel
from ...format.dtypes import bf16_to_f32, f32_to_bf16, storage_dtype
from ...torchmeta import SCHEMA as TORCH_SCHEMA
from ...torchmeta.names import (
    EF,
    GRAD,
    MOVED_CLASSES,
    OPT,
    RNG,
    RNG_CPU,
    RNG_CUDA,
    current_class_name,
    opt_name,
)
from .state_digest import digest_state
from .tensors import bytes_of, from_bits
from .typed_msgpack import pack, packb, unpack

SCHEMA = TORCH_SCHEMA

#: Optimizers the replay side may build from a recorded class name (nothing else is ever
#: instantiated from a file). LBFGS is excluded: its step re-evaluates a closure.
ALLOWED_OPTIMIZERS: tuple[str, ...] = (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
    "ASGD", "Rprop",
)


def class_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s class."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


#: Optimizers outside ``torch.optim`` that a log may name, by qualified name. This package's
#: own (:class:`~lowdiff_store.torch.DeMo`) register themselves when their module is imported,
#: which ``import lowdiff_store.torch`` always does.
_PACKAGE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {}


def register_optimizer(cls: Callable[..., torch.optim.Optimizer]) -> None:
    """Let logs name ``cls`` (an optimizer class of this package) as their optimizer."""
    _PACKAGE_OPTIMIZERS[f"{cls.__module__}.{cls.__qualname__}"] = cls


def allowed_optimizer(name: str) -> Callable[..., torch.optim.Optimizer] | None:
    """The allow-listed torch.optim class recorded as ``name`` (or one of this package's,
    such as :class:`~lowdiff_store.torch.DeMo`), or None."""
    for short in ALLOWED_OPTIMIZERS:
        cls = getattr(torch.optim, short, None)
        if cls is not None and f"{cls.__module__}.{cls.__qualname__}" == name:
            return cast("Callable[..., torch.optim.Optimizer]", cls)
    return _PACKAGE_OPTIMIZERS.get(current_class_name(name))


# ------------------------------------------------------------------------ hyperparameters


def hyper_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every hyperparameter of every param group, packed (``params`` excluded)."""
    return [pack({k: v for k, v in g.items() if k != "params"}, f"param_groups[{i}]")
            for i, g in enumerate(optimizer.param_groups)]


def set_hyper(optimizer: torch.optim.Optimizer, packed: Sequence[Any]) -> None:
    """Set every recorded hyperparameter of every group (tensor values in place)."""
    for g, values in zip(optimizer.param_groups, check_hyper(optimizer, packed), strict=True):
        for k, v in values.items():
            cur = g.get(k)
            if (isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor)
                    and cur.shape == v.shape and cur.dtype == v.dtype):
                cur.copy_(v)
            else:
                g[k] = v


def check_hyper(optimizer: torch.optim.Optimizer, packed: Sequence[Any]
                ) -> list[dict[str, Any]]:
    """The recorded hyperparameters ``packed`` unpacked, after checking that each may
    replace the optimizer's value of the same key (FormatError(bad_metadata) if not)."""
    groups = optimizer.param_groups
    if len(packed) != len(groups):
        raise ConfigError(f"log has {len(packed)} param groups, optimizer has {len(groups)}",
                          reason=Reason.STATE_MISMATCH)
    out = []
    for i, (g, h) in enumerate(zip(groups, packed, strict=True)):
        values = unpack(h)
        for k, v in values.items():
            cur = g.get(k)
            if k == "params" or not _same_kind(cur, v):
                raise FormatError(f"param_groups[{i}][{k!r}]: the recorded {_kind(v)} "
                                  f"cannot replace the optimizer's {_kind(cur)}",
                                  reason=Reason.BAD_METADATA)
        out.append(values)
    return out


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return "number"
    if isinstance(v, (tuple, list)):
        return f"sequence of {len(v)}"
    return type(v).__name__


def _same_kind(cur: Any, new: Any) -> bool:
    """A recorded hyperparameter may replace the live one: same kind of value (a number
    for a number, a tensor lr included; a pair for betas...), or either is None (torch's
    "not set" for foreach, fused...)."""
    if cur is None or new is None:
        return True
    kc, kn = _kind(cur), _kind(new)
    if kc != kn:
        return False
    if isinstance(cur, (tuple, list)):
        return all(_same_kind(a, b) for a, b in zip(cur, new, strict=True))
    return True


def same(a: Any, b: Any) -> bool:
    """Packed values with identical bits."""
    return a is b or bool(msgpack.packb(a, use_bin_type=True) == msgpack.packb(b,
                                                                              use_bin_type=True))


# ------------------------------------------------------------------------ optimizer state


def split_state(state: Mapping[Any, Any], where: str) -> tuple[dict[str, torch.Tensor],
                                                                dict[str, Any]]:
    """One parameter's optimizer state: (tensor entries, packed non-tensor entries)."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for k, v in state.items():
        if not isinstance(k, str):
            raise ConfigError(f"{where}: optimizer state key {k!r} is not a string",
                              reason=Reason.NOT_ALLOWED)
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        else:
            values[k] = pack(v, f"{where}[{k!r}]")
    return tensors, values


def build_optimizer_state(names: Sequence[str], groups: Sequence[int], hyper: Sequence[Any],
                          tensors: Mapping[str, Mapping[str, torch.Tensor]],
                          values: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """An ``optimizer.state_dict()``-shaped dict from named parts (params by position)."""
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        entry: dict[str, Any] = {}
        for k, v in values.get(name, {}).items():
            entry[k] = unpack(v)
        entry.update(tensors.get(name, {}))
        if entry or name in tensors or name in values:
            state[i] = entry
    param_groups = []
    start = 0
    for n, h in zip(groups, hyper, strict=True):
        g = unpack(h)
        g["params"] = list(range(start, start + n))
        start += n
        param_groups.append(g)
    return {"state": state, "param_groups": param_groups}


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


# ------------------------------------------------------------------------ digest


def digest_parts(items: Iterable[tuple[Any, Iterable[tuple[str, Any]]]]) -> int:
    """CRC32C over each parameter's bytes then its optimizer state entries (key order).

    ``items``: (parameter bytes, [(key, tensor bytes | packed value)]) in optimizer order.
    Bytes are uint8 arrays or bytes; a packed value is hashed as its msgpack bytes.
    """
    # In windows of about _DIGEST_WINDOW bytes, each on several cores (replay checks a
    # digest every K steps); a window bounds the host copies of device tensors held at once.
    crc, window, held = 0, [], 0
    for pbytes, entries in items:
        bufs = [_mv(pbytes)]
        for key, v in sorted(entries, key=lambda kv: kv[0]):
            bufs.append(key.encode())
            bufs.append(_mv(v) if isinstance(v, (np.ndarray, bytes)) else
                        msgpack.packb(v, use_bin_type=True))
        window += bufs
        held += sum(len(b) if isinstance(b, bytes) else b.nbytes for b in bufs)
        if held >= _DIGEST_WINDOW:
            crc, window, held = crc32c_parallel(window, crc), [], 0
    return crc32c_parallel(window, crc)


_DIGEST_WINDOW = 64 << 20


def _mv(v: np.ndarray | bytes) -> memoryview | bytes:
    if isinstance(v, bytes):
        return v
    return np.ascontiguousarray(v).reshape(-1).view(np.uint8).data


def state_items(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
                ) -> Iterator[tuple[Any, list[tuple[str, Any]]]]:
    """The :func:`digest_parts` items of live parameters and their optimizer state."""
    for p in params:
        st = optimizer.state.get(p, {})
        entries: list[tuple[str, Any]] = []
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                entries.append((str(k), bytes_of(v)))
            else:
                entries.append((str(k), pack(v)))
        yield bytes_of(p), entries


def digest_objects(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """The digest of live parameters and optimizer state (:func:`digest_parts` of their
    bytes; device tensors go through reused pinned windows, never one host copy per
    tensor: :func:`~lowdiff_store.torch.core.state_digest.digest_state`)."""
    return digest_state(params, optimizer)


# ------------------------------------------------------------------------ lossy deltas


def widen(tag: str, arr: np.ndarray) -> np.ndarray:
    """Float bits as float32 values (float64 for F64), exactly."""
    if tag == "BF16":
        return bf16_to_f32(arr)
    if tag == "F64":
        return np.asarray(arr, dtype=np.float64)
    return np.asarray(arr).astype(np.float32)


def apply_delta(tag: str, ref: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``ref + delta`` (widened, then rounded to ``tag`` to nearest even): the one function
    both the writer and replay use, so their reconstructions are the same bits."""
    wide = widen(tag, ref) + delta.astype(np.float64 if tag == "F64" else np.float32,
                                          copy=False)
    if tag == "BF16":
        return f32_to_bf16(wide)
    return wide.astype(storage_dtype(tag))


# ------------------------------------------------------------------------ RNG


def rng_states() -> dict[str, np.ndarray]:
    """CPU and (when CUDA is in use) CUDA generator states as uint8 arrays."""
    out = {RNG_CPU: torch.get_rng_state().numpy()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{RNG_CUDA}{i}"] = s.numpy()
    return out


def set_rng_states(states: Mapping[str, np.ndarray]) -> list[str]:
    """Set the generators from :func:`rng_states` output; returns notes on what could not
    be set (CUDA states without CUDA, or a different device count)."""
    notes = []
    if RNG_CPU in states:
        torch.set_rng_state(from_bits("U8", states[RNG_CPU]))
    cuda = sorted((int(k[len(RNG_CUDA):]), v) for k, v in states.items()
                  if k.startswith(RNG_CUDA))
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([from_bits("U8", v) for _i, v in cuda])
        else:
            notes.append(f"the log holds {len(cuda)} CUDA RNG state(s) that were not "
                         f"restored (CUDA devices here: "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    return notes


__all__ = [
    "ALLOWED_OPTIMIZERS",
    "EF",
    "GRAD",
    "MOVED_CLASSES",
    "OPT",
    "RNG",
    "RNG_CPU",
    "RNG_CUDA",
    "SCHEMA",
    "allowed_optimizer",
    "current_class_name",
    "register_optimizer",
    "apply_delta",
    "build_optimizer_state",
    "check_hyper",
    "class_name",
    "digest_objects",
    "digest_parts",
    "hyper_of",
    "opt_name",
    "packb",
    "params_of",
    "rng_states",
    "same",
    "set_hyper",
    "set_rng_states",
    "split_state",
    "state_items",
    "widen",
]
