"""Emergency saves: on a preemption request, and of the last consistent step when training
fails with an exception (``save_on_exception``). One implementation for every adapter: they
call :meth:`Checkpointer.abort` (exception) or let :meth:`Checkpointer.step` see the request.

Which ranks call what: a preemption request is agreed on by every rank at a decision step
(:meth:`Checkpointer.step`), so every rank makes the emergency save together. An exception is
local to one rank, so the exception save is made only with a single rank (with several, the
others could not join its collectives; the newest checkpoint is then the last periodic one).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from . import notices, rng, statetree, structure
from .closing import EXIT_MARGIN_S
from .errors import CheckpointError, RemoteWaitPreemptedError, UnsupportedStateError
from .filepart import FilePart
from .optim import hookable
from .optimizer_steps import Entry, Follower
from .param_watch import Buffers, ParamWatch, changed_params, put_back
from .preemption import exiting
from .refusals import refuse_stateful
from .watcher_setup import _exit_line
from .windows import StepWatch

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("resilient_callbacks")
LATE_S = 5.0  # a preemption acted on later than this after it arrived is logged


class _Frozen:
    """A stateful object's state_dict taken at a step boundary, for save_on_exception."""

    def __init__(self, sd: Any) -> None:
        self._sd = sd

    def state_dict(self) -> Any:
        return self._sd

    def load_state_dict(self, sd: Any) -> None:  # pragma: no cover - never restored into
        raise TypeError("a frozen state cannot be loaded into")


def freeze(state: Any, tensors_by_reference: bool = False) -> Any:
    """The state as of now: modules and optimizers by reference (only an optimizer step changes
    them, which is watched), other objects' state_dicts and tensors copied (tensors kept by
    reference with ``tensors_by_reference``: their version counters are watched), containers
    rebuilt."""
    leaf = _tensor_or_frozen if tensors_by_reference else _freeze_leaf
    return statetree.rebuild(state, leaf, _frozen_whole)


def _tensor_or_frozen(obj: Any) -> Any:
    # (an inference tensor has no version counter: copied)
    return obj if isinstance(obj, torch.Tensor) and not obj.is_inference() else _freeze_leaf(obj)


def _frozen_whole(obj: Any) -> bool:
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, FilePart, torch.Tensor)) or (
        structure.is_stateful(obj)
    )


def _freeze_leaf(obj: Any) -> Any:
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, FilePart)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if structure.is_stateful(obj):
        return _Frozen(copy.deepcopy(structure.plain_module(obj).state_dict()))
    return copy.deepcopy(obj)


class Emergency:
    """The emergency saves of one Checkpointer: preemption and save_on_exception."""

    def __init__(self, ck: Checkpointer) -> None:
        self._ck = ck
        self._consistent_point: Any = None
        self._steps = Follower()  # the state's optimizers' step counts (optimizer_steps.py)
        self._watch = ParamWatch()
        self.windows = StepWatch()  # a step() inside an accumulation window (windows.py)
        self._live: Buffers = []  # the buffers' live values while _usable() set them back
        # (step, error) of a preemption's emergency save that failed, while no later one saved
        self.failed: tuple[int, str] | None = None

    def mark_consistent(self, step: int, state: Any, tensors_by_reference: bool = False) -> None:
        """Remember what step ``step``'s state is, cheaply: modules and optimizers by reference
        (an optimizer-step hook notices a step), the modules' buffers and everything else
        copied (tensors by reference with ``tensors_by_reference``, their version counters
        kept: a write since makes the point unusable)."""
        for path, obj in statetree.leaves(state):
            if structure.is_stateful(obj):  # as a save would, before its state_dict()
                refuse_stateful(obj, structure.path_str(path))
        try:
            frozen = freeze(state, tensors_by_reference)
        except UnsupportedStateError as e:
            if statetree.mid_step(state) is None:  # a state no save could take: say so now
                raise
            # Accumulation inside an accumulation window, no step due here: the point before
            # stays the last consistent one (no optimizer step since, or its hook says so),
            # and the training goes on
            log.debug("save_on_exception: step %d is not a consistent point: %s", step, e)
            return
        stepped = self._watch_optimizers(state)
        rng_state = rng.capture() if self._ck.config.capture_rng else (None, {})
        versions = self._watch.versions(state)
        buffers = self._watch.buffers(frozen)
        tensors = (
            [
                (t, t._version)
                for _, t in statetree.leaves(frozen)
                if isinstance(t, torch.Tensor) and not t.is_inference()
            ]
            if tensors_by_reference
            else []
        )
        self._consistent_point = (step, frozen, rng_state, stepped, buffers, versions, tensors)

    def mark_before_window(self, step: int, state: Any) -> None:
        """:meth:`mark_consistent` in a loop with accumulation windows, without
        save_on_exception: the point a preemption held too long in a window saves; a state no
        save could take is said by the save, not here."""
        try:
            self.mark_consistent(step, state, tensors_by_reference=True)
        except CheckpointError as e:
            self._consistent_point = None
            log.debug("step %d is not a consistent point: %s", step, e)

    def _usable(self, point: Any, what: str) -> bool:
        """Whether the state is still that of ``point``'s step (no optimizer step, no
        parameter written since; the modules' buffers are set back to it until the save's
        :meth:`_live_back`); if not, a warning says why, beginning with ``what``."""
        step, _, _, stepped, buffers, versions, tensors = point
        if any(entry.began(torch_semantics) != n for entry, torch_semantics, n in stepped):
            log.warning(
                "%s came after an optimizer step that step() never saw; the state matches no "
                "step, so nothing is saved",
                what,
            )
            return False
        changed = changed_params(versions) or next(
            ("a tensor of the state" for t, v in tensors if t._version != v), None
        )
        if changed:
            log.warning(
                "%s came after %s was written in place since step %d, not by the step() of an "
                "optimizer in the state (a two-pass optimizer's first_step(), the step of an "
                "optimizer only a wrapper in the state holds, your own write); the state "
                "matches no step, so nothing is saved. Where such a write belongs to the step "
                "(an EMA update, a weight clamp), make it before ckpt.step()",
                what,
                changed,
                step,
            )
            return False
        # a forward pass since may have changed buffers (BatchNorm's running statistics): they
        # are set back to the step's values, as consistent with the step's weights, for the save
        live = put_back(buffers)
        if live is None:
            log.warning(
                "%s came after a module's buffer was replaced since step %d; the state "
                "matches no step, so nothing is saved",
                what,
                step,
            )
            return False
        self._live = live
        return True

    def _live_back(self) -> None:
        """After a save: the buffers' live values back, for a run that goes on after it."""
        live, self._live = self._live, []
        put_back(live)

    def _watch_optimizers(self, state: Any) -> list[tuple[Entry, bool, int]]:
        """Each optimizer of the state's step count now, to tell later whether one started a
        step since (save_on_exception): ``(entry, torch_semantics, count)``
        (:meth:`.optimizer_steps.Entry.began`). A step counts before it, not after, so a step
        that raised part-way (an out-of-memory error after some parameters were updated) counts as having changed the state. A ``step(closure)`` of
        torch's own optimizers (LBFGS) starts once its closure returned
        (:func:`.optim.update_began`): an exception in the closure's forward or backward leaves
        the step's state, which is saved. Another class's ``step(closure)`` starts as it is
        called: it may write the weights before it calls the closure (a SAM-style ``step()``:
        ``first_step()``, ``closure()``, ``second_step()``), where a write through ``p.data``
        shows in no version counter (:class:`.param_watch.ParamWatch`)."""
        out = []
        for opt in statetree.optimizers(state):
            target = hookable(opt)
            entry, _ = self._steps.follow(target)
            torch_semantics = type(target).__module__.startswith("torch.optim.")
            out.append((entry, torch_semantics, entry.began(torch_semantics)))
        return out

    def release(self) -> None:
        """Remove the optimizer hooks and forget the consistent point (close)."""
        self._steps.release()
        self._watch.clear()
        self._consistent_point = None
        self.windows.release()

    def save_on_exception(self, exc: BaseException) -> None:
        """Save the last consistent step before ``exc`` propagates, if configured and safe."""
        ck = self._ck
        point = self._consistent_point
        if not ck.config.save_on_exception or point is None:
            return
        if isinstance(exc, (CheckpointError, SystemExit)):
            return  # our own failure, or a deliberate exit (preemption already saved)
        if ck.world_size > 1:
            log.warning(
                "save_on_exception: not saving after %s with several ranks (the other ranks "
                "cannot join the save); the newest checkpoint is the last periodic one",
                type(exc).__name__,
            )
            return
        step, frozen, rng_state = point[:3]
        if not self._usable(point, f"save_on_exception: {type(exc).__name__}"):
            return
        self._live = []  # (the live model stays the saved step's: docs/policy.md)
        log.warning(
            "%s during training: saving the state of step %d (unchanged since) before it "
            "propagates",
            type(exc).__name__,
            step,
        )
        try:
            ck._saver.save(
                step,
                frozen,
                None,
                "emergency",
                why=f"exception {type(exc).__name__}",
                rng_state=rng_state,
            )
        except Exception as e:
            log.error("save_on_exception: the emergency save failed: %s", e)

    def preemption(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        before_window: str | None = None,
    ) -> bool:
        """Every rank: flush background saves, save this step synchronously, then stop (exit
        with ``preemption_exit_code`` if ``exit_on_preemption``). ``before_window``: why the
        save was held in an accumulation window and is made inside it anyway: of the step
        before the window (:meth:`mark_consistent`), or, where there is none, of this step
        without the window's gradients; a warning says which."""
        ck = self._ck
        rng_state = None
        try:  # (from _usable() on, the live buffers are put back whatever raises)
            if before_window is not None:
                step, state, metrics, rng_state = self._before_window(
                    step, state, metrics, before_window
                )
            who = self._announce(step)
            ck._recorder.preemption(step, who)
            try:
                saved = ck._saver.save(
                    step,
                    state,
                    metrics,
                    "emergency",
                    why=f"preemption ({who})",
                    rng_state=rng_state,
                )
            except BaseException as e:  # raised to the loop; the next step() tries again
                self.failed = (step, f"{type(e).__name__}: {e}")
                raise
        finally:
            self._live_back()
        self.failed = None
        ck.preempted = True
        if ck.config.exit_on_preemption:
            notices.log_once(
                log,
                "checkpoint of step %d committed; exiting with code %d so the scheduler "
                "restarts the job, which resumes from it",
                step,
                ck.config.preemption_exit_code,
            )
            ck._recorder.stopping()
            self._exit(saved=True)
        return saved

    def _announce(self, step: int) -> str:
        """Every rank, before a preemption's save of ``step``: which ranks got which request
        (returned), and the warnings of a save that may not fit the grace period or comes late."""
        ck = self._ck
        watcher = ck.watcher
        req = watcher.request if watcher is not None else None
        source = req.source if req is not None else "request"  # (this rank's)
        # which ranks got which request: the ranks agreed on a flag alone (notices.py)
        who = notices.requests_of_ranks(watcher)[0] or "request"
        if watcher is not None:
            # a synchronous save: what a save blocked, plus its background write if it had one;
            # it first waits for the background saves still being written
            saver = ck._saver
            pending = saver.persister.pending if saver.persister is not None else 0
            persist = max(saver.persist_seconds, default=0.0)
            estimate = max(saver.save_seconds, default=0.0) + persist * (1 + pending)
            warning = watcher.check_grace(estimate) if estimate else None
            if warning and pending:
                warning += (
                    f" (The estimate counts the {pending} checkpoint(s) still being written in "
                    "the background, which the emergency save waits for first.)"
                )
            if warning:  # (this rank's estimate, its signal's time: said by the rank)
                log.warning(notices.on_this_rank(warning))
        late = time.monotonic() - req.monotonic if req is not None else 0.0
        if late > LATE_S:  # the grace period may be short: say why the save came this late
            log.warning(
                notices.on_this_rank(
                    "preemption (%s): acted on %.1f s after it arrived: the ranks compare "
                    "requests at decision steps, spaced by the step times measured before, and "
                    "the steps since were slower"
                ),
                source,
                late,
            )
        notices.log_once(  # (every rank saves it: said once, on rank 0)
            log, "preemption (%s): saving step %d to %s before stopping", who, step, ck.dirpath
        )
        return who

    def _before_window(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None, why: str
    ) -> tuple[int, Any, Mapping[str, Any] | None, Any]:
        """What a preemption held too long in a window saves: (step, state, metrics, rng)."""
        point = self._consistent_point
        if point is not None and self._usable(point, f"preemption inside a window ({why})"):
            log.warning(
                "%s: saving step %d, the last step before the window, rather than lose the "
                "save; the resumed run trains the window's micro-batches again",
                why,
                point[0],
            )
            return point[0], point[1], None, point[2]
        log.warning(
            "%s, and no step before the window can be saved: saving step %d as it is, WITHOUT "
            "the window's gradients so far (.grad, which no checkpoint holds); the resumed run "
            "does not train on exactly as this one would have",
            why,
            step,
        )
        return step, state, metrics, None

    @contextlib.contextmanager
    def exit_if_preempted(self) -> Iterator[None]:
        """``restore()``: a preemption request ended its wait on a stalled remote store
        (:class:`RemoteWaitPreemptedError`, on every rank alike). With ``exit_on_preemption``
        the process closes and exits with the preemption code, as a step() acting on the
        request would (nothing was saved: the next run resumes as this one would have), said in
        one line. (The error's traceback ended the script, then the close at exit said the
        signal came "after the last step()", and the exit code was 1 or 75 by the script's
        shape.) Without it, the error is raised to the caller."""
        try:
            yield
        except RemoteWaitPreemptedError as e:
            ck = self._ck
            if not ck.config.exit_on_preemption or ck.watcher is None:
                raise
            log.error(_exit_line(e, ck.config.preemption_exit_code))
            ck.preempted = True  # (stopped by the request: no "unanswered" signal at close)
            self._exit(saved=False)

    def _exit(self, saved: bool) -> NoReturn:
        """Close, within what is left of the grace period, and exit with the preemption code
        (``saved``: an emergency save committed; False: a restore's wait ended unsaved)."""
        ck, watcher = self._ck, self._ck.watcher
        code = ck.config.preemption_exit_code
        left = watcher.remaining_grace_s() if watcher is not None else None
        # uploads may use what is left of the grace period, keeping a margin to exit;
        # freeing older checkpoints' space may not (the next writer sweeps what is left)
        ck._dir.trash.abandon()
        marked = []
        if watcher is not None:
            marked = watcher.answered(saved)  # for the other Checkpointers of this process too
            watcher.exiting(code)  # a second signal keeps it
        try:
            ck.close(timeout=None if left is None else max(0.0, left - EXIT_MARGIN_S))
        except Exception:
            # no exit with the code (its error propagates): the other Checkpointers are as if
            # this one never answered (each saves at its next step, or its close acts on the
            # signal), not held to the grace period nor told it was answered
            for w in marked:
                w.answered_elsewhere = False
            raise
        exiting.exit_with(code)
