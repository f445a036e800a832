"""Training: :class:`~.checkpointer.DiffCheckpointer` and the parts it composes (options,
gradient capture, side-channel tracking, base staging, the sink into the asynchronous
writer), weight-delta capture, ``extra_state``, background bases and their worker process,
and the cost meter behind ``"auto"`` tuning. Imports the rooms below it."""
