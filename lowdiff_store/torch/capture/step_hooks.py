"""The hooks a checkpointer puts on the objects it records, and their order among the
user's hooks: a pre-step hook kept first (it settles the copy of the last base), the
optimizer's pre-step hook (kept last: it captures what the step consumes),
its first post-step hook (kept first: a copy beside the step ends before any other hook can
touch the gradients), a post-step hook, ``scaler.step`` wrapped on the instance (a step the
scaler skips), with layer-wise capture a post-accumulate-grad hook per parameter, and the
copy-on-write of lent gradients (:mod:`.lending`: a hook before each CPU parameter's
accumulation, ``zero_grad`` of the optimizer and the model wrapped on the instances).

The hooks hold the checkpointer weakly; the first pre-step hook settles its pending step
(``_out.settle(_pending)``: the copy of the last base ends before any hook or the step
changes the state); the others call ``_pre_hook(args, kwargs)``,
``_copy_done()``, ``_post_hook()`` (through its layout's ``post_step``, which may run it
later: after a local-update wrapper's step) and ``_scaler_step(orig, optimizer, *args,
**kwargs)``; layer-wise hooks hold its gradient capture weakly and call
``stage_layer(name, param)``. The layout's own hooks (``attach()``) are kept with them."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch


class StepHooks:
    """The hooks of ``owner`` on ``optimizer``, ``scaler`` (if any) and, for layer-wise
    capture, each of ``layers`` (name, parameter), which stage into ``grads`` (a
    :class:`~.grad_capture.GradCapture`), and those of ``layout`` (a
    :class:`~.layout.Layout`: its ``attach()``; its ``post_step`` runs the post-step
    capture). :meth:`remove` takes them all off."""

    def __init__(self, owner: Any, optimizer: torch.optim.Optimizer, scaler: Any,
                 grads: Any, layers: Sequence[tuple[str, torch.Tensor]],
                 layout: Any = None, model: Any = None) -> None:
        ref = weakref.ref(owner)
        self.optimizer = optimizer
        self.handles: list[Any] = []

        def pre(opt: Any, args: Any, kwargs: Any) -> Any:
            me = ref()
            return None if me is None else me._pre_hook(args, kwargs)

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None and layout is not None:
                layout.post_step(me._post_hook)
            elif me is not None:
                me._post_hook()

        def copied(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None:
                me._copy_done()

        def settle(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is None:
                return
            first = me._out.first
            if first is not None and first.reads_live:
                # (the first base still read from the live tensors: a compressor's pre-hook
                # would make its new residuals while the base holds the old ones alive,
                # a gradient's worth of memory more for the first step)
                me._out.settle_first()
            if me._pending is not None:
                me._out.settle(me._pending)

        # first of all pre-step hooks (a compressor's changes its residuals): the copy of
        # the last base ends, and the first base is read, before anything changes the state
        self._settle = optimizer.register_step_pre_hook(settle)
        self.handles.append(self._settle)
        self._keep_first(getattr(optimizer, "_optimizer_step_pre_hooks", None), self._settle)
        self._pre = optimizer.register_step_pre_hook(pre)
        self.handles.append(self._pre)
        self._copied = optimizer.register_step_post_hook(copied)
        self.handles.append(self._copied)
        self.handles.append(optimizer.register_step_post_hook(post))
        try:
            if scaler is not None:
                self.handles.append(_wrap_scaler_step(ref, scaler))
            if layout is not None:
                self.handles += layout.attach()
            gref = weakref.ref(grads)
            for name, p in layers:
                self.handles.append(
                    p.register_post_accumulate_grad_hook(_layer_hook(gref, name)))
            lender = getattr(grads, "lender", None)
            if lender is not None and getattr(grads, "source", None) is None:
                self.handles += _lending_hooks(lender, optimizer, model)
        except BaseException:
            self.remove()
            raise

    def capture_is_last(self, closure: Any) -> bool:
        """At the pre-step hook: nothing runs between our capture and the step's own code
        (no pre-step hook registered after ours, or the gradients come from a closure).
        Also keeps our first post-step hook first."""
        opt = self.optimizer
        hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
        last = closure is not None or not hooks or next(reversed(hooks)) == self._pre.id
        posts = getattr(opt, "_optimizer_step_post_hooks", None)
        if posts is not None and self._copied.id in posts:
            posts.move_to_end(self._copied.id, last=False)
        return last

    @staticmethod
    def _keep_first(hooks: Any, handle: Any) -> None:
        if hooks is not None and handle.id in hooks:
            hooks.move_to_end(handle.id, last=False)

    def move_pre_last(self) -> None:
        """Hooks registered after ours run after it and could change the gradients: keep
        our capture the last pre-step hook (their change is caught after the step)."""
        hooks = getattr(self.optimizer, "_optimizer_step_pre_hooks", None)
        hid = self._pre.id
        if hooks is not None and hid in hooks and next(reversed(hooks)) != hid:
            hooks.move_to_end(hid)

    def remove(self) -> None:
        """Take every hook off (idempotent)."""
        for h in self.handles:
            h.remove()
        self.handles = []


def _wrap_scaler_step(ref: weakref.ref[Any], scaler: Any) -> AttrRestore:
    orig = scaler.step

    def scaler_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        me = ref()
        if me is None or optimizer is not me.optimizer:
            return orig(optimizer, *args, **kwargs)
        return me._scaler_step(orig, optimizer, *args, **kwargs)

    scaler.step = scaler_step
    return AttrRestore(scaler, "step", scaler_step)


class AttrRestore:
    """Undo an instance attribute we set (``scaler.step``) if it is still ours."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value

    def remove(self) -> None:
        """Delete the attribute if it still holds our value."""
        if self.obj.__dict__.get(self.name) is self.value:
            del self.obj.__dict__[self.name]


def _lending_hooks(lender: Any, optimizer: Any, model: Any) -> list[Any]:
    """Copy-on-write of lent gradients (:mod:`.lending`): a hook before each CPU
    parameter's accumulation, and ``zero_grad`` of the optimizer and the model wrapped on
    the instances (an in-place zeroing copies them first)."""
    from .lending import zero_grad_wrapper

    handles: list[Any] = list(lender.hooks())
    ref = weakref.ref(lender)
    for obj in (optimizer, model):
        if obj is not None and "zero_grad" not in vars(obj):
            wrapped = zero_grad_wrapper(obj.zero_grad, ref)
            obj.zero_grad = wrapped
            handles.append(AttrRestore(obj, "zero_grad", wrapped))
    return handles


def _layer_hook(ref: weakref.ref[Any], name: str) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        me = ref()
        if me is not None:
            me.stage_layer(name, p)
    return hook


def drop_hooks(handles: list[Any]) -> None:
    """Remove ``handles`` quietly (the checkpointer was garbage-collected unclosed)."""
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass


__all__ = ["AttrRestore", "StepHooks", "drop_hooks"]
