"""Recovery: the replay engine that runs logged diffs through the optimizer or adds weight
deltas (:mod:`.engine`), restore into live objects and replay into a fresh state
(:mod:`.restore`), bases built from the log (:mod:`.materialize`), exports to other formats
and the torch-level description of a log. Imports :mod:`..core` and :mod:`..compressors`."""
