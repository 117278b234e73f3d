"""The committed checkpoints of a directory as its writer read them at its commits before, so
that what runs at every commit (the retention pass, :func:`~.remote_best.is_best`) lists the
directory once and reads the manifest of a folder it has not seen (the checkpoint just
committed), not of every checkpoint kept; and checks the files' sizes of those a decision
depends on only (:meth:`KnownCheckpoints.valid`), never of every one. A run keeping hundreds
of checkpoints (archive points over a long run) had every manifest looked at and every file
of each checked at every commit (docs/performance.md).

Which ranks call what: the directory's writer (the coordinator; node-local, each node's
leader for its own directory), under its retention lock; a CommitSession's rank 0 under
the lock of :func:`shared`.
"""

from __future__ import annotations

import os
import threading

from . import catalog
from .catalog import Depth, Entry
from .commit import CKPT_RE
from .manifest import MANIFEST_NAME
from .retention import Candidate

_Key = tuple[int, int, int, int, int]  # a manifest file's device, inode, size, mtime, ctime


class KnownCheckpoints:
    """The checkpoints of one directory its writer read before, by folder. A folder is known
    by its name, its inode and its manifest file's identity (:func:`_key`: one ``stat`` a
    folder a listing, no read): one deleted since (retention,
    ``gc``, a hand) is forgotten, one made again under its name is read again (one the writer
    just committed, whose inode may be the deleted one's, too: :meth:`forget`); a committed
    manifest is never rewritten in place (a save writes it in its staging folder, renamed
    whole). Whether a checkpoint's files are intact is never kept: :meth:`valid` checks them
    each time it is asked (a file damaged between two commits is seen at the next), and
    first that its manifest is the file read (a folder made again under its name with the
    inode of the one deleted, a manifest rewritten by hand): one that is not counts as not
    valid (kept, never counted) and is read again at the next :meth:`entries`. So no
    decision to delete, or to count a checkpoint as one of the newest or the best, rests on a
    manifest read at an earlier commit unless its file is still the one read."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, _Key, Entry, Candidate]] = {}
        self.looked = 0  # folders whose manifest was looked at (tests count them)
        self.checked = 0  # checkpoints whose files' sizes were checked (tests count them)

    def entries(self, root: str) -> list[tuple[Entry, Candidate]]:
        """The checkpoints of ``root`` with a readable manifest, each with its retention
        candidate (not checked: valid), in commit order as :func:`~.catalog.scan` orders them.
        Raises what listing ``root`` raises."""
        known: dict[str, tuple[int, _Key, Entry, Candidate]] = {}
        with os.scandir(root) as listing:
            for d in listing:
                if not CKPT_RE.match(d.name) or d.is_symlink() or not d.is_dir():
                    continue
                hit = self._known.get(d.name)
                # (its manifest's stat too, not the folder's inode alone: a folder made again
                # under a deleted one's name may get its inode back, ext4 giving a freed one to
                # the next folder made; a save renamed in by another thread of the writer, the
                # uploads', between a listing and :meth:`forget`, included)
                if hit is not None and hit[0] == d.inode() and _key(d.path) == hit[1]:
                    known[d.name] = hit
                    continue
                self.looked += 1
                got = _entry(d.name, d.path)
                if got is not None:  # (one without a manifest, or unreadable: looked at again)
                    key, e = got
                    known[d.name] = (d.inode(), key, e, catalog.retention_candidates([e])[0])
        self._known = known
        rows = [(e, c) for _, _, e, c in known.values()]
        rows.sort(key=lambda r: (r[1].seq, r[1].step, r[1].name))
        return rows

    def forget(self, name: str) -> None:
        """Read checkpoint folder ``name`` again at the next :meth:`entries`: the writer just
        committed it (or restored from it), maybe under the name of one deleted since the last
        listing and in a folder with that one's inode (ext4 gives a freed inode to the next
        folder made: after a roll-back, the branch's saves take the names of the abandoned
        checkpoints the passes before deleted), so neither its name nor its inode tells."""
        self._known.pop(name, None)

    def valid(self, c: Candidate) -> bool:
        """Whether candidate ``c`` of the last :meth:`entries` is valid once its files' sizes
        are checked, as :func:`~.catalog.scan` at :attr:`~.catalog.Depth.SIZE` judges it (every
        listed file present with its size, the shared structure file readable); one that went
        away meanwhile is not, nor one whose manifest is no longer the file read (forgotten:
        read again at the next :meth:`entries`)."""
        self.checked += 1
        hit = self._known.get(c.name)
        if hit is None:  # (forgotten since it was listed: not the file read)
            return False
        _, key, e, _ = hit
        if _key(e.path) != key:
            del self._known[c.name]
            return False
        m = e.manifest
        checked = catalog.check(e.name, e.path, Depth.SIZE, lambda _path: m) if m else None
        return checked is not None and checked.status is catalog.Status.VALID


_SHARED: dict[str, tuple[threading.Lock, KnownCheckpoints]] = {}
_SHARED_LOCK = threading.Lock()


def shared(root: str) -> tuple[threading.Lock, KnownCheckpoints]:
    """The checkpoints of directory ``root`` as this process's writers that keep none of their
    own read them (the :class:`~.session.CommitSession` objects used without a Checkpointer, one
    made for each save: each one's pass read every manifest kept), by the directory's real path,
    with the lock to hold while using them (sessions in several threads). Sharing them is as
    safe as keeping them is (a manifest counts only while its file is the one read, whoever
    changed the directory meanwhile). A directory's stay for the life of the process."""
    key = os.path.realpath(root)
    with _SHARED_LOCK:
        got = _SHARED.get(key)
        if got is None:
            got = _SHARED[key] = (threading.Lock(), KnownCheckpoints())
        return got


def _key(path: str) -> _Key | None:
    """The identity of the manifest file of checkpoint folder ``path``; None without one."""
    try:
        st = os.stat(os.path.join(path, MANIFEST_NAME))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _entry(name: str, path: str) -> tuple[_Key, Entry] | None:
    """The identity of the manifest of checkpoint folder ``path`` and its entry at
    :attr:`~.catalog.Depth.NONE`, as :func:`~.catalog.scan` reads it; None where it has no
    readable manifest (incomplete, plain ``dcp.save``'s, unreadable: never a candidate)."""
    key = _key(path)
    if key is None:
        return None
    e = catalog.check(name, path, Depth.NONE, catalog.read_manifest)
    return (key, e) if e is not None and e.manifest is not None else None
