"""Failures that some ranks hold when a background save begins: raised on every rank at once.

A background save's failure is stored and raised by the next save; a rank whose state cannot
be encoded fails before anything is written. Either may be known on some ranks only: the
encoding failure on the rank it happened on; a failure after a commit's outcome (a rank's own
account of the committed save) on that rank alone. Raised where each
rank found it, a rank raised at the start of a save, before its collectives, while its peers
went on into them and waited there until the process group's timeout, or paired them with
another save's.

Which ranks call what: every rank calls :func:`agree` at each background save of a run of
several ranks, in the training thread, once none of its own saves is in flight (one is at
most: ``max_in_flight=1``), after preparing the save: one exchange on the saves' gloo group
(``group``, idle then: the save before it ended), so that under NCCL it moves no GPU tensor
and waits for no GPU work (the default group's exchange read its result back with a device
sync, behind the snapshot's copies the training stream waits for). If
any rank holds a failure or failed to prepare, every rank raises: a rank its own error, the
others a :class:`~.errors.CheckpointWriteError` naming the rank(s) that failed and why.
Every rank calls :func:`agree_before` at the start of ``restore()`` (with background saves, in
a run of several ranks): a failure some ranks hold is raised on every rank before restore's
collectives.
"""

from __future__ import annotations

from typing import Any

from . import dist
from .errors import CheckpointWriteError, UnsupportedStateError, sentence


def _not_committed(step: int, ranks: str, detail: str, dirpath: str) -> str:
    return (
        sentence(
            f"checkpoint for step {step} was not committed; failed on rank(s) {ranks}: {detail}"
        )
        + f" Nothing was committed and older checkpoints in {dirpath} are intact."
    )


def own_prepare_error(exc: BaseException, step: int, rank: int, dirpath: str) -> BaseException:
    """This rank's failure to prepare ``step`` (an UnsupportedStateError as it is)."""
    if isinstance(exc, UnsupportedStateError):
        return exc
    detail = f"rank {rank}: {type(exc).__name__}: {exc}"
    err = CheckpointWriteError(_not_committed(step, str(rank), detail, dirpath), (rank,))
    err.__cause__ = exc
    return err


def _text(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _exchange(report: Any, held: BaseException | None, group: Any = None) -> list[Any]:
    """Every rank's ``report`` (one all-gather on ``group``); raises ``held``, this rank's
    own stored failure, once it is exchanged."""
    try:
        reports = dist.all_gather_json(report, group)
    except Exception:
        if held is None:
            raise
        reports = []  # (a peer gone: what this rank held is the news, raised below, not lost)
    if held is not None:
        raise held
    return reports


def agree(
    step: int,
    rank: int,
    held: BaseException | None,
    failed: BaseException | None,
    dirpath: str,
    group: Any = None,
) -> None:
    """Every rank (see the module docstring): ``held``, this rank's stored failure of an
    earlier background save; ``failed``, its failure to prepare this one; ``group``, the
    saves' gloo group. Returns on every rank if no rank has either; raises on every rank
    otherwise (an earlier failure first)."""
    reports = _exchange({"held": _text(held), "failed": _text(failed)}, held, group)
    held_by = [(r, x["held"]) for r, x in enumerate(reports) if x["held"]]
    failed_on = [(r, x["failed"]) for r, x in enumerate(reports) if x["failed"]]
    if held_by:
        raise _held_elsewhere(
            f"the save of step {step} was not made", held_by, dirpath, "the next save is made"
        )
    if not failed_on:
        return
    if isinstance(failed, UnsupportedStateError):
        raise failed
    ranks = ", ".join(str(r) for r, _ in failed_on)
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed_on)
    err = CheckpointWriteError(
        _not_committed(step, ranks, detail, dirpath), tuple(r for r, _ in failed_on)
    )
    if failed is not None:
        raise err from failed
    raise err


def _held_elsewhere(
    not_done: str, held_by: list[tuple[int, str]], dirpath: str, then: str
) -> CheckpointWriteError:
    ranks = ", ".join(str(r) for r, _ in held_by)
    return CheckpointWriteError(
        sentence(
            f"{not_done} on any rank: an earlier background save failed on rank(s) {ranks}, "
            "which raise it now: " + "; ".join(f"rank {r}: {e}" for r, e in held_by)
        )
        + f" The checkpoints committed in {dirpath} are intact; {then} as usual.",
        tuple(r for r, _ in held_by),
    )


def agree_before(what: str, held: BaseException | None, dirpath: str) -> None:
    """Every rank, at the start of a call every rank makes (``restore()``), its background
    saves ended: ``held``, this rank's stored failure of one of them. One exchange on the
    default group (the call's own collectives follow on it). Returns on every rank if no rank
    holds one; raises on every rank otherwise: a rank its own error, the others a
    :class:`~.errors.CheckpointWriteError` naming the rank(s) and what they hold. Raised
    where it was held alone, that rank stopped before the call's collectives, while its peers
    went on into them and waited there until the process group's timeout."""
    reports = _exchange(_text(held), held)
    held_by = [(r, e) for r, e in enumerate(reports) if e]
    if held_by:
        raise _held_elsewhere(f"{what} was not attempted", held_by, dirpath, f"call {what} again")
