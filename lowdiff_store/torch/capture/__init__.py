"""Training: :class:`~.checkpointer.DiffCheckpointer` and the parts it composes (options,
gradient capture, side-channel tracking, the sink into the asynchronous writer),
weight-delta capture, ``extra_state``, and the cost meter behind ``"auto"`` tuning. Bases
(when one is due, how it is copied and handed over, base 0, reference, streamed and
background bases) have a folder of their own, :mod:`.bases`, whose guide tells a base's
life from start to end. Imports the rooms below it."""
