"""What the library says beside what it does, and on which ranks it says it.

**Said once, or by the rank it is about.** A job of 8 or 64 ranks merges every rank's stderr
into one log: a line printed on every rank is read 8-64 times. So:

- a notice about something that is the same on every rank (the replicated state, the
  checkpoint chosen, the config, a decision the ranks took together: a fallback, a preemption's
  save, a schedule) is said once, on rank 0: a warning there, and a WARNING log line where
  logging is configured. The other ranks log it at INFO (:func:`say_once`, :func:`log_once`,
  :func:`.errors.warn_and_log` with ``warn=`` rank 0), which no default setup prints, and a
  rank's own log file still holds it;
- a notice about something that differs per rank (that rank's ``PerRank`` state, its shard, its
  files, its failure, a signal it received) is said by that rank, and names it: ``rank N: ...``
  in a run of several ranks (:func:`on_this_rank`);
- with the warnings made errors (``python -W error``), a notice that stops one rank stops
  every rank: rank 0's warning raises there, and the other ranks raise the same text where
  they log it (:func:`.errors.warn_and_log`); a restore's notice about one rank's own state is
  passed on as that rank's failure before the ranks compare their outcomes
  (:func:`first_raising`), so that no rank waits for a stopped one in its next collective.

``tests/test_rank_notices.py`` and ``tests/test_rank_warnings.py`` run two ranks and count each
notice's lines across them.

Also here, what a restore says beside what it loads: folders named like checkpoints that are
not checkpoints, a ``dirpath`` with nothing to resume from where a subdirectory holds
checkpoints or where plain ``dcp.save`` wrote some, and tensors of the state left viewing the
restored files. Nothing here raises: each is a warning or a log line, and the restore goes on
(a fresh start stays a fresh start)."""

from __future__ import annotations

import gc
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from . import catalog, dist, mapped
from .commit import CKPT_RE
from .errors import AT_CALLER, caller_stacklevel, raises, warn_and_log
from .manifest import MANIFEST_NAME, Manifest
from .redact import command

log = logging.getLogger(__name__)

EARLIER_RUNS_LOOKED = 100  # run folders a fresh start in a Hydra job folder looks in at most


def say_once(
    logger: logging.Logger,
    msg: str,
    category: type[Warning] = UserWarning,
    *,
    stacklevel: int = AT_CALLER,
) -> None:
    """A notice about what is the same on every rank: a warning on rank 0 (and a WARNING log
    line there where logging is configured); an INFO log line on the other ranks, which the
    default setup does not print. ``stacklevel`` as :func:`.errors.warn_and_log`'s, counted
    from the caller of this function."""
    level = stacklevel if stacklevel == AT_CALLER else stacklevel + 1
    warn_and_log(logger, msg, category, stacklevel=level, warn=dist.rank() == 0)


def log_once(logger: logging.Logger, msg: str, *args: Any) -> None:
    """A log line about what is the same on every rank: WARNING on rank 0, INFO elsewhere."""
    logger.log(logging.WARNING if dist.rank() == 0 else logging.INFO, msg, *args)


def on_this_rank(msg: str) -> str:
    """``msg`` about this rank's own state or event, naming the rank in a run of several
    (``"rank 3: ..."``); unchanged in a single process."""
    return f"rank {dist.rank()}: {msg}" if dist.world_size() > 1 else msg


def first_raising(msgs: list[str]) -> UserWarning | None:
    """Every rank, before the collective that tells whether each one's step succeeded: the
    first of this rank's own notices ``msgs`` (said after it, as ``UserWarning``s at the
    user's call) that the warning filters make an error (``python -W error``), as the
    exception ``warnings.warn`` would raise; None where none is. A rank passes it on as its
    failure, so that every rank stops with it: raised after the collective on this rank
    alone, it left the others waiting in their next one (:func:`.errors.raises`)."""
    level = caller_stacklevel()
    return next((UserWarning(m) for m in msgs if raises(m, UserWarning, level)), None)


def requests_of_ranks(watcher: Any) -> tuple[str | None, float | None]:
    """Every rank, at a preemption the ranks agreed on (a collective: every rank calls it at
    the same step): which ranks got which request, as rank 0 says it once -- ``"SIGTERM"``
    where every rank got the same, ``"SIGUSR1 on rank 1"``, ``"SIGTERM on ranks 0, 1; SIGUSR1
    on rank 3"``; None where no rank's watcher holds one -- and the least grace period left
    among the ranks' requests (None where none says when its kill comes). The ranks agree on
    a preemption by a flag alone (:mod:`.decision`): rank 0 may not have got the signal."""
    req = watcher.request if watcher is not None else None
    grace = watcher.remaining_grace_s() if watcher is not None else None
    every = dist.all_gather_json([req.source if req is not None else None, grace])
    graces = [g for _, g in every if g is not None]
    return _who_got([s for s, _ in every]), (min(graces) if graces else None)


def _who_got(sources: list[str | None]) -> str | None:
    got = [s for s in sources if s is not None]
    if not got:
        return None
    if len(got) == len(sources) and len(set(got)) == 1:
        return got[0]
    by: dict[str, list[int]] = {}
    for r, s in enumerate(sources):
        if s is not None:
            by.setdefault(s, []).append(r)
    return "; ".join(f"{s} on {ranks_named(rs)}" for s, rs in by.items())


def ranks_named(ranks: list[int]) -> str:
    """``"rank 3"``, ``"ranks 0, 1"``, ``"ranks 0, ..., 7 and 56 more"``: for a notice said
    once that names the ranks something is true on."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"ranks {', '.join(map(str, ranks[:8]))}{more}"


def listing_notes(
    dirpath: str,
    no_manifest: list[str],
    fresh: bool,
    read_only: bool,
    given: tuple[object, str],
) -> list[str]:
    """The coordinator, having listed ``dirpath`` for ``resume="auto"``: what the restore says
    about the listing (:func:`what_is_not_a_checkpoint`, :func:`where_it_looked` where it
    starts fresh; ``given``: ``Checkpointer.dirpath_given``). The ranks get these in the
    listing's broadcast and say each once (:func:`say_once`): with ``-W error``, every rank
    raises it there. Said on rank 0 alone, it raised there while the others went on into
    restore's collectives and waited for it until the process group's timeout."""
    said = what_is_not_a_checkpoint(dirpath, no_manifest, fresh, read_only)
    looked = where_it_looked(dirpath, *given) if fresh and not read_only else None
    return said + ([looked] if looked else [])


def what_is_not_a_checkpoint(
    dirpath: str, no_manifest: list[str], fresh: bool, read_only: bool
) -> list[str]:
    """After ``resume="auto"`` chose what to load, the warnings to say (``UserWarning``s: no
    checkpoint was skipped, so not :class:`ResumeFallbackWarning`s). ``no_manifest``: the
    ``step_*`` folders of ``dirpath`` without a manifest (no save of this library leaves one:
    damage, or a copy still in progress), named. ``fresh``: nothing to resume from; then the subdirectories that hold checkpoints are named (a ``dirpath`` one level too
    high), and so are checkpoints of plain ``dcp.save`` there (a run moved to this library,
    pointed at its old directory), and a read-only restore says that it restored nothing."""
    said = []
    if no_manifest:
        n = len(no_manifest)
        shown = ", ".join(no_manifest[:5]) + (f" and {n - 5} more" if n > 5 else "")
        then = "starting without a checkpoint" if fresh else "not loaded"
        said.append(
            f"{dirpath}: {shown} {'has' if n == 1 else 'have'} no {MANIFEST_NAME}, so "
            f"{'it is' if n == 1 else 'they are'} not a checkpoint (a save of this library "
            f"never leaves one: damaged, or a copy still in progress); {then}. "
            f"{command('ls', dirpath)} lists them"
        )
    if not fresh:
        return said
    subs = catalog.holders(dirpath)
    plain = catalog.plain_dcp(dirpath)
    where = ""
    if subs:
        listed = ", ".join(f"{sub} ({k})" for sub, k in subs[:5])
        where = (
            f"; these subdirectories hold checkpoints: {listed}. Pass one of them as dirpath "
            f"to resume it (e.g. {os.path.join(dirpath, subs[0][0])})"
        )
    if plain:
        where += f"; {catalog.plain_dcp_note(dirpath, plain)}"
    if read_only:
        said.append(
            f"read_only restore: no checkpoint in {dirpath}{where}; nothing was restored "
            "(restore() returned 0 and the state is as it was)"
        )
    elif subs or plain:
        said.append(f"no checkpoint in {dirpath}{where}; starting fresh")
    return said


def where_it_looked(dirpath: str, given: object, cwd: str) -> str | None:
    """A fresh start of ``resume="auto"``: the directory it looked in, absolute (INFO); the
    warning to say where that may be the wrong one (else None). A
    ``dirpath`` given relative was resolved against ``cwd``, the working directory when the
    Checkpointer was made; where that is a job folder Hydra made and changed into, each
    run of the job looks in a folder of its own, so a restart never finds the checkpoints
    of the run before: a warning says so, naming the newest such folder that holds some."""
    relative = (
        isinstance(given, str)
        and "://" not in given
        and not os.path.isabs(os.path.expanduser(given))
    )
    if not relative:
        log.info("no checkpoint in %s; starting from step 0", dirpath)
        return None
    log.info(
        "no checkpoint in %s (dirpath=%r, relative to the working directory %s when the "
        "Checkpointer was made); starting from step 0",
        dirpath,
        given,
        cwd,
    )
    mode = _hydra_mode(cwd) if cwd else None
    if mode is None:
        return None
    if mode == "MULTIRUN":  # a sweep's jobs, each its own config: one folder each, not one
        return (  # (its sibling jobs are no earlier run: none is named)
            f"dirpath={given!r} is relative to the working directory {cwd}, a folder Hydra "
            "made for this job of a sweep (multirun): a sweep run again looks for "
            "checkpoints in new folders, and a restart never finds those of the run before. "
            "Pass an absolute dirpath that names the job, e.g. "
            f"os.path.join(hydra.utils.get_original_cwd(), {given!r}, "
            "HydraConfig.get().job.override_dirname); one folder for every job of the sweep "
            "would mix their checkpoints"
        )
    # Hydra's run folders are <outputs>/<date>/<time>: an earlier run's is a cousin of cwd
    runs = os.path.dirname(os.path.dirname(cwd))
    held, looked, bounded = _earlier_run(runs, str(given), dirpath)
    if held is not None:
        found = f"; {held} holds an earlier run's"
    elif bounded:
        found = (
            f"; none of the newest {looked} earlier run folders in {runs} holds checkpoints "
            "in it (older ones were not looked in)"
        )
    else:
        found = ""
    return (
        f"dirpath={given!r} is relative to the working directory {cwd}, a folder Hydra made "
        "for this job (it holds .hydra/): each run of the job looks for checkpoints in a new "
        f"folder, and a restart never finds those of the run before{found}. Pass an absolute "
        f"dirpath, e.g. os.path.join(hydra.utils.get_original_cwd(), {given!r}), or run with "
        "hydra.job.chdir=False"
    )


def _earlier_run(runs: str, given: str, dirpath: str) -> tuple[str | None, int, bool]:
    """The newest earlier run's ``<runs>/<date>/<time>/<given>`` that holds checkpoints (Hydra's
    date and time folders sort by name as by time), looking in at most
    :data:`EARLIER_RUNS_LOOKED` run folders: an outputs folder of thousands of runs was read
    whole at each fresh start. Returns (that folder or None, how many were looked in, whether
    the bound stopped the search)."""
    looked = 0
    for date in _names(runs)[:EARLIER_RUNS_LOOKED]:  # (each date folder is read too)
        for time in _names(os.path.join(runs, date)):
            path = os.path.join(runs, date, time, given)
            if os.path.abspath(path) == dirpath:
                continue
            if looked >= EARLIER_RUNS_LOOKED:
                return None, looked, True
            looked += 1
            if _holds(path):
                return path, looked, False
    return None, looked, False


def _names(path: str) -> list[str]:
    """The entries of the folder ``path`` newest name first, hidden ones left out ([] where it
    cannot be read: a file, gone meanwhile)."""
    try:
        return sorted((n for n in os.listdir(path) if not n.startswith(".")), reverse=True)
    except OSError:
        return []


def _hydra_mode(cwd: str) -> str | None:
    """``"RUN"`` or ``"MULTIRUN"`` where ``cwd`` is a job folder Hydra made and changed into:
    its ``.hydra/hydra.yaml`` records another working directory the job was started from
    (``hydra.runtime.cwd``); else None: a ``.hydra/`` of a job run in place
    (``hydra.run.dir=.``: the same folder each run) or one without Hydra's record."""
    try:
        with open(os.path.join(cwd, ".hydra", "hydra.yaml"), encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, ValueError):
        return None
    found = re.search(r"^ +cwd: *(.+?) *$", text, re.MULTILINE)
    if found is None:
        return None
    started = found.group(1).strip("'\"")
    if os.path.realpath(started) == os.path.realpath(cwd):
        return None
    return "MULTIRUN" if re.search(r"^  mode: *MULTIRUN *$", text, re.MULTILINE) else "RUN"


def _holds(path: str) -> bool:
    try:
        return any(CKPT_RE.match(n) for n in os.listdir(path))
    except OSError:
        return False


def mappings_made() -> int:
    """:func:`mapped.made_so_far`: taken as a restore begins, for :func:`warn_if_still_mapped`."""
    return mapped.made_so_far()


def warn_if_still_mapped(path: str, since: int = 0) -> None:
    """Say so when objects of the state keep tensors that view the restored checkpoint's files
    (a FilePart's load that keeps what its reader gave it): their disk space stays in use.
    Only the mappings made from ``since`` on (:func:`mapped.made_so_far` as the restore began)
    count: one the caller holds from before (``reader.open_checkpoint``) is not the state's."""
    left = mapped.still_mapped(path, since)
    if left:
        gc.collect()  # what only a reference cycle kept
        left = mapped.still_mapped(path, since)
    if left:
        log.warning(
            "after the restore, tensors of the state still view %s: their disk space stays in "
            "use after retention deletes the checkpoint, until those tensors are freed; a "
            "FilePart's load() should copy what it keeps (e.g. tensor.clone())",
            ", ".join(os.path.relpath(f, path) for f in left),
        )


def remote_tier_hint(manifests: Iterable[Manifest], step: int) -> str:
    """For ``resume=<step>`` that a Checkpointer without ``remote=`` (a read-only one, say) did
    not find in ``dirpath``: when the run's checkpoints record a remote tier, which keeps the
    archive and best checkpoints while the directory keeps its newest, where the step may be
    and how to get it (the URL is not recorded: it may carry credentials); else ``""``."""
    if not any(m.remote_retention for m in manifests):
        return ""
    return (
        ". The run also uploads to a remote tier (its checkpoints record one), which keeps its "
        "archive and best checkpoints while this directory keeps only its newest ones: restore "
        f"with remote=URL and resume={step} (a writer: read_only reads this directory only), or "
        f"download the step with `resilient-ckpt pull URL OTHER_DIR --step {step}` and restore "
        "from OTHER_DIR"
    )


def steps_are(first: int, last: int | None) -> str:
    """``"step 9 is"`` or ``"steps 9-12 are"``, for a message about steps ``first..last``."""
    return f"step {first} is" if first == last else f"steps {first}-{last} are"


def newer_skipped(dirpath: str, entries: list[catalog.Entry], step: int, source: str) -> str | None:
    """Rank 0, at ``continued_from(step, source)``: the warning to say where ``entries`` (the
    checkpoints of ``dirpath``) hold a valid one newer than ``step``, which the run skips
    (every rank says it, :func:`say_once`); None where none is."""
    newer = [
        e
        for e in entries
        if e.status is catalog.Status.VALID and e.step is not None and e.step > step
    ]
    if not newer:
        return None
    last = newer[-1]
    return (
        f"{source} continues this run from step {step}, but {dirpath} holds a newer "
        f"checkpoint, {last.path} (step {last.step}): the explicit choice wins and "
        f"{steps_are(step + 1, last.step)} trained again. Leave it out to resume from the "
        "newest checkpoint."
    )
