"""``gc`` and ``ls`` in one node's directory of a node-local run (docs/multinode.md).

A checkpoint there is the node's *part*: its ranks' files only. Until the remote store holds the
checkpoint committed (its global manifest written), that part may be the only copy of those
files anywhere: the run uploads it when it starts again (rank 0's node also keeps the global
manifest, which the remote commit needs), and a restore needs every node's part of one step.
Each node's retention sees only its own disk, so its "newest" may be a step another node lacks
(a save cut off mid-commit). So ``gc`` deletes a node's part by retention only once the remote
store is seen to hold that checkpoint, or a newer one of its run, committed (``--remote
URL``); without ``--remote`` it cannot tell and keeps every part, and says how to let it
delete. With ``--remote URL``, a whole checkpoint of a shared-``dirpath`` run with a remote tier
newer than every one of its run the store holds (not uploaded yet) is kept by the same rule."""

from __future__ import annotations

import os
import shlex
from typing import Any

from . import history
from .catalog import Entry
from .retention import Plan

# why a part that retention would delete is kept (ls's KEPT column, gc's keep rows)
UNKNOWN = (
    "a node's part, not known to be committed remotely: gc deletes it by retention only with "
    "--remote URL showing the checkpoint committed there"
)
NOT_COMMITTED = (
    "a node's part not committed remotely yet: may be the only copy of its ranks' files "
    "(the run uploads it when it starts again)"
)
NOT_UPLOADED_HISTORY = (
    "not uploaded as far as the directory's history shows (committed after the newest upload "
    "it records): may be the only copy; the run's next start uploads what its remote "
    "retention keeps; `gc DIR --remote URL` checks the store itself"
)
NOT_UPLOADED = (
    "not uploaded (newer than every checkpoint of its run the remote holds): the only copy; "
    "the run's next start uploads what its remote retention keeps, `resilient-ckpt push DIR "
    "URL` uploads it now"
)


def is_part(e: Entry) -> bool:
    """``e`` is one node's part of a node-local checkpoint."""
    return e.manifest is not None and bool(e.manifest.extra.get("node"))


def is_uploaded_by_run(e: Entry) -> bool:
    """``e`` is a whole checkpoint of a run with a remote tier (its manifest records the
    remote retention), which the run's uploader sends to the store."""
    return e.manifest is not None and bool(e.manifest.remote_retention) and not is_part(e)


def committed_keys(url: str, options: Any) -> set[tuple[str, int]]:
    """The (run id, commit number) of every checkpoint the remote store holds committed and
    whole by its listing (a copy with a file missing or of another size is not counted)."""
    from .cli_remote import store

    return {e.key for e in store(url, options).scan() if e.key is not None and e.problem is None}


def keep_uncommitted_parts(
    entries: list[Entry], p: Plan, committed: set[tuple[str, int]] | None
) -> None:
    """Take out of ``p.delete`` every node's part whose checkpoint is not in ``committed`` (the
    remote's committed keys; None: the remote was not listed), kept with the reason why. A
    part older than a checkpoint of its run the remote holds committed goes too (the remote
    retention deleted its own copy): no restore needs it, nor does the run upload it again.
    With ``committed`` known, a whole checkpoint of a run with a remote tier is kept by the
    same rule (:data:`NOT_UPLOADED`): ``gc DIR --remote URL`` deleted the checkpoints a killed
    run had not uploaded yet, which its restart would have uploaded (the trainer's own
    retention never deletes one waiting for its upload). Without ``--remote``, the directory's
    history tells (:func:`not_uploaded`)."""
    newest: dict[str, int] = {}
    for run, seq in committed or ():
        newest[run] = max(seq, newest.get(run, seq))
    pending = not_uploaded(entries, p) if committed is None else set()
    for e in entries:
        part = is_part(e)
        if e.name in pending:
            p.delete.remove(e.name)
            p.keep[e.name] = [NOT_UPLOADED_HISTORY]
        if e.name not in p.delete or not (
            part or (committed is not None and is_uploaded_by_run(e))
        ):
            continue
        assert e.manifest is not None
        run, seq = e.manifest.run_id, e.manifest.seq
        if committed is not None and ((run, seq) in committed or seq < newest.get(run, -1)):
            continue
        p.delete.remove(e.name)
        p.keep[e.name] = [UNKNOWN if committed is None else NOT_COMMITTED if part else NOT_UPLOADED]


def not_uploaded(entries: list[Entry], p: Plan) -> set[str]:
    """The names in ``p.delete`` of whole checkpoints of a run with a remote tier that its
    directory's history (``upload`` records, written by the uploader) does not record as
    uploaded and that were committed after the newest one it records: a run killed with its
    uploads behind, whose restart uploads them (those older, skipped by an uploader that fell
    behind, are no longer due). A run whose history records no upload at all is not judged
    (a history lost, or a directory copied without it): gc deletes by retention, as before."""
    out: set[str] = set()
    seen: dict[tuple[str, str], tuple[frozenset[str], float]] = {}  # (read once per command)
    for e in entries:
        if e.name not in p.delete or not is_uploaded_by_run(e):
            continue
        assert e.manifest is not None
        key = (os.path.dirname(e.path), e.manifest.run_id)
        if key not in seen:
            seen[key] = _uploads(*key)
        names, newest = seen[key]
        if names and e.name not in names and e.manifest.created > newest:
            out.add(e.name)
    return out


def _uploads(root: str, run_id: str) -> tuple[frozenset[str], float]:
    """The names of run ``run_id``'s checkpoints whose upload the history of ``root`` records,
    and the newest one's commit time (:attr:`.history.Upload.committed`; 0.0 where no record
    gives one: then every other checkpoint of the run is taken as not uploaded, kept)."""
    sent = history.uploads(root, run_id)
    known = [u.committed for u in sent.values() if u.committed is not None]
    return frozenset(sent), max(known, default=0.0)


def not_uploaded_note(args: Any, keep: list[dict[str, Any]]) -> str | None:
    """``gc DIR`` without ``--remote``: how to delete anyway the checkpoints it kept as not
    uploaded by the directory's history (:data:`NOT_UPLOADED_HISTORY`), for a user who knows
    the store holds them or does not need them (a history that lost its records), or None."""
    from .redact import command

    names = [k["name"] for k in keep if NOT_UPLOADED_HISTORY in k.get("kept_by", ())]
    if not names:
        return None
    last = [] if args.keep_last is None else ["--keep-last", args.keep_last]
    folder = shlex.quote(os.path.join(args.dir, names[0]))
    return (
        f"kept {', '.join(names)}: not uploaded as far as the history of {args.dir} shows. If "
        f"the store holds them (or you do not need them), "
        f"{command('gc', args.dir, '--remote', 'URL', *last, '--dry-run')} lists what gc "
        "deletes once it has checked the store (and what the remote retention deletes there); "
        "without --dry-run it deletes them. Or delete one by hand while no run writes the "
        f"directory: `rm -r {folder}`"
    )
