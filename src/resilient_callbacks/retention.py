"""Which checkpoints to keep, and why: a pure function, tested with hypothesis.

Pools, each kept independently: the ``keep_last`` most recently committed, the ``keep_best``
best by a monitored metric, and archive points (``step % keep_every_n_steps == 0``, under the
policy now or the one recorded in the checkpoint when it was written: archives are kept
forever, also after the options change). On top of
the pools, never deleted: the newest valid checkpoint, anything protected by the caller (being
written or uploaded), corrupt checkpoints the caller knows of (a missing or unreadable
manifest, files of the wrong size: left for inspection; ``resilient-ckpt gc --remove-corrupt``
removes them; damage only a checksum shows is not seen by a retention pass, which checks
sizes) and every checkpoint of another run (reported, never counted).

"Most recently committed" and "newest" follow the run's current lineage: checkpoints of a
branch a roll-back abandoned (resumed from an older step while newer ones existed; see
:mod:`.branches`) count as older than every checkpoint of the current lineage, so the newest
``keep_last`` of the lineage are kept (the parent of the new branch included) and the
abandoned ones are the first deleted.

Which ranks call what: only the coordinator plans and deletes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from . import branches
from .errors import ConfigError

# said of a kept checkpoint of a branch a roll-back abandoned
ABANDONED = "abandoned branch: counted as older than the current lineage"


class Mode(StrEnum):
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    keep_last: int | None = None  # None keeps every checkpoint
    keep_best: int = 0
    monitor: str | None = None
    mode: Mode = Mode.MIN
    keep_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool)
            or not isinstance(self.keep_last, int)
            or self.keep_last < 1
        ):
            raise ConfigError(
                f"keep_last={self.keep_last!r}: must be an int >= 1 (the newest checkpoint is "
                "always kept), or None to keep every checkpoint"
            )
        if (
            isinstance(self.keep_best, bool)
            or not isinstance(self.keep_best, int)
            or self.keep_best < 0
        ):
            raise ConfigError(f"keep_best={self.keep_best!r}: must be an int >= 0")
        if self.keep_best and not self.monitor:
            raise ConfigError(
                f"keep_best={self.keep_best} needs a metric to rank checkpoints by: pass "
                "monitor='val_loss' (a key of the metrics you give to step()/save()) and mode='min' or 'max'"
            )
        if self.monitor and not self.keep_best:
            raise ConfigError(
                f"monitor={self.monitor!r} has no effect without keep_best: pass keep_best=1 to "
                "keep the best checkpoint by that metric"
            )
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ConfigError(f"mode={self.mode!r}: must be 'min' or 'max'") from None
        if self.keep_every_n_steps is not None and (
            isinstance(self.keep_every_n_steps, bool)
            or not isinstance(self.keep_every_n_steps, int)
            or self.keep_every_n_steps < 1
        ):
            raise ConfigError(
                f"keep_every_n_steps={self.keep_every_n_steps!r}: must be an int >= 1 or None"
            )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = str(self.mode)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RetentionPolicy:
        return cls(
            **{
                k: d[k]
                for k in ("keep_last", "keep_best", "monitor", "mode", "keep_every_n_steps")
                if k in d
            }
        )


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int
    seq: int
    run_id: str
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    valid: bool = True
    # an archive point under the policy recorded when it was written: kept forever, whatever
    # the policy is now (a later run with other options, or one that only restores)
    archived: bool = False
    # the manifest's ``lineage`` field (branches.py); None: not recorded (commit order)
    lineage: Mapping[str, Any] | None = None


#: why gc keeps a corrupt checkpoint (one never counts towards keep_last or as the newest)
CORRUPT_KEPT = "corrupt: not counted; remove with `resilient-ckpt gc DIR --remove-corrupt`"


@dataclass
class Plan:
    keep: dict[str, list[str]]  # name -> reasons
    delete: list[str]  # names, oldest first
    abandoned: set[str] = field(default_factory=set)  # on a branch a roll-back abandoned
    # corrupt newest commits that record a roll-back whose abandoned checkpoints are kept: gc
    # --remove-corrupt keeps them too (name -> why)
    held: dict[str, str] = field(default_factory=dict)


def plan(
    candidates: Iterable[Candidate],
    policy: RetentionPolicy,
    run_id: str | None,
    protected: Iterable[str] = (),
) -> Plan:
    """Decide what to keep. ``run_id`` is the current run; checkpoints of other runs are kept.
    With ``run_id=None`` every checkpoint counts as this run's (used by ``gc``)."""
    return _plan(list(candidates), policy, run_id, set(protected))[0]


def plan_checking(
    candidates: Iterable[Candidate],
    policy: RetentionPolicy,
    run_id: str | None,
    protected: Iterable[str],
    valid: Callable[[Candidate], bool],
) -> Plan:
    """:func:`plan` of ``candidates`` whose files were not checked (``valid`` from their
    manifests alone), asking ``valid`` (the check of a candidate's files) only of those the
    decision depends on: each one it deletes (a corrupt one is kept), and those counted as
    the ``keep_last`` newest or the ``keep_best`` best (a corrupt one never counts, so an
    older one takes its place). It deletes what :func:`plan` deletes with every candidate
    checked first: one never asked is kept for another reason (an archive point, another
    run's, protected), which holds whether it is intact or not, and is older than the newest
    counted and ranked below the best, whose pools it leaves as they are either way. The
    keep reasons of one never asked assume it intact (the retention pass after each commit
    acts on ``delete`` only; ``gc`` and ``ls`` check every checkpoint and call :func:`plan`).
    A run keeping hundreds of archive points had the files of every one checked at every
    commit (docs/performance.md)."""
    cands, kept = list(candidates), set(protected)
    said: dict[str, bool] = {}
    while True:
        now = [replace(c, valid=said[c.name]) if c.name in said else c for c in cands]
        p, counted = _plan(now, policy, run_id, kept)
        decided = counted.union(p.delete)
        ask = [c for c in now if c.valid and c.name not in said and c.name in decided]
        if not ask:
            return p
        answers = [valid(c) for c in ask]
        said.update(zip((c.name for c in ask), answers, strict=True))
        if all(answers):  # (as assumed: planned again, the plan would be this one)
            return p


def _plan(
    cands: list[Candidate], policy: RetentionPolicy, run_id: str | None, protected: set[str]
) -> tuple[Plan, set[str]]:
    """:func:`plan`, and the names of the valid candidates counted as the ``keep_last``
    newest or the ``keep_best`` best (whose validity decides which others are)."""
    # what a roll-back abandoned counts as older than the run's current lineage (branches.py)
    off = branches.off_lineage((c.run_id, c.seq, c.lineage) for c in cands)
    cands.sort(key=lambda c: ((c.run_id, c.seq) not in off, c.seq, c.step, c.name))
    keep: dict[str, list[str]] = {c.name: [] for c in cands}

    def mark(c: Candidate, why: str) -> None:
        keep[c.name].append(why)

    mine = []
    for c in cands:
        if run_id is not None and c.run_id != run_id:
            mark(c, f"other run {c.run_id}")
        elif not c.valid:
            mark(c, CORRUPT_KEPT)
        else:
            mine.append(c)
        if c.name in protected:
            mark(c, "in progress")
    if mine:
        mark(mine[-1], "newest")
    last = mine if policy.keep_last is None else mine[-policy.keep_last :]
    for c in last:
        # keep_last=None (remote_keep_last="all"): every one is kept
        mark(c, "all" if policy.keep_last is None else f"last {policy.keep_last}")
    best = _best(mine, policy, off)
    for c in best:
        key = str(policy.monitor)
        mark(c, f"best {key}={c.metrics[key]:.6g}")
    for c in mine:
        if why := kept_as_archive(c.step, c.archived, policy):
            mark(c, why)
    for c in mine:
        if (c.run_id, c.seq) in off and keep[c.name]:
            mark(c, ABANDONED)
    delete = [c.name for c in cands if not keep[c.name]]
    gone = {c.name for c in cands if (c.run_id, c.seq) in off}
    held = _roll_back_heads(cands, {c.name for c in cands if c.name in gone and keep[c.name]})
    counted = {c.name for c in (*last, *best)}
    return Plan({k: v for k, v in keep.items() if v}, delete, gone, held), counted


def found_corrupt(candidates: Iterable[Candidate], corrupt: Iterable[str]) -> list[Candidate]:
    """``candidates``, those named in ``corrupt`` (found corrupt by a restore's checksums, their
    sizes right) marked not valid: never counted as one of the newest or the best, by the
    retention pass and the best decision (:mod:`.remote_best`) alike."""
    found = set(corrupt)
    return [replace(c, valid=False) if c.name in found else c for c in candidates]


def kept_as_archive(step: int, archived: bool, policy: RetentionPolicy) -> str | None:
    """Why :func:`plan` keeps a checkpoint of ``step`` forever as an archive point under
    ``policy`` (``archived``: it was one under the policy recorded when it was written), or
    None: with ``remote_every_n_saves``, one the remote retention keeps so is uploaded
    whatever the interval (:mod:`.remote_best`)."""
    n = policy.keep_every_n_steps
    if n and step % n == 0:
        return f"archive (every {n} steps)"
    if archived:
        return "archive point when it was written: kept forever"
    return None


def best_names(
    candidates: Iterable[Candidate],
    policy: RetentionPolicy,
    run_id: str | None,
    valid: Callable[[Candidate], bool] | None = None,
) -> set[str]:
    """The names :func:`plan` keeps as the ``keep_best`` best by ``monitor`` (none without
    ``keep_best``): with ``remote_every_n_saves``, what is uploaded whatever the interval
    (:mod:`.remote_best`). ``valid``: asked, best first, of each candidate marked valid until
    ``keep_best`` pass it (those ranked below are never asked: a commit checks the files of
    a few checkpoints, not of every one the directory keeps)."""
    cands = list(candidates)
    off = branches.off_lineage((c.run_id, c.seq, c.lineage) for c in cands)
    mine = [c for c in cands if (run_id is None or c.run_id == run_id) and c.valid]
    return {c.name for c in _best(mine, policy, off, valid)}


def _best(
    mine: list[Candidate],
    policy: RetentionPolicy,
    off: set[tuple[str, int]],
    valid: Callable[[Candidate], bool] | None = None,
) -> list[Candidate]:
    """Of the run's valid checkpoints ``mine``, the ``keep_best`` best by ``monitor``, best
    first; ``off``: those of a branch a roll-back abandoned; ``valid``: a further test, asked
    in rank order until ``keep_best`` pass it (the same as filtering ``mine`` by it first)."""
    if not (policy.keep_best and policy.monitor):
        return []
    key: str = policy.monitor
    scored = [c for c in mine if _finite(c.metrics.get(key))]
    sign = 1.0 if policy.mode is Mode.MIN else -1.0
    # the current lineage's best first: an abandoned branch's score, from a timeline the run
    # threw away, never takes the place of the lineage's best (it only fills a slot). A tie
    # ranks the earlier first: a later checkpoint is better only if strictly so, as the
    # Trainer's best_global_step and Lightning's save_top_k=1 count it; at every rank
    # (keep_best >= 2 too: docs/guide.md says where Lightning's save_top_k differs), as
    # lightning/evaluate.py's and the MLflow sink's "best" rank them
    scored.sort(
        key=lambda c: ((c.run_id, c.seq) in off, sign * float(c.metrics[key] or 0.0), c.seq)
    )
    if valid is None:
        return scored[: policy.keep_best]
    found: list[Candidate] = []
    for c in scored:
        if len(found) == policy.keep_best:
            break
        if valid(c):
            found.append(c)
    return found


def _roll_back_heads(cands: list[Candidate], kept_abandoned: set[str]) -> dict[str, str]:
    """The corrupt newest commits of their run that record a roll-back whose abandoned
    checkpoints are kept (``kept_abandoned``), each with why it stays: without it they would be
    the run's newest again, and a resume would silently continue the abandoned timeline."""
    heads: dict[str, Candidate] = {}
    for c in cands:
        if c.run_id not in heads or c.seq > heads[c.run_id].seq:
            heads[c.run_id] = c
    out = {}
    for run, h in heads.items():
        left = [c.name for c in cands if c.run_id == run and c.name in kept_abandoned]
        if not h.valid and left:
            out[h.name] = (
                f"kept though corrupt: the newest commit of its run, it records that a roll-back "
                f"abandoned {', '.join(left)}; without it they would be the run's newest again "
                "and a resume would take them. Delete them first (--keep-last N counts them as "
                "older than the current lineage), then remove it"
            )
    return out


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
