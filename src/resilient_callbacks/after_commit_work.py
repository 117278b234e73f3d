"""One behaviour when the work after a commit fails, in every mode.

Once a checkpoint is committed (its manifest written, renamed into place, ``latest`` pointed at
it), its writer does the work after the commit: the retention pass (old checkpoints and blobs
no checkpoint uses deleted) and queueing the upload to the remote tier. When that work fails,
the checkpoint is committed and valid all the same: a run training for weeks must not stop over
an old checkpoint it could not delete. In every mode (a synchronous or a background save of one
rank or several, node-local mode, a :class:`~.session.CommitSession` used without a
Checkpointer: the DCP storage writer) the failure

- is not raised: the save returns as committed (it raised on every rank of a synchronous
  save, and at the next save or ``flush()`` after a background one, and stopped the run);
- is said as one ERROR by the process that did the work (rank 0; in node-local mode the node's
  leader, which runs the retention pass even when queueing the upload failed: both failures
  are named then, in the message kept and counted once): the checkpoint is committed and
  valid, what failed, what is kept or not done (the
  old checkpoints stay until the next retention pass; an upload whose queueing failed
  (:class:`UploadNotQueued`), with the ``resilient-ckpt push`` that uploads it, or in
  node-local mode what uploads that node's part; an upload queued, or held on purpose by
  ``remote_every_n_saves``, is not named: nothing is wrong with it). A failure that persists (the same reason at each
  save) is said once, again when its reason changes, and every
  :data:`~.repeats.REMIND_EVERY`-th time in a row (:mod:`.repeats`);
- is counted (the metric ``after_commit_failures_total``, every rank that learns of it) and
  kept as ``Checkpointer.after_commit_error`` until a later commit's work succeeds; ``close()``
  says it again as an ERROR when it is the run's last checkpoint's (the upload of the last
  checkpoint not queued is a loss of durability a job's log must show at its end).

The upload of the run's last checkpoint held by ``remote_every_n_saves`` and queued by the
final save (:func:`held_not_queued`) fails the same way: not raised, said, kept, counted and
said again at close.

Which ranks call what: only the process that did the work calls :func:`failed` or
:func:`succeeded` (no collective). The other ranks of a CommitSession learn rank 0's failure
from the commit's outcome broadcast, which every rank waits in anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from .redact import push_command, url_text
from .repeats import Repeats, again, reason

log = logging.getLogger("resilient_callbacks")

#: the failures said so far, by directory, of the CommitSessions used without a Checkpointer
#: (one made for each save, so its own would forget), and the default work's failures to delete
#: a folder. A Checkpointer's (and the DCP writer's) sessions use their directory's own
#: (``Directory.said``): one that opens a directory after another closed it says its own first
#: failure, which the other had said.
SAID = Repeats()


class UploadNotQueued(Exception):
    """Queueing the upload of a committed checkpoint failed (``__cause__``: how). Raised from
    that failure by the work after the commit, so that :func:`failed` says the upload is not
    queued where, and only where, that is so: the process that ran the queueing knows it (an
    upload held by ``remote_every_n_saves``, or queued and maybe uploaded already, is fine)."""


def failed(
    key: str,
    e: BaseException,
    step: int,
    path: str,
    who: str,
    sync: Any = None,
    dirpath: str = "",
    said: Repeats | None = None,
    retained: bool = False,
    also: BaseException | None = None,
) -> str:
    """The work after the commit of ``step`` (at ``path``) by ``who`` ("rank 0", "node 1")
    raised ``e``: say it (an ERROR, once while it persists for the same reason: ``key``, the
    directory, in ``said``, else :data:`SAID`) and return its message. ``e`` an
    :class:`UploadNotQueued`: the upload is named, with what uploads it: ``sync``, the uploader
    (``store.url``, ``store.options``) of ``dirpath``; in node-local mode (``who`` a node) its
    part's uploader, whose directory ``resilient-ckpt push`` refuses. ``retained``: the
    retention pass ran all the same (node-local mode), so nothing is kept for it. ``also``:
    that retention pass failed too, after ``e`` (node-local mode: both are named)."""
    cause = e.__cause__ if isinstance(e, UploadNotQueued) and e.__cause__ is not None else e
    failures = f"{type(cause).__name__}: {cause}"
    why = reason(cause)
    if also is not None:
        failures += f"; its retention pass failed too: {type(also).__name__}: {also}"
        why += f" + {reason(also)}"
    said_next = (
        []
        if retained
        else [
            "Older checkpoints that retention would delete are kept until the next retention pass."
        ]
    )
    if isinstance(e, UploadNotQueued):
        url = url_text(sync.store.url) if sync is not None else "the remote tier"
        if who.startswith("node"):
            said_next.append(
                f"{who[0].upper()}{who[1:]}'s part of it is not queued for upload to {url}, so "
                f"this checkpoint is not committed remotely (`resilient-ckpt push` refuses a "
                f"node's directory: the run commits its checkpoints remotely itself); the next "
                f"saves are uploaded and committed remotely as usual."
            )
        elif sync is not None:
            command = push_command(dirpath, sync.store.url, sync.store.options)
            said_next.append(f"Its upload to {url} is not queued: {command} uploads it.")
    message = (
        f"checkpoint for step {step} was committed ({path}): it is valid and a restore takes "
        f"it; then {who}'s work after the commit failed: {failures}. "
        + " ".join([*said_next, "Training goes on."])
    )
    n = (SAID if said is None else said).due(key, why)
    if n is None:  # said before, for this reason: each save tries again, quietly
        log.debug("%s (again)", message)
    else:
        log.error("%s%s", message, again(n))
    return message


def held_not_queued(
    step: int, path: str, errors: list[Exception], who: str, sync: Any, dirpath: str
) -> str:
    """The run's final save found ``step`` saved, its upload held by ``remote_every_n_saves``
    (:meth:`~.directory.Directory.upload_held`), and queueing it raised ``errors`` (on ``who``,
    whose uploader is ``sync``): a loss of durability, said as an ERROR naming the checkpoint
    and what uploads it; returns the message (kept, counted and said again at close)."""
    url = url_text(sync.store.url) if sync is not None else "the remote tier"
    failures = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
    if who.startswith("node"):
        what = (
            f"{who[0].upper()}{who[1:]}'s part of it is not queued for upload to {url}, so the "
            "run's last checkpoint is not committed remotely: its last state is on the nodes' "
            "disks only (`resilient-ckpt push` refuses a node's directory; a run resumed from "
            "it with the same directories and without remote_every_n_saves uploads and commits "
            "it at its restore)."
        )
    else:
        command = push_command(dirpath, sync.store.url, sync.store.options) if sync else ""
        what = (
            f"Its upload to {url} is not queued, so the run's last state is on this disk only: "
            f"{command} uploads it."
        )
    message = (
        f"the run's last checkpoint, of step {step} ({path}), is committed and valid, but "
        f"queueing its upload (held by remote_every_n_saves until the final save) failed on "
        f"{who}: {failures}. {what}"
    )
    log.error("%s", message)
    return message


def succeeded(key: str, said: Repeats | None = None) -> None:
    """The work after a commit in ``key`` (the directory) succeeded: a later failure is new
    (``said``: as :func:`failed`'s)."""
    (SAID if said is None else said).cleared(key)
