"""Bases: how a checkpointer takes the full state of a step, from the moment one is due to
the moment it is durable. Read this first, then the modules in the order below; each step
names the module and the function that does it.

The modules, in reading order:

- ``handover.py``: when a base is due, and the way out of a finalized step to the writer
  (its record first, then its base). :class:`~.handover.Handover`.
- ``stager.py``: what a base holds, listed from the live objects and copied.
  :class:`~.stager.BaseStager`.
- ``copy.py``: the memory a base is copied into and the copy itself (staging buffers,
  pinning, a copy job in pieces on a helper thread). :class:`~.copy.StagingArea`,
  :class:`~.copy.CopyJob`.
- ``initial.py``: base 0 from an existing checkpoint, and reference bases
  (``initial_base=``, ``refer_base``). :class:`~.initial.StartingPoint`.
- ``slices.py``: streamed bases, the pure part: which parameters go in which slice, when
  each slice is taken, and whether a log may stream at all. :class:`~.slices.SliceSchedule`.
- ``streaming.py``: streamed bases, the taking of slices. :class:`~.streaming.Streamer`.
- ``background.py`` and ``worker.py``: ``base_mode="background"``, bases made from the log
  by a worker process. :class:`~.background.BackgroundBases`.

1. When a base is due
---------------------

After each optimizer step the checkpointer's post-step capture
(``DiffCheckpointer._capture_after``) calls :meth:`.Handover.after_step` with the step's
:class:`~.handover.PendingStep`. Consistent bases (the default, ``base_slices=1``):
:meth:`.Handover.base_due` says a base is due every ``snapshot_every`` steps (counted from
the last base when the interval is tuned) and at every step after one whose base was put
off or dropped (:attr:`.Handover.owed`); then :meth:`.Handover.take_base` stages it.
Otherwise :meth:`.Handover.prepare` has the next base's staging memory made when the next
base is near (within half an interval or 3 steps, and after the first step), so no base
waits for memory to be allocated. Streamed bases: the hand-over's ``streamer`` (a
:class:`~.streaming.Streamer`) takes the decision instead (section 5). Background bases:
:meth:`.Handover.take_base` only notes the request (section 6).

2. What is copied, and into what memory
---------------------------------------

:meth:`.BaseStager.stage` lists the state after the step as a base made from the log lays
it out (:func:`~lowdiff_store.torch.replay.materialize.live_base_arrays`: parameters,
optimizer state, buffers, the compressor's residuals, RNG states, a gradient source's
state): views of CPU tensors, placeholders for device tensors (``_Live``). It asks the
:class:`~.copy.StagingArea` for a buffer of the bytes that need copying
(:meth:`~.copy.StagingArea.acquire`, which never allocates). Buffers (changed by the next
forward) and layer-wise residuals (changed during backward) are copied at once; the
parameters and optimizer state, which nothing changes until the next optimizer step, are
cut into pieces of :data:`~.copy.PIECE` bytes (:func:`~.copy.plan_pieces`), a
:class:`~.copy.CopyJob` that the stager's helper thread (:class:`~.copy.CopyThread`) runs
beside the next forward and backward, taking each piece's CRC32C as it copies it. Device
tensors are copied on a side stream into the pinned buffer, one copy per pinned piece
(``BaseStager._device_copy``, :func:`~.copy.pin_spans`), ordered by a CUDA event. With
``base_staging="sync"`` the whole copy is made inside the step.

The staging memory is made on the helper thread only: :meth:`~.copy.StagingArea.want`
records the need and :meth:`~.copy.StagingArea.provide` allocates pageable memory
(:func:`~.copy.new_slot`), faults it in (:meth:`~.copy.StagingArea.touch`,
``MADV_POPULATE_WRITE``) and, for device tensors, registers it as pinned with the CUDA
driver (:func:`~.copy.pin`), both in paced pieces of :data:`~.copy.PIN_PIECE` bytes
(:data:`~.copy.PACE`). It is asked for once the state is complete
(:meth:`.BaseStager.complete`: every trained parameter has its optimizer state and
residual), through :meth:`.BaseStager.prepare`, so a run makes its buffer once. Within
``staging_budget`` (None: one buffer as large as a base, or several within
:data:`~.copy.SMALL_STATES`). A base that finds no buffer ready is put off to the next
step (``base_deferred``), never waited for, except where bases must fall on their step
(``exact_bases``, several ranks: ``BaseStager.aligned``) and for slices: those wait
(``BaseStager._wait_for_slot``, ``base_wait_s``). A buffer let go (too small, or at close)
is given back on the helper thread, in paced pieces (:func:`~.copy.give_back`).

3. Settled, then handed to the writer, then durable
---------------------------------------------------

Before anything may change the state (the next optimizer step's pre-hook, ``flush``,
``close``), :meth:`.Handover.finish` calls :meth:`.Handover.settle`:
:meth:`.BaseStager.settle` finishes the copy (:meth:`.CopyJob.settle` copies the pieces
not started from the other end and waits for those in progress) and compares every
copied tensor's version counter with the one it had when staged. A tensor changed in
place meanwhile drops the base (:meth:`.BaseStager.drop`, ``base_dropped``), the next
step takes one, and copies are made inside the step from then on. The digest of the state
(every ``digest_every`` steps) is computed beside the step on the same helper thread
(:meth:`.BaseStager.digest`, a :class:`~.copy.Later`) and settled here too.

The finalized step carries its base's metadata (the non-tensor state as of the
finalize: ``SideChannel.base_meta``, called from ``DiffCheckpointer._finalize``).
:meth:`.Handover.hand_over` gives the writer the step's record
(:meth:`.Handover.append`), then its base (:meth:`.Handover.write_base`; a base whose
device copies still run waits as :attr:`.Handover.late` until the next hand-over, so the
training thread does not wait for them). :meth:`.Handover.send_base` passes the staged
arrays with the CRC32Cs the copy computed to the sink
(:meth:`~lowdiff_store.torch.capture.sink.LogSink.write_base`) with a ``release``
callback: the in-process writer does not copy them
(:meth:`~lowdiff_store.writer.AsyncLogWriter.write_base`; its base thread waits until
every diff before the base is durable, writes the base file and publishes it with a
manifest commit: ``log/writer.py`` ``LogWriter.write_base``), and a writer process copies
them into its ring (``capture/process_sink.py``). Once the writer is done with the
arrays, :meth:`.BaseStager.release` gives the buffer back to the staging area.

4. Base 0 and reference bases
-----------------------------

The base a checkpointer starts with (step 0, or the restored step when the restore was
not exact: ``capture/opening.py`` ``resume_point``) is taken by ``DiffCheckpointer._open``
with :meth:`.Handover.take_base` (``views=True``): :meth:`.BaseStager.stage_views` lists
the live tensors with no staging memory (buffers, layer-wise residuals and, for a model
on a device, small host tensors are copied; device tensors become host copies).
:meth:`.Handover.write_base` takes its CRC32Cs at once (:func:`~.initial.crc_of`), so
bytes changed before the writer reads them never pass as the state of step 0, and wraps it
in a :class:`~.handover.LiveBase` that compares version counters when the writer is done.
The constructor returns before it is durable; the first optimizer step (or ``flush``,
``close``) waits in :meth:`.Handover.settle_first` only while the writer still reads live
tensors (``first_base_wait_s``), and a changed tensor makes the next step take a base. That
wait is in the first of all pre-step hooks (``step_hooks.py``), before a compressor's makes
new residuals while base 0 would still hold the old ones.

``initial_base=`` (:func:`~.initial.start_from`): the external checkpoint is scanned and
checked, loaded into the model and optimizer (:func:`~.initial.load_initial`, or matched
without loading: :func:`~.initial.match_live`), and base 0 refers to each tensor whose
bits equal the checkpoint's instead of storing it (:meth:`.StartingPoint.base`, called
by :meth:`.Handover.write_base`; the reference table is ``log/reference.py``).
``DiffCheckpointer.refer_base`` (:meth:`.Handover.refer`) does the same for the base of a
later step, against a checkpoint a trainer just saved: the step's base (staged now with
:meth:`.Handover.take_base`, ``foreground=True``, if none was due) is written as a
reference base.

5. Streamed bases (``base_slices=k``)
-------------------------------------

At open, ``capture/opening.py`` ``make_log_meta`` calls :func:`~.slices.plan_slices`:
:func:`~.slices.streaming` says whether this log may stream (and records why not in the
log's ``base_slices``), and :meth:`.Streamer.attach` gives the hand-over a streamer. The
parameters are cut into k contiguous groups of near equal global size
(:func:`~.slices.slice_groups`, the same on every rank); :meth:`.SliceSchedule.due` says
after which step each slice of a base is taken (the k steps ending at a multiple of
``snapshot_every``; :meth:`.SliceSchedule.restart_now` after a slice could not be taken;
:meth:`.SliceSchedule.tune` chooses k for ``"auto"``). :meth:`.Streamer.take_slice`
stages slice i as a base limited to one group (:class:`~.stager.Slice`: the first slice
also holds everything that is not a parameter's) with :meth:`.BaseStager.stage`; it waits
for staging memory rather than be put off, a bounded time (:meth:`.Streamer._wait_s`: a
store in an outage holds the slices it cannot write), after which the base is abandoned
and the next slices are put off without waiting until one finds memory
(:attr:`.Streamer.starved`); the memory is sized from the two largest slices, not the
state (:meth:`.BaseStager.set_slices`). The slice goes to the writer as
any base, with its ``"slice"`` metadata (``log/writer.py`` ``_write_slice``: a file named
by no manifest; the last slice commits the base). A slice whose copy saw a change abandons
its base (:meth:`.Streamer.abandon`) and a new one starts at the next step.

The live mode (``base_staging="live"``, every tensor on the host): the slices after the
first are not copied. :meth:`.BaseStager.stage_views` lists them and
``Streamer._write_live`` hands them to the writer at once, as a
:class:`~.handover.LiveBase`; the next :meth:`.Handover.hand_over` waits until the writer
has read them (:meth:`.Streamer.settle_live`, ``slice_wait_s``), and a tensor changed
meanwhile abandons the base. That hand-over is today the post-step hook's own, at the end
of the same step, so the write does not yet run beside the next forward and backward.

Where the consistent path remains, and why: base 0 and a base at a restored step are the
state training starts from, which no earlier step in the log rebuilds (a streamed base is
replayed from its first slice's step), so they are whole; they need no staging memory
either (written from views). The default, ``base_slices=None``, streams (``"auto"``) for a
model on the CPU and keeps consistent bases on an accelerator (streamed bases have not
been run on a GPU yet): :func:`~.slices.plan_slices`. :func:`~.slices.streaming` keeps
consistent bases for an optimizer outside :data:`~.slices.PER_TENSOR_OPTIMIZERS` (its
step is not vouched to treat each parameter on its own), a lossy ``delta_codec``, a
layout that cannot replay slices (``Layout.streamed_why``: DeMo's rank-local replicas)
and ``base_mode="background"``. ``refer_base`` stages a whole base at a step that took none.
Reference bases and streamed bases do not mix: with ``base_slices`` in force
``refer_base`` raises ``ConfigError(not_allowed)`` and writes nothing (a slice may hold the
step, and the staging is sized for two slices); ``base_slices=1`` is what it needs.

6. Background bases (``base_mode="background"``)
------------------------------------------------

:func:`~.background.check_background` refuses what a worker could not make bit for bit (at
setup); :meth:`.Handover.start_background` starts the worker process. A due base becomes a
request (:meth:`.BackgroundBases.request`); :meth:`.Handover.poll` sends it once its step
is durable, and ``worker.py`` replays the log onto the newest base at or before it and
publishes the base (``replay/materialize.py``, ``compaction.publish_base``). If the worker
fails, bases are taken in the foreground again.

7. Counters in ``DiffCheckpointer.stats()``
-------------------------------------------

Gathered by :meth:`.Handover.add_stats`: ``bases`` (bases handed to the writer or made by
the worker; a streamed base counts once, at its last slice), ``base_stage_s`` and
``base_settle_s`` (training-thread time staging and settling), ``base_wait_s`` (waiting
for staging memory), ``base_dropped`` (copies that saw a change), ``base_deferred``
(bases put off), ``base_staging_bytes`` and ``base_staging_pinned_bytes`` (the most
staging memory held at once, and its pinned part), ``first_base_wait_s``, ``base_slices``
(slices taken) and ``slice_wait_s``, the worker's ``background_*`` and the writer's
``writer_bases`` and ``writer_base_s``.

Not in this room
----------------

- ``capture/lending.py`` and ``capture/in_flight.py`` are about dense gradient *records*:
  gradients lent to a record instead of copied, and the bound on records holding
  gradient-sized memory in flight (:class:`~lowdiff_store.torch.capture.in_flight.Ticket`,
  which a :class:`~.handover.PendingStep` carries to the writer). A base never goes
  through them; :class:`~lowdiff_store.torch.capture.grad_capture.GradCapture` owns them.
- ``writer/staging.py`` is the torch-free writer's staging pool: it copies a record's
  arrays before ``append`` returns. The checkpointer's bases do not use it (they are
  handed over with ``release``: their memory is the staging area's); the core below
  ``lowdiff_store/torch/`` never imports torch (``tests/test_imports.py``).
- Writing and publishing a base file, and reading slices back as one base, are the log's
  (``log/writer.py``, ``log/manifest.py``, ``log/streamed.py``); the layout of a base is
  shared with bases made from the log (``replay/materialize.py``); replay from a streamed
  base is ``replay/engine.py``.
"""
