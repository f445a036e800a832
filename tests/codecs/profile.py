"""Example counts of the codec property tests under the hypothesis profiles of
``tests/conftest.py``: a test's own count, or the loaded profile's where that is larger
(``HYPOTHESIS_PROFILE=many`` runs every codec property test with many random examples)."""

from __future__ import annotations

from hypothesis import settings


def examples(n: int) -> int:
    """``n``, or the loaded profile's ``max_examples`` when it asks for more."""
    return max(n, settings.default.max_examples)
