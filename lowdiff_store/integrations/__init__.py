"""Trainer integrations, the layer above :mod:`lowdiff_store.torch`.

- :mod:`lowdiff_store.integrations.transformers`: ``LowDiffCallback`` for the Hugging Face
  ``Trainer``;
- :mod:`lowdiff_store.integrations.lightning`: ``LowDiffCallback`` for Lightning's
  ``Trainer``;
- :mod:`lowdiff_store.integrations.torchtitan`: ``LowDiffCheckpointManager`` for
  torchtitan's ``Trainer`` (a checkpoint manager, set in its config).

Each submodule imports its framework (and torch) when it is imported; this package itself
imports nothing heavy. accelerate's plain loops need no integration: ``DiffCheckpointer``
takes the prepared optimizer as is. See ``docs/integrations.md``.
"""

from __future__ import annotations

__all__: list[str] = []
