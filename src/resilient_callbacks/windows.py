"""A plain loop's ``step()`` called per micro-batch of a gradient accumulation window: the
state's optimizers did not step since the previous ``step()`` (:class:`StepWatch`), and their
parameters hold gradients (the window's so far, in ``.grad``, which no checkpoint holds). A save there would
resume without them, and a resumed run would train on differently from one never stopped; so a
save due there (periodic, a preemption's) is made at the first ``step()`` after the window's
optimizer step, and ``save_on_exception`` keeps the last step before the window as its
consistent point. A preemption's save is held within bounds (:meth:`StepWatch.hold_limit`,
half the grace period), then the step before the window is saved; a ``final`` save inside a
window is made as it is, with a warning (:meth:`.Trigger.decide`). Which ranks call what: every rank at every ``step()``; with several ranks a
save is not held (the ranks could differ, and a save one rank held would leave the others
waiting in its collectives): a warning says so, once.
"""

from __future__ import annotations

import logging
import operator
import weakref
from typing import Any

import torch

from . import notices, statetree
from .optim import hookable, two_pass_base
from .optimizer_steps import Entry, Follower

log = logging.getLogger("resilient_callbacks")

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


def _versions(tensors: list[Any]) -> list[int]:
    """Each tensor's version counter (-1 for a None)."""
    return [-1 if t is None else t._version for t in tensors]


class StepWatch:
    """Notices whether the state's optimizers stepped between two ``step()`` calls: their
    step counts in the process's registry (:mod:`.optimizer_steps`: one step pre-hook per
    optimizer), followed from the first ``step()`` that sees each, and again where its hook
    was removed since or it is back in the state (then, as for a new optimizer, the call is
    outside a window: the updates before were not seen). Only the optimizers in the state
    given to ``step()`` count: another one's step (a second model's optimizer, in another
    Checkpointer's state or taken out of this one) ends no window. A ``step()`` after which
    every optimizer of the last walk of the state stepped reads their counts alone; one after
    which some did and some did not walks the state again, as one of them may have left it
    (a loop whose optimizers step at different ``step()`` calls pays a walk there); a
    ``GradScaler``'s
    ``update()`` (its scale tensor written; a step it skipped for an inf gradient calls no
    optimizer's ``step()``); and, where no hook fired, the parameters' version counters (an
    optimizer outside the state wrote them: an adapter's stand-in that never steps, a SAM
    wrapper whose ``step()`` is never called). Past a window's first ``step()``, a backward
    pass must also have written the gradients since the previous ``step()`` (their version
    counters or tensors changed): a loop that calls ``step()`` without updates and without
    backward passes (an evaluation, a rollout, an optimizer the loop does not step), its
    gradients left from the last update, has a save due there held one ``step()`` at most,
    not until the next update (a preemption's save, held so, was never made). (A micro-batch
    without a backward pass inside a window is not told from that: a save due there is made.)

    Cheap micro-batches: past a window's first ``step()``, in a loop whose updates the hooks
    tell (one fired before) and while the window is shorter than the longest seen, a
    ``step()`` after which each param group's first or last parameter holds a new gradient
    (tensor or version) is a micro-batch without more: no other parameter's gradient nor
    version counter is read (2000 tensors: 0.5-1 ms a call). An update no hook saw (an in-place
    write outside the state's optimizers) inside such a window is then noticed at the first
    ``step()`` that reads them all again (where the window reaches the longest length seen,
    or where the end gradients did not change), not at once; and a ``step()`` without a backward
    pass right after such a call is held one call (its baseline, every gradient, was not
    read), as the first call after an update is.

    Several optimizers in one state (a GAN's generator and discriminator): the window is the
    state's, not each optimizer's. A ``step()`` after which any of them began a step is
    outside a window, so a loop that steps one of them at every ``step()`` while another
    accumulates over several (the discriminator stepped at each call, the generator every 4th)
    shows no window: a save due inside the generator's window is made there (periodic,
    preemption and ``save_on_exception`` alike), and a run resumed from it trains on without
    that window's gradients, not as the uninterrupted run, with nothing said. Per-optimizer
    windows would compare each optimizer's gradients at every call, and the gradients one
    optimizer's backward pass leaves in another's parameters (the generator's loss through
    the discriminator, which its next ``zero_grad`` drops) would read as a window that may never
    end; not done. Such a loop calls ``step()`` once per step of the accumulating optimizer
    (docs/guide.md, "gradient accumulation"). The adaptive interval's step time is not
    measured here: it is the time between ``step()`` calls (:meth:`.Trigger.step_started`),
    whichever optimizers stepped in between."""

    def __init__(self) -> None:
        self._steps = Follower()  # the optimizers' step counts (optimizer_steps.py)
        self._seen: dict[Entry, int] = {}  # each one's step() calls at the last look
        self._scales: list[tuple[int, int]] = []  # the GradScalers' scale tensors, versions
        self._versions: list[int] | None = None  # the parameters' at the last step() (no hook)
        self._grads: list[Any] | None = None  # their gradients' (id, version) then
        self._ends: list[Any] | None = None  # ... of each param group's first and last only
        self._fired = False  # a hook fired at some step(): they tell this loop's steps
        self._warned = False
        #: step() calls since the last one after an update (the current window's so far)
        self.run = 0
        #: the longest span between two updates in this run, in step() calls (a window's)
        self.longest = 0
        self._end = ""  # what _inside() saw: "update", "reset" (no window there), "" (unknown)
        # from the last state walk: its GradScalers (weak references), and whether a leaf has a
        # mid_step attribute (an Accumulation: its window's hook flags are read after it)
        self._scalers: list[weakref.ref[Any]] = []
        self._mid_step_leaf = True

    def inside(self, state: Any, world_size: int) -> str | None:
        """At ``step()``: what says this call is inside an accumulation window (the module's
        docstring), or None; counts the calls of the windows (:attr:`run`, :attr:`longest`)."""
        self._end = ""
        found = self._inside(state, world_size)
        if world_size > 1:  # no save is held there: no window counted (nor, at each call, the
            return found  # step before one recorded: Checkpointer.step)
        self.run += 1
        if self._end == "update":
            self.longest = max(self.longest, self.run)
        if self._end:
            self.run = 0
        return found

    def hold_limit(self) -> int:
        """Asked as a preemption's save is first held in the current window: at how many of
        its step() calls the hold ends anyway (:meth:`.Trigger.decide`), about twice the
        longest window seen in this run, or the current one so far where it is longer (the
        first window, never ended), at least 2: a window that lasts forever (backward passes
        with no update: gradient-norm probing, an optimizer not in the state) held the save
        until the process was killed."""
        return 2 * max(self.longest, self.run, 1)

    def _updated(self) -> bool:
        """Whether an optimizer hooked at an earlier call began a step since the previous
        ``step()``, read from the hooks' flags alone (no walk of the state: the cost of every
        ``step()`` of a loop that updates at each); the GradScalers' scales are read again from
        the last walk's. False: walk the state (:meth:`_inside`)."""
        seen = self._seen
        if self._mid_step_leaf or not seen:
            return False
        if any(e.calls == n for e, n in seen.items()):  # (some stepped: one may have left the
            return False  # state since the walk, and its step ends no window of the state's)
        for e in seen:
            seen[e] = e.calls
        self._scales = [
            (id(t), t._version)
            for ref in self._scalers
            if (sc := ref()) is not None and isinstance(t := sc._scale, torch.Tensor)
        ]
        self._fired = True
        self._end = "update"
        self._versions = self._grads = None
        return True

    def _inside(self, state: Any, world_size: int) -> str | None:
        """:meth:`inside`'s test. Cheap where an optimizer stepped: no parameter is looked at,
        nor the state where a hooked one did (:meth:`_updated`)."""
        if self._updated():
            return None
        leaves = [v for _, v in statetree.leaves(state)]
        self._mid_step_leaf = any(
            not isinstance(v, torch.nn.Module) and hasattr(v, "mid_step") for v in leaves
        )
        scalers = [v for v in leaves if isinstance(v, torch.amp.GradScaler)]
        self._scalers = [weakref.ref(v) for v in scalers]
        # an Accumulation's window, which the trigger holds saves for on every rank: this
        # step() is as its loop calls it (the hooks' flags are read at the next call). (Not
        # asked of a module: its __getattr__ raises for a missing name, at every step.)
        if any(
            not isinstance(v, torch.nn.Module) and getattr(v, "mid_step", False) is True
            for v in leaves
        ):
            return None
        found = [v for v in leaves if isinstance(v, torch.optim.Optimizer)]
        # (and the optimizer a SAM-style wrapper steps: its own step() may never be called)
        opts = [hookable(o) for o in found] + [b for o in found if (b := two_pass_base(o))]
        scales = [(id(t), t._version) for v in scalers if isinstance(t := v._scale, torch.Tensor)]
        stepped, self._scales = scales != self._scales, scales
        new = False
        seen: dict[Entry, int] = {}  # the state's optimizers alone (the class's docstring)
        for opt in opts:
            entry, fresh = self._steps.follow(opt)
            if fresh or entry not in self._seen:  # (new, its hook lost, or back in the state)
                new = True
            elif entry.calls != self._seen[entry]:
                stepped = self._fired = True
            seen[entry] = entry.calls
        self._seen = seen
        if not opts or stepped or new:
            # (hooks registered now: the updates before them were not seen)
            self._end = "update" if stepped else "reset" if new else ""
            self._versions = self._grads = self._ends = None
            return None
        groups = [g["params"] for o in opts for g in o.param_groups]
        ends = list(map(_GRAD, [p for ps in groups if ps for p in (ps[0], ps[-1])]))
        ends_before, self._ends = self._ends, [*map(id, ends), *_versions(ends)]
        if (
            ends_before is not None
            and ends_before != self._ends
            and self._fired
            and self._versions is not None
            and self.run + 1 < self.longest
            and any(g is not None for g in ends)
        ):
            # a micro-batch of a window as the ones before (the class's docstring): no other
            # parameter is read
            self._grads = None  # (none read at this call)
            return self._micro_batch(world_size)
        params = [p for ps in groups for p in ps]
        grads = list(map(_GRAD, params))
        if all(g is None for g in grads):
            self._end = "reset"
            self._versions = self._grads = self._ends = None
            return None
        before, self._versions = self._versions, list(map(_VERSION, params))
        # (ids, not the tensors: a zero_grad(set_to_none=True) frees them)
        grads_before, self._grads = self._grads, [*map(id, grads), *_versions(grads)]
        del grads
        if not (self._versions == before if before is not None else self._fired):
            self._end = "update" if before is not None else ""
            return None
        if grads_before is not None and grads_before == self._grads:
            self._end = "reset"
            return None  # no backward pass since the previous step(): no micro-batch either
        return self._micro_batch(world_size)

    def _micro_batch(self, world_size: int) -> str | None:
        """:meth:`_inside` found this ``step()`` inside a window: what says so, or None with
        several ranks (a warning says once why no save is held)."""
        if world_size > 1:
            if not self._warned:
                self._warned = True
                notices.log_once(
                    log,
                    "step() was called with no optimizer step since the previous step() while "
                    "the parameters hold gradients (a step() per micro-batch of a gradient "
                    "accumulation window?): a save there resumes without the window's "
                    "gradients. Call step() once per optimizer step, after it, with the number "
                    "of optimizer steps",
                )
            return None
        if not self._warned:
            self._warned = True
            log.info(
                "step() is called inside gradient accumulation windows (no optimizer step since "
                "the previous step(), gradients in .grad): a save due there is made at the "
                "first step() after the window's optimizer step"
            )
        return "this step() (no optimizer step since the previous step(), gradients in .grad)"

    def release(self) -> None:
        """Let go of the optimizers (close): their hooks are removed."""
        self._steps.release()
        self._seen.clear()
