"""Weight-delta capture (``mode="delta"``: Check-N-Run, LC-Checkpoint).

:class:`DeltaCapture` keeps the *reconstruction*: the state replay will rebuild, tensor by
tensor (model tensors and ``@opt/NAME/KEY`` optimizer state, as bits). Each step it logs
what turns the reconstruction into the live state: an ``xor`` of the bit patterns
(lossless) or, with a lossy ``delta_codec``, the codec of ``live - reconstruction``; the
reconstruction then becomes what the codec's decode gives back, exactly as replay computes
it (:func:`~lowdiff_store.torch.core.schema.apply_delta`), so error never accumulates across
steps. At a base step every difference is lossless, so the reconstruction is the true state
there whichever way replay reaches it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ... import codecs
from ...format.dtypes import FLOAT_TAGS
from ..core import schema as L
from ..core.specs import Spec, raw_spec
from ..core.tensors import bits_view, same_bytes, to_bits

#: lossy delta codecs: ``delta_codec`` -> (codec, its options) for one difference
_LOSSY_DELTA: dict[str, Callable[[np.ndarray, Mapping[str, Any]], tuple[str, dict[str, Any]]]] = {
    "q8": lambda wide, o: ("q8", {"block": int(o["delta_block"])}),
    "topk": lambda wide, o: ("sparse", {"k": max(1, int(wide.size * float(o["delta_ratio"])))}),
    "lcc": lambda wide, o: ("lcc", {"bits": int(o["delta_bits"])}),  # LC-Checkpoint
}

#: the ``delta_codec`` values: lossless ``xor`` and the lossy ones
DELTA_CODECS = ("xor", *_LOSSY_DELTA)


def _shares_mem(arr: np.ndarray, t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and arr.size > 0 and \
        arr.__array_interface__["data"][0] == t.data_ptr()


def _lossy_delta(name: str, tag: str, cur: np.ndarray, ref: np.ndarray,
                 o: Mapping[str, Any]) -> tuple[Spec | None, np.ndarray]:
    """Encode ``cur - ref`` lossily; returns the spec and the new reconstruction (the
    replay side computes the same with :func:`apply_delta`)."""
    wide = L.widen(tag, cur) - L.widen(tag, ref)
    if not wide.any():
        return None, ref
    wtag = "F64" if wide.dtype == np.float64 else "F32"
    codec, opts = _LOSSY_DELTA[o["delta_codec"]](wide, o)
    enc = codecs.encode(codec, wide, wtag, **opts)
    dec = codecs.decode(enc.codec, enc.params, [p.data for p in enc.parts], wtag,
                        tuple(wide.shape))
    new = L.apply_delta(tag, ref, dec)
    return Spec(name, wtag, tuple(wide.shape), enc, None), new


StateFn = Callable[[], tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]]


class DeltaCapture:
    """The reconstruction and the per-step deltas of one checkpointer (see the module
    docstring). ``model``: the model tensors by name; ``opt_state()``: the optimizer's
    (tensors by parameter name and key, other values) now; ``opts``: the checkpointer's
    options (``delta_codec``, ``delta_min_numel``, ``delta_zstd``, ...)."""

    def __init__(self, model: Mapping[str, torch.Tensor], opt_state: StateFn,
                 opts: Mapping[str, Any]) -> None:
        self._model = model
        self._opt_state = opt_state
        self._opts = opts
        self.recon: dict[str, tuple[str, np.ndarray]] = {}
        self.layout: dict[str, Any] | None = None

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self._model)
        tensors, _values = self._opt_state()
        for name, st in tensors.items():
            for key, t in st.items():
                out[L.opt_name(name, key)] = t
        return out

    def prime(self) -> None:
        """Take the live state as the reconstruction (at a base: replay starts there)."""
        self.recon = {n: to_bits(t, n) for n, t in self._state_tensors().items()}
        tensors, values = self._opt_state()
        self.layout = {"tensors": {n: sorted(st) for n, st in tensors.items()},
                       "values": values}

    def forget(self, names: Sequence[str]) -> None:
        """The next step logs these tensors whole (raw)."""
        for n in names:
            self.recon.pop(n, None)

    def digest(self, params: Sequence[str]) -> int:
        """Digest of the reconstruction (what replay rebuilds; the live state when the
        codec is lossless) over the parameters ``params`` and their optimizer state."""
        lay = self.layout or {"tensors": {}, "values": {}}
        return L.digest_parts(
            (self.recon[n][1], [(k, self.recon[L.opt_name(n, k)][1])
                                for k in lay["tensors"].get(n, [])]
             + list(lay["values"].get(n, {}).items()))
            for n in params)

    def capture(self, specs: list[Spec], side: dict[str, Any], *, lossless: bool) -> None:
        """Append to ``specs`` the deltas of this step (``lossless``: a base follows, so
        every difference is exact), and the optimizer layout to ``side`` when it changed."""
        o = self._opts
        lossy = o["delta_codec"] != "xor" and not lossless
        cur = self._state_tensors()
        for name, t in cur.items():
            tag, view = bits_view(t, name)
            old = self.recon.get(name)
            if old is None or old[0] != tag or old[1].shape != view.shape:
                arr = view.copy() if _shares_mem(view, t) else view
                specs.append(raw_spec(name, tag, arr))
                self.recon[name] = (tag, arr.copy())
                continue
            ref = old[1]
            if lossy and tag in FLOAT_TAGS and tag not in ("F8_E4M3", "F8_E5M2") \
                    and view.size >= o["delta_min_numel"] and not name.endswith("/step"):
                spec, new = _lossy_delta(name, tag, view, ref, o)
                if spec is not None:
                    specs.append(spec)
                    self.recon[name] = (tag, new)
                continue
            if same_bytes(view, ref):
                continue
            enc = codecs.encode("xor", view, tag, ref=ref)
            specs.append(Spec(name, tag, tuple(view.shape), enc, o["delta_zstd"]))
            np.copyto(ref, view)
        for n in [n for n in self.recon if n not in cur]:
            del self.recon[n]
        tensors, values = self._opt_state()
        layout = {"tensors": {n: sorted(st) for n, st in tensors.items()}, "values": values}
        if self.layout is None or not L.same(layout, self.layout):
            side["opt_layout"] = layout
            self.layout = layout


__all__ = ["DELTA_CODECS", "DeltaCapture"]
