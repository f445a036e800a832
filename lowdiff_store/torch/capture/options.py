"""The checkpointer's options: one frozen, validated object built from the keyword arguments
of :class:`~lowdiff_store.torch.capture.checkpointer.DiffCheckpointer`.

:data:`DEFAULTS` is the table of advanced options in ``docs/torch.md`` ("Python API
summary"), derived from the fields of :class:`CheckpointerOptions` so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...errors import ConfigError, Reason
from ..compressors.topk import GradCompressor
from .delta_capture import DELTA_CODECS
from .sink import WRITER_OPTIONS

#: the keyword arguments that are not advanced options
_NAMED = ("mode", "snapshot_every", "batch", "writer")


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every option of one checkpointer, checked when built (a bad value raises
    ``ConfigError`` naming the option). ``writer``: the options passed to the writer
    (:data:`~lowdiff_store.torch.capture.sink.WRITER_OPTIONS`)."""

    mode: str = "grad"                 # "grad" | "delta"
    snapshot_every: int | str = 100    # an int >= 1 | "auto"
    batch: int | str = 1               # an int >= 1 | "auto"
    capture: str = "dense"             # grad mode: "dense" | "layerwise"
    digest_every: int = 10             # digest of params + optimizer state every K steps (0: never)
    grad_zstd: int | None = None       # zstd level for dense gradients (None: raw, zero-copy)
    delta_codec: str = "xor"           # delta mode: "xor" (lossless) | "q8" | "topk" | "lcc"
    delta_ratio: float = 0.01          # delta_codec="topk": fraction of entries kept
    delta_block: int = 256             # delta_codec="q8": elements per scale
    delta_bits: int = 3                # delta_codec="lcc": 2**bits - 1 exponent buckets
    delta_min_numel: int = 4096        # lossy codecs apply to float tensors at least this large
    delta_zstd: int | None = 3         # zstd level for xor deltas (None: raw)
    ef_state: str = "base"             # compressor residuals: "base" | "step"
    ef_zstd: int | None = None         # zstd level for per-step residuals
    resume: str = "continue"           # existing log: "continue" | "truncate"
    base_mode: str = "foreground"      # "background": a worker process makes bases from the log
    base_staging: str = "overlap"      # "overlap": copied beside forward/backward | "sync" | "live"
    staging_budget: int | None = None  # bytes of staging for bases (None: one copy of the state)
    exact_bases: bool = False          # a base waits for staging memory still being made
    base_slices: int | str | None = None  # >= 2 | "auto": each base streamed in slices over k
                                          # steps; 1: consistent bases; None: "auto" quietly
                                          # where vouched for on a CPU model (slices.py)
    mtbf: float | None = None          # auto tuning: the job's MTBF in seconds (None: 24 h)
    tuner: Mapping[str, Any] | None = None  # auto tuning: further AutoTuner keyword arguments
    writer_process: bool | str = "auto"  # a writer process (True), in-thread (False); "auto":
                                         # a process for a CUDA model (opening.py)
    records_in_flight: int = 2         # dense gradient records in flight: 2 (the one written,
                                       # the one captured) | 1 (half the memory: a capture
                                       # waits until the record before is written)
    ring_bytes: int | None = None      # writer_process: bytes of its ring (None: from the model)
    heap_pad: bool = True              # glibc: keep a lent record's worth of freed heap, not
                                       # trimmed each step (capture/heap.py)
    writer_nice: int = 5               # writer_process: added to its niceness (0: the trainer's)
    writer: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(cls, mode: str, snapshot_every: int | str, batch: int | str,
                       advanced: Mapping[str, Any]) -> CheckpointerOptions:
        """The options of ``DiffCheckpointer(..., mode=, snapshot_every=, batch=,
        **advanced)``; writer options in ``advanced`` go to :attr:`writer`."""
        writer = {k: v for k, v in advanced.items() if k in WRITER_OPTIONS}
        rest = {k: v for k, v in advanced.items() if k not in WRITER_OPTIONS}
        unknown = set(rest) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown option(s) {sorted(unknown)}; known: "
                              f"{sorted(DEFAULTS) + list(WRITER_OPTIONS)}")
        return cls(mode=mode, snapshot_every=snapshot_every, batch=batch, writer=writer,
                   **rest)

    def __post_init__(self) -> None:
        self._check_schedule()
        self._check_capture()

    def _check_schedule(self) -> None:
        if self.mode not in ("grad", "delta"):
            raise ConfigError(f"mode={self.mode!r} must be 'grad' or 'delta'")
        se = self.snapshot_every
        if se != "auto" and (type(se) is not int or se < 1):
            raise ConfigError(f"snapshot_every={se!r} must be an int >= 1 or 'auto'")
        if self.batch != "auto" and (type(self.batch) is not int or self.batch < 1):
            raise ConfigError(f"batch={self.batch!r} must be an int >= 1 or 'auto'")
        if self.base_mode not in ("foreground", "background"):
            raise ConfigError(f"base_mode={self.base_mode!r} must be 'foreground' or "
                              f"'background'")
        if self.base_staging == "live" and self.base_slices == 1:
            raise ConfigError("base_staging='live' applies to streamed bases (base_slices)")
        if self.base_staging not in ("overlap", "sync", "live"):
            raise ConfigError(f"base_staging={self.base_staging!r} must be 'overlap', 'live' or "
                              f"'sync'")
        bs = self.base_slices
        if bs is not None and bs != "auto" and (type(bs) is not int or bs < 1):
            raise ConfigError(f"base_slices={bs!r} must be an int >= 1 (1: consistent "
                              f"bases), 'auto' or None (the default)")
        if type(self.exact_bases) is not bool:
            raise ConfigError(f"exact_bases={self.exact_bases!r} must be True or False")
        sb = self.staging_budget
        if sb is not None and (type(sb) is not int or sb < 1):
            raise ConfigError(f"staging_budget={sb!r} must be an int >= 1 (bytes) or None")
        if self.mtbf is not None and not (isinstance(self.mtbf, (int, float))
                                          and 0 < self.mtbf < float("inf")):
            raise ConfigError(f"mtbf={self.mtbf!r} must be a positive number of seconds")
        if self.tuner is not None and not isinstance(self.tuner, Mapping):
            raise ConfigError("tuner must be a dict of AutoTuner keyword arguments")
        if type(self.writer_process) is not bool and self.writer_process != "auto":
            raise ConfigError(f"writer_process={self.writer_process!r} must be True, False "
                              f"or 'auto'")
        if self.records_in_flight not in (1, 2) or type(self.records_in_flight) is not int:
            raise ConfigError(f"records_in_flight={self.records_in_flight!r} must be 1 or 2")
        rb = self.ring_bytes
        if rb is not None and (type(rb) is not int or rb < 1 << 20):
            raise ConfigError(f"ring_bytes={rb!r} must be an int >= 1 MiB (bytes) or None")
        if type(self.writer_nice) is not int or not 0 <= self.writer_nice <= 19:
            raise ConfigError(f"writer_nice={self.writer_nice!r} must be an int in 0..19")
        if type(self.heap_pad) is not bool:
            raise ConfigError(f"heap_pad={self.heap_pad!r} must be True or False")
        if self.resume not in ("continue", "truncate"):
            raise ConfigError(f"resume={self.resume!r} must be 'continue' or 'truncate'")
        if type(self.digest_every) is not int or self.digest_every < 0:
            raise ConfigError("digest_every must be an int >= 0")

    def _check_capture(self) -> None:
        if self.capture not in ("dense", "layerwise"):
            raise ConfigError(f"capture={self.capture!r} must be 'dense' or 'layerwise'")
        if self.capture == "layerwise" and self.mode != "grad":
            raise ConfigError("capture='layerwise' applies to dense gradients in mode='grad'")
        if self.delta_codec not in DELTA_CODECS:
            raise ConfigError(f"delta_codec={self.delta_codec!r} must be 'xor', 'q8', 'topk' "
                              f"or 'lcc'")
        if type(self.delta_bits) is not int or not 1 <= self.delta_bits <= 8:
            raise ConfigError("delta_bits must be an int in 1..8")
        if self.ef_state not in ("base", "step"):
            raise ConfigError(f"ef_state={self.ef_state!r} must be 'base' or 'step'")
        if not 0.0 < float(self.delta_ratio) <= 1.0:
            raise ConfigError("delta_ratio must be in (0, 1]")

    def check_compressor(self, compressor: Any) -> None:
        """``compressor`` (or None) fits these options: a :class:`GradCompressor`, not yet
        attached, with ``mode="grad"`` and dense capture."""
        if compressor is None:
            return
        if not isinstance(compressor, GradCompressor):
            raise ConfigError("compressor must be a TopKCompressor, TernGradCompressor, "
                              "QSGDCompressor or DeMoCompressor")
        if self.mode != "grad":
            raise ConfigError("a compressor only applies to mode='grad'")
        if compressor.optimizer is not None:
            raise ConfigError("the compressor is already attached: pass it unattached, the "
                              "checkpointer attaches it", reason=Reason.NOT_ALLOWED)
        if self.capture == "layerwise":
            raise ConfigError("capture='layerwise' applies to dense gradients in mode='grad'")

    def advanced(self) -> dict[str, Any]:
        """The advanced options (the keys of :data:`DEFAULTS`) as a dict."""
        return {k: getattr(self, k) for k in DEFAULTS}

    def truncating(self) -> CheckpointerOptions:
        """These options with ``resume="truncate"``."""
        return replace(self, resume="truncate")


#: Advanced options and their defaults (the table in docs/torch.md, "Python API summary").
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(CheckpointerOptions)
                            if f.name not in _NAMED}


__all__ = ["DEFAULTS", "CheckpointerOptions"]
