"""Which of its run's remote checkpoints a process's remote retention may count and delete: its
own (:class:`OwnCheckpoints`: the run's history and what it committed itself, not another live
process's writing the same run to the URL), less the remote copy of the checkpoint it restored
from, kept until its own branch is on the remote (:class:`RestoredCopy`).

Which ranks call what: every rank holds a :class:`RestoredCopy`; the one thread that runs the
remote retention (on the coordinator) uses :class:`OwnCheckpoints`. Nothing here is
collective."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manifest import Manifest
    from .remote import RemoteEntry

log = logging.getLogger("resilient_callbacks")


class RestoredCopy:
    """The remote copy of the checkpoint a process restored from, which the remote retention
    keeps until a checkpoint of the process's own branch is committed remotely: after a
    roll-back, the abandoned newer checkpoints are the newest there until then, and
    ``keep_last=1`` deleted it after the upload of one the restore queued (the local copy's
    protection ends at the first local commit, :meth:`~.directory.Directory.committed`; the
    remote copy's at the first remote one: between them, a node lost left the remote holding
    only the abandoned timeline).

    Which ranks call what: every rank holds one; the restore sets it, each commit calls
    :meth:`committed`, and on the coordinator the thread that commits remotely calls
    :meth:`uploaded` and reads :attr:`key` for its retention."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None  # (run id, commit number); None: none kept
        self._first: int | None = None  # the commit number of the process's first commit

    def restored(self, key: tuple[str, int] | None) -> None:
        """The process restored the checkpoint of ``key`` (None: one outside the directory)."""
        self.key, self._first = key, None

    def committed(self, seq: int) -> None:
        """The process committed commit number ``seq`` locally: the first of its branch (new
        commits number after every checkpoint either tier holds, the abandoned ones too)."""
        if self._first is None:
            self._first = seq

    def uploaded(self, key: tuple[str, int]) -> None:
        """``key`` is committed remotely: one of the process's own branch ends the hold."""
        if self._first is not None and key[1] >= self._first:
            self.key = None


class OwnCheckpoints:
    """Which of its run's remote checkpoints a process's remote retention counts and deletes:
    those the store held when it opened (the run's history, which a resumed run manages) and
    those it committed itself. Another live process writing the same run to the URL (a job the
    scheduler restarted while the old one still drains its uploads, two jobs given one run
    directory) commits others meanwhile: counted as this run's, the shared ``keep_last``
    deleted them (and the other deleted this one's). They are left out, and named in a warning
    once. The history is the first listing that succeeded: at open, or, when the store could
    not be listed then (an outage at the restart), the first one after (taking this process's
    first commits for the open counted the history as another process's: never deleted).
    Which ranks call what: the one thread that runs the remote retention.

    ``held``: the remote copy of the checkpoint the process restored from, which the retention
    keeps until the process's branch is on the remote (:meth:`protected`).
    """

    def __init__(self, url: str, held: RestoredCopy | None = None) -> None:
        self.url = url
        self.held = held
        self._known: set[tuple[str, tuple[str, int]]] | None = None  # (name, key): the history
        self._wrote: set[tuple[str, tuple[str, int]]] = set()  # (name, key): this process's
        # (name, key) -> the files and blobs of an upload this process began there: a failed
        # attempt may have committed (the store wrote the manifest, its answer was lost)
        self._tried: dict[tuple[str, tuple[str, int]], tuple[Any, Any]] = {}
        self._warned: set[str] = set()
        # (name, key) of this process's that its retention deleted lately: a listing taken
        # before the delete still shows them (the uploader's, read as a commit went on)
        self._deleted: collections.deque[tuple[str, tuple[str, int]]] = collections.deque(
            maxlen=256
        )

    def protected(self, entries: Sequence[RemoteEntry], protect: str) -> list[str]:
        """What the remote retention deletes of none of ``entries``: ``protect`` (the one just
        committed) and the remote copy of the checkpoint the process restored from, until a
        checkpoint of its branch is committed remotely (:class:`RestoredCopy`)."""
        key = self.held.key if self.held is not None else None
        return [protect] + [e.name for e in entries if key is not None and e.key == key]

    def opened(self, entries: Sequence[RemoteEntry]) -> None:
        """A listing of the store: the first one (at open, or the first that succeeded after)
        says the run's history, every committed checkpoint in it."""
        if self._known is None:
            self._known = {(e.name, e.key) for e in entries if e.key is not None}

    @property
    def listed(self) -> bool:
        """Whether a listing of the store has succeeded in this process."""
        return self._known is not None

    def wrote(self, name: str, key: tuple[str, int]) -> None:
        """This process committed ``key`` as ``name``."""
        if self.held is not None:
            self.held.uploaded(key)
        self._wrote.add((name, key))
        self._tried.pop((name, key), None)  # (its files and blobs: kept only while in doubt)

    def took_over(self, prev: OwnCheckpoints) -> None:
        """``prev``'s commits (this process's previous writer of the store, ended): its own."""
        self._wrote, self._tried = self._wrote | prev._wrote, {**prev._tried, **self._tried}

    def deleted(self, name: str) -> None:
        """The retention deleted ``name``: forget it (one entry per upload otherwise stayed
        for the life of the process, each holding a manifest's files and blobs)."""
        self._deleted.extend(w for w in self._wrote | set(self._tried) if w[0] == name)
        self._wrote = {w for w in self._wrote if w[0] != name}
        self._tried = {t: v for t, v in self._tried.items() if t[0] != name}

    def trying(self, name: str, m: Manifest) -> None:
        """This process begins an upload of ``m`` as ``name``: a commit of it found there
        later is this process's, also when the attempt failed (its answer was lost: it was
        taken for another live process's, never counted nor deleted)."""
        self._tried[(name, (m.run_id, m.seq))] = (m.files, m.blobs)

    def mine(self, entries: Sequence[RemoteEntry], run_id: str) -> list[RemoteEntry]:
        """``entries`` without the checkpoints of ``run_id`` that another process committed
        since this one opened (warned about once a name); all of them before a listing."""
        if self._known is None:  # (no listing yet: nothing tells another process's apart)
            return list(entries)
        known, wrote = self._known, self._wrote  # (membership only: wrote() may add meanwhile)
        deleted = set(self._deleted)
        theirs = [
            e
            for e in entries
            if e.key and e.key[0] == run_id and (e.name, e.key) not in known
            if (e.name, e.key) not in wrote and (e.name, e.key) not in deleted
            if (m := e.manifest) and self._tried.get((e.name, e.key)) != (m.files, m.blobs)
        ]
        new = [e.name for e in theirs if e.name not in self._warned]
        if new:
            self._warned.update(new)
            log.warning(
                "remote %s: %s %s of this run (%s) that another live process committed while "
                "this one writes it (a job restarted while the old one still uploads, or two "
                "jobs given the same run directory); this process's remote retention neither "
                "counts nor deletes %s, and that process's leaves this one's alone. Only one "
                "process should write a run to a URL: stop the other one",
                self.url,
                ", ".join(new),
                "is a checkpoint" if len(new) == 1 else "are checkpoints",
                run_id,
                "it" if len(new) == 1 else "them",
            )
        return [e for e in entries if e not in theirs]
