"""When to save, decided once per training step: the fixed triggers (``every_n_steps``,
archive steps, ``every_seconds``), a loss jump (:class:`LossJumpTrigger`), the adaptive
schedule, the last step of a run, and a preemption request.

Which ranks call what: every rank calls :meth:`Trigger.decide` at every step with the same step
numbers. Conditions that differ between ranks (a signal, wall time, a loss jump, the adaptive
proposal) are agreed on at decision steps (one small all-reduce, see :mod:`.decision`); between
them nothing is exchanged and those conditions wait. Every rank gets the same answer.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import dist, notices, statetree
from .adaptive import AdaptiveSchedule
from .config import CheckpointerConfig
from .decision import Decider, spacing_step_time
from .errors import AT_CALLER, ConfigError, warn_and_log
from .numbers_check import opt_int
from .policy import Clock

if TYPE_CHECKING:
    from .preemption import PreemptionWatcher
    from .windows import StepWatch

log = logging.getLogger("resilient_callbacks")
_RANK = {"periodic": 0, "required": 1, "final": 2, "preemption": 3}  # which of two saves wins
#: a preemption held in a plain loop's window is saved anyway (the step before the window) once
#: this fraction of the grace period left when it was held has passed
HOLD_GRACE_FRACTION = 0.5


@dataclass(kw_only=True)
class LossJumpTrigger:
    """Optional extra trigger: says when to save because the loss jumped or became non-finite.

    :meth:`observe` returns True when a finite loss exceeds the running median of the last
    ``window`` finite losses by more than ``threshold`` times that median's magnitude
    (``loss - med > threshold * |med|``), or when the loss is non-finite after finite ones. Nothing
    triggers before ``min_history`` finite losses have been seen. It triggers once per excursion:
    it re-arms when a loss within the threshold (for non-finite: any finite loss) comes again. Jumped
    losses still enter the window, so a lasting new level becomes the new normal.
    """

    threshold: float
    window: int = 20
    min_history: int = 5

    _history: deque[float] = field(init=False, repr=False, compare=False)
    _armed: bool = field(init=False, repr=False, compare=False, default=True)
    _nonfinite_armed: bool = field(init=False, repr=False, compare=False, default=True)
    last_reason: str | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, (int, float))
            or not math.isfinite(self.threshold)
            or self.threshold <= 0
        ):
            raise ConfigError(
                f"threshold={self.threshold!r}: must be a finite number > 0, the relative jump "
                "over the running median that triggers a save (e.g. 0.5 for +50%)"
            )
        opt_int("window", self.window, 1)
        opt_int("min_history", self.min_history, 1)
        if self.min_history > self.window:
            raise ConfigError(
                f"min_history={self.min_history} > window={self.window}: the window could never "
                "hold enough losses; lower min_history or raise window"
            )
        self._history = deque(maxlen=self.window)

    def observe(self, loss: float) -> bool:
        """Record one loss (a float, or anything ``float()`` accepts); True means save now, and
        :attr:`last_reason` says why."""
        x = float(loss)
        if not math.isfinite(x):
            fire = bool(self._history) and self._nonfinite_armed
            self._nonfinite_armed = False
            if fire:
                self.last_reason = f"loss became non-finite ({x}) after finite values"
            return fire
        self._nonfinite_armed = True
        fire = False
        if len(self._history) >= self.min_history:
            med = statistics.median(self._history)
            jumped = x - med > self.threshold * max(abs(med), 1e-12)
            if jumped and self._armed:
                fire = True
                self.last_reason = (
                    f"loss {x:.6g} jumped above the median {med:.6g} of the last "
                    f"{len(self._history)} by more than {self.threshold:g}x"
                )
            self._armed = not jumped
        self._history.append(x)
        return fire


class Trigger:
    """The save decision of one Checkpointer, and what it measures to make it."""

    def __init__(self, config: CheckpointerConfig, schedule: AdaptiveSchedule | None) -> None:
        self.config = config
        self.policy = config.save_policy()
        self.schedule = schedule
        self.world_size = dist.world_size()
        self.clock = Clock()  # time since the last save or restore, for every_seconds
        self.steps_origin = 0  # step of the last save or restore: adaptive counts from there
        self._previous: int | None = None  # the step of the last decide() or mark()
        self._decider = Decider()
        self._loss_trigger = (
            LossJumpTrigger(threshold=config.loss_jump) if config.loss_jump else None
        )
        self._pending_jump = False
        self._held: tuple[str, str] | None = None  # a save due inside a step (mid_step)
        # a preemption held in a plain loop's window: the window's step() count and the
        # monotonic time at which it is saved anyway (windows.StepWatch.hold_limit)
        self._hold_bound: tuple[int, float] | None = None
        self._warned_no_trigger = False
        self._warned_back = False
        self.caller_schedule: str | None = None  # the caller saves on its own schedule
        self._last_step_end: float | None = None
        self._last_step: int | None = None  # the step number of the last step() call
        self._step_seconds: deque[float] = deque(maxlen=50)
        self.now = time.perf_counter  # the clock of the step times (a test's fake one)
        self.compute_s = 0.0  # training compute seen by this process (between step() calls)

    @property
    def has_schedule(self) -> bool:
        """Whether :meth:`decide` saves on a schedule (every_n_steps, every_seconds,
        adaptive, loss_jump), not only at final steps."""
        return (
            self.policy.has_trigger or self.schedule is not None or self._loss_trigger is not None
        )

    def step_started(self, step: int) -> None:
        """At the start of step(``step``): the time since the last step() is the training's
        between the two step numbers. Step times are per step *number*: a caller whose count
        advances by 2 per call (Lightning's ``global_step`` with two manual optimizers) or by
        the batch size trains half (1/batch) as long per number, and the adaptive interval,
        counted in step numbers, must be converted with that time, not the call's."""
        if self._last_step_end is not None:
            compute = self.now() - self._last_step_end
            span = 1
            last = self._last_step
            if type(step) is int and type(last) is int and step > last:  # (a bad step: save)
                span = step - last
            self._step_seconds.append(compute / span)
            self.compute_s += compute
            if self.schedule is not None:
                self.schedule.observe_step(compute / span, span)
        self._last_step = step

    def exclude(self, seconds: float) -> None:
        """Time spent in a save outside step() (``save()``, ``emergency_save()``): not
        training compute, so the next step's measured compute leaves it out."""
        if self._last_step_end is not None:
            self._last_step_end = min(self.now(), self._last_step_end + seconds)

    @property
    def step_seconds(self) -> deque[float]:
        """Compute time of the recent training steps (seconds)."""
        return self._step_seconds

    def step_ended(self) -> None:
        self._last_step_end = self.now()

    def restored(self) -> None:
        """A restore() in a running process (a roll-back): what ran since the last step() was
        discarded with the state, and the restore is no training: the next step counts from
        here (the first step() of a process still has nothing before it to time)."""
        if self._last_step_end is not None:
            self._last_step_end = self.now()

    def mark(self, step: int) -> None:
        """A save or restore of ``step``: the schedules count from here."""
        self.steps_origin = self._previous = self._last_step = step
        self.clock.reset()

    def _went_back(self, previous: int, step: int) -> None:
        """The caller's step went back: its state was replaced by an older one after the
        restore or the last save (a load of its own), or its steps are not a running count.
        Say so (once); the schedules count from here."""
        self.steps_origin = step
        if self._warned_back:
            return
        self._warned_back = True
        msg = (
            f"step() went back from step {previous} to {step}: the training state was replaced "
            "by an older one (a checkpoint load of your own after restore(), such as DeepSpeed's "
            "engine.load_checkpoint?), or the steps passed are not a running count of optimizer "
            f"steps. Saves go on from step {step} as newer commits; the checkpoints of the later "
            "steps stay until retention (by commit order) removes them, and resume=<step> "
            "restores one of them."
        )
        warn_and_log(log, msg, UserWarning, stacklevel=5, warn=dist.rank() == 0)

    def decide(
        self,
        step: int,
        metrics: Mapping[str, Any] | None,
        final: bool,
        preempt: bool,
        state: Any = None,
        watcher: PreemptionWatcher | None = None,
        window: str | None = None,
        watch: StepWatch | None = None,
    ) -> tuple[str, str] | None:
        """Every rank: ``(kind, why)`` if this step is saved, else None. ``kind`` is
        ``"preemption"``, ``"final"``, ``"required"`` (an archive step or a loss jump: a
        periodic save that ``if_busy='skip'`` never skips) or ``"periodic"``; ``preempt``: this
        rank saw a request. A save due while ``state`` is in the middle of a step
        (:func:`.statetree.mid_step`: a gradient accumulation window, the same on every rank),
        a preemption's included, is held -- the ranks agreed on it already -- and made at the
        first step outside it (a ``final`` one is not: the save refuses it). ``watcher``: the
        preemption's, whose grace period a held preemption is compared with. ``window``: a plain
        loop's ``step()`` inside an accumulation window (:mod:`.windows`), held alike, but a
        ``final`` save there is made as it is, with a warning (the window's gradients, never
        applied, are not in it), and a preemption's is held within bounds (``watch``'s
        :meth:`~.windows.StepWatch.hold_limit` calls, :data:`HOLD_GRACE_FRACTION` of the grace
        period): past them the kind returned is ``"preemption_before_window"`` (save the
        step before the window)."""
        decision = self._decide(step, metrics, final, preempt)
        held = self._held
        if decision is not None and decision[0] == "final" and window is not None:
            # (the loop ends here: the window's gradients are never applied, by this run or
            # by one resumed from the save; refusing lost the run's last save at its very end)
            warn_and_log(
                log,
                f"final save of step {step} inside a gradient accumulation window: {window}. "
                "It is saved as it is: the window's gradients so far (.grad, never applied by "
                "an optimizer step) are not in it, as they are not in the trained weights. To "
                "train on them, step the optimizer on the last partial window before the final "
                "step().",
                stacklevel=AT_CALLER,
            )
        bound = self._hold_bound
        if held is not None and bound is not None and window is not None and watch is not None:
            calls, deadline = bound
            if watch.run >= calls or time.monotonic() >= deadline:
                self._held = self._hold_bound = None
                why = (
                    f"{watch.run} step() calls"
                    if watch.run >= calls
                    else f"{HOLD_GRACE_FRACTION:.0%} of its grace period"
                )
                before = (
                    f"the longest before it took {watch.longest} step() calls"
                    if watch.longest
                    else "no window ended before it"
                )
                return "preemption_before_window", (
                    f"the preemption was held for {why} in a gradient accumulation window that "
                    f"did not end ({before})"
                )
        if decision is not None and decision[0] != "final":
            inside = statetree.mid_step(state) or window
            if inside is not None:
                if held is None or _RANK[decision[0]] > _RANK[held[0]]:
                    self._held = decision
                    if decision[0] == "preemption":
                        self._say_held(step, inside, state, watcher)
                        self._hold_bound = None
                        if window is not None and watch is not None:
                            self._bound_hold(watch, watcher)
                return None
        if held is not None and (statetree.mid_step(state) or window) is None:
            self._held = self._hold_bound = None
            if decision is None or _RANK[held[0]] > _RANK[decision[0]]:
                return held
        return decision

    def _bound_hold(self, watch: StepWatch, watcher: PreemptionWatcher | None) -> None:
        """A preemption is first held in a plain loop's window: how long it may be."""
        grace = watcher.remaining_grace_s() if watcher is not None else None
        deadline = math.inf if grace is None else time.monotonic() + HOLD_GRACE_FRACTION * grace
        self._hold_bound = (watch.hold_limit(), deadline)

    def _say_held(
        self, step: int, inside: str, state: Any, watcher: PreemptionWatcher | None
    ) -> None:
        """A preemption at ``step`` is held until the end of the accumulation window
        ``inside``: say so; where the window's remaining micro-steps, at the step time
        measured recently, would outlast the grace period left, say it loudly with the
        figures and what to do (the save is still made at the window's end, never inside it:
        the window's gradients so far are in ``.grad``, which no checkpoint holds)."""
        # the ranks held it together: said once, on rank 0, naming the ranks that got the
        # request and with the least grace period left among them (notices.py)
        who, grace = notices.requests_of_ranks(watcher)
        held = (
            f"preemption{f' ({who})' if who else ''} at step {step}: {inside} is inside "
            "a gradient accumulation window; the emergency save is made at the window's end "
            "(the first step() outside it; in a plain loop's window that does not end, the step "
            "before it, at twice the longest window seen or half the grace period)"
        )
        left = statetree.mid_step_left(state)
        if left is None or grace is None or not self._step_seconds:
            notices.log_once(log, "%s", held)
            return
        per = spacing_step_time(self._step_seconds)
        need = left * per
        figures = (
            f"{left} more micro-step(s) at the {per:.2f} s a step took recently: about "
            f"{need:.1f} s, with {grace:.1f} s of the grace period left"
        )
        if need <= grace:
            notices.log_once(log, "%s, in %s", held, figures)
            return
        notices.say_once(
            log,
            f"{held}, in {figures}: the process will probably be killed before that save, and "
            "the run resume from the last checkpoint committed. No save is made inside the "
            "window (its gradients so far are in .grad, which no checkpoint holds). Lower "
            "gradient_accumulation_steps (shorter windows), or give the job a longer grace "
            "period (Kubernetes terminationGracePeriodSeconds, Slurm --signal=USR1@<seconds>, "
            "and grace_period= or RESILIENT_GRACE_PERIOD_S to match).",
            RuntimeWarning,
            stacklevel=AT_CALLER,
        )

    def _decide(
        self, step: int, metrics: Mapping[str, Any] | None, final: bool, preempt: bool
    ) -> tuple[str, str] | None:
        if self._previous is not None and step < self._previous:
            self._went_back(self._previous, step)
        reason = self.policy.due_by_step(step, self._previous)
        self._previous = step
        time_due = bool(
            self.policy.every_seconds and self.clock.elapsed() >= self.policy.every_seconds
        )
        loss = metrics.get(self.config.loss_key) if metrics else None
        if (
            self._loss_trigger is not None
            and loss is not None
            and self._loss_trigger.observe(float(loss))
        ):
            self._pending_jump = True
        proposal = self.schedule.interval_steps() if self.schedule is not None else 0
        step_time = None
        if self.world_size > 1 and self._step_seconds and self._decider.is_decision_step(step):
            step_time = spacing_step_time(self._step_seconds)
        decided = self._decider.decide(
            step, [int(preempt), int(time_due), int(self._pending_jump), proposal], step_time
        )
        if decided is None:
            preempt = time_due = jump = False
        else:
            preempt, time_due, jump = bool(decided[0]), bool(decided[1]), bool(decided[2])
            self._pending_jump = False
            if self.schedule is not None and self.world_size > 1:
                self.schedule.adopt(decided[3])
        if preempt:
            return "preemption", "preemption"
        if reason is None and time_due:
            reason = f"every_seconds={self.policy.every_seconds:g}"
        if reason is None and jump:
            reason = f"loss jump ({self._loss_trigger.last_reason if self._loss_trigger else ''})"
        if (
            reason is None
            and self.schedule is not None
            and (decided is not None or self.world_size == 1)
            and self.schedule.should_save(step - self.steps_origin)
        ):
            reason = self.schedule.describe()  # "adaptive checkpointing: every N steps ..."
        if final:
            # never skipped for a busy disk (if_busy applies to periodic saves only)
            return "final", reason or "final step"
        if reason is None:
            if (
                not self.has_schedule
                and self.caller_schedule is None
                and not self._warned_no_trigger
            ):
                self._warned_no_trigger = True
                notices.log_once(  # (the same on every rank: said once, on rank 0)
                    log,
                    "no save schedule is configured (every_n_steps / every_seconds / "
                    "keep_every_n_steps / adaptive / loss_jump): checkpoints are written only "
                    "for a step marked final, an explicit save() and a preemption",
                )
            return None
        archive = self.policy.archive_every_n_steps
        if jump or (archive and step % archive == 0):
            return "required", reason
        return "periodic", reason
