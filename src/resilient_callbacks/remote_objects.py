"""A remote store's objects and names: when an object was last modified (from a listing), the
MD5 that a single-part object's ETag is (the upload's check), which remote name a commit may
take (never one of another run writing to the same URL, nor one whose manifest cannot be read),
the object store's commit strategy (:class:`ManifestLastCommit`: manifest last), and what to
check when the store fails the preflight."""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .manifest import MANIFEST_NAME, FileEntry, Manifest
from .remote_manifest import put_manifest

if TYPE_CHECKING:
    from .remote import RemoteEntry, RemoteStore

log = logging.getLogger("resilient_callbacks")


def preflight_advice(e: BaseException, is_local: bool) -> str:
    """What to check when the preflight's write, read or delete of a probe object raised
    ``e``. A keyword the filesystem does not take (``remote_options={"endpoint": ...}``)
    reaches it only at the first request, as a ``TypeError``: that is the option, not the
    bucket or the credentials (which the message said)."""
    if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
        return (
            "A key of remote_options is not an option of this URL's filesystem (fsspec passes "
            "them on unchanged): check its spelling in that filesystem's documentation (s3fs: "
            "key, secret, token, endpoint_url, client_kwargs, config_kwargs, ...)"
        )
    if is_local:
        return "Check that the path is a writable directory on a mounted filesystem"
    return "Check the bucket name, the endpoint and the credentials"


def modified_time(info: Mapping[str, Any]) -> float | None:
    """An object's modification time from an fsspec listing (local: ``mtime``; S3:
    ``LastModified``; GCS: ``updated``), as a POSIX time; None if the listing has none."""
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        t = info.get(key)
        if isinstance(t, (int, float)):
            return float(t)
        if isinstance(t, datetime.datetime):
            return t.timestamp()
        if isinstance(t, str) and t:
            try:
                return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def md5(path: str) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# MD5-compare single-part objects up to this size (bigger ones: the store validates the CRC32
# checksum botocore sends with every PUT and part)
ETAG_CHECK_MAX = 8 << 20


def check_uploaded(info: Mapping[str, Any], where: str, size: int, local_path: str) -> None:
    """An object just uploaded from ``local_path`` (``info``: the store's listing of it, at
    ``where``) has the local file's size and, single-part up to :data:`ETAG_CHECK_MAX`, its
    MD5 as ETag; else :class:`OSError` naming it."""
    if int(info.get("size") or 0) != size:
        raise OSError(f"{where}: {info.get('size')} bytes after upload, expected {size}")
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if etag and "-" not in etag and len(etag) == 32 and size <= ETAG_CHECK_MAX:
        digest = md5(local_path)
        if digest != etag:
            raise OSError(f"{where}: ETag {etag} does not match the local MD5 {digest}")


# the commit a remote name holds when its manifest cannot be read here: equal to no real one
UNREADABLE: tuple[str, int] = ("", -1)


class RemoteNameTaken(FileExistsError):
    """:meth:`RemoteStore.upload`: ``name`` is a committed remote checkpoint of another commit
    (``key``: its run id and commit number; it may be the uploading commit's own key, written
    by another process that resumed the same run: :func:`same_commit`), one whose manifest
    cannot be read here (``key`` None: damaged, of a newer format, or the read failed), or one
    being deleted (``key`` :data:`UNREADABLE`), which the upload leaves alone: the caller
    uploads under a free name (:func:`free_name`), and keeps ``name`` off its own list of free
    names (:data:`UNREADABLE` is one key for many names)."""

    def __init__(self, name: str, key: tuple[str, int] | None, committed: bool = False) -> None:
        if committed:  # (a node's part: :func:`claim_part`)
            whose = "is this checkpoint, committed remotely already"
        elif key is None:
            whose = "is a remote checkpoint whose manifest cannot be read"
        elif key == UNREADABLE:  # (a mark that names no commit: a deletion's)
            whose = "is being deleted by another process (its .writer- mark is there)"
        else:
            whose = f"is another commit's remote checkpoint (run {key[0]}, commit {key[1]})"
        super().__init__(f"{name} {whose}")
        self.name, self.key, self.committed = name, key, committed


def key_of(raw: bytes) -> tuple[str, int] | None:
    """The (run id, commit number) of a manifest's bytes; None if they cannot be read."""
    try:
        m = Manifest.from_json(json.loads(raw), "")
    except Exception:
        return None
    return (m.run_id, m.seq)


def raw_seq(raw: bytes) -> int | None:
    """The ``seq`` of a manifest's bytes read as plain JSON, without validating the rest (one of
    a newer format this version refuses); None if they give none."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    seq = data.get("seq") if isinstance(data, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


def seq_floor(url: str, entries: Sequence[RemoteEntry]) -> int:
    """The highest commit number that ``entries`` (a listing of ``url``) show: their manifests',
    and the one a manifest this version refuses still gives (a newer format). One whose number
    cannot be read (damaged, or the store did not answer) is named in a warning: commits made
    now may sort before it, or share its number, once it can be read again."""
    best, unknown = 0, []
    for e in entries:
        if e.manifest is not None or e.seq_hint is not None:
            best = max(best, e.manifest.seq if e.manifest is not None else e.seq_hint or 0)
        elif MANIFEST_NAME in e.sizes:
            unknown.append(e.name)
    if unknown:
        log.warning(
            "the commit order of %s at %s is unknown: its %s cannot be read here; checkpoints "
            "committed now may be taken for older than it once it can be read again (its name "
            "is left to it; `resilient-ckpt gc DIR --remote URL --remove-corrupt` deletes one "
            "that is damaged)",
            ", ".join(unknown),
            url,
            MANIFEST_NAME,
        )
    return best


# a remote checkpoint's name: a local one's, or one :func:`free_name` gave (``step_N-r1``)
REMOTE_CKPT_RE = re.compile(r"^step_(\d+)(?:-\d+)?(?:-r\d+)?$")


def free_name(name: str, key: tuple[str, int], taken: Mapping[str, tuple[str, int]]) -> str:
    """``name``, unless ``taken`` (remote name -> the commit it holds; :data:`UNREADABLE` for a
    manifest that cannot be read) gives it to another commit than ``key`` (another run writing
    to the same URL, or a copy that may be only briefly unreadable): then ``name-rN``."""
    candidate, n = name, 0
    while candidate in taken and taken[candidate] != key:
        n += 1
        candidate = f"{name}-r{n}"
    return candidate


CLAIM_PREFIX = ".writer-"  # <name>/.writer-<run id>-<seq>-<tag><random>: an upload under way


def same_commit(raw: bytes, m: Manifest) -> bool:
    """Whether the manifest bytes ``raw`` (found remotely) are of the commit ``m``: its run,
    commit number, files and blobs. Two processes that resumed one run from the same URL (a
    second one started by mistake) number their commits alike, so a key alone may name two
    different checkpoints."""
    try:
        o = Manifest.from_json(json.loads(raw), "")
    except Exception:
        return False
    return (o.run_id, o.seq, o.files, o.blobs) == (m.run_id, m.seq, m.files, m.blobs)


def commit_tag(m: Manifest) -> str:
    """What tells one commit's marks from another's of the same key (two processes that resumed
    one run number their commits alike): 12 hex digits of its files and blobs, or, in node-local
    mode, the token every node's part of one commit records (``extra.node.token``; a part
    written before it had none: its key and remote name)."""
    node = m.extra.get("node") if isinstance(m.extra, dict) else None
    if isinstance(node, dict):
        token = node.get("token")
        if isinstance(token, str) and re.fullmatch(r"[0-9a-f]{12}", token):
            return token
        seed = f"{m.run_id}-{m.seq}-{node.get('remote_name')}"
    else:
        seed = repr((m.files, m.blobs))
    return hashlib.md5(seed.encode(), usedforsecurity=False).hexdigest()[:12]


def _own_marks(listed: set[str], key: tuple[str, int], tag: str) -> set[str]:
    """The marks among ``listed`` of the commit ``key`` tagged ``tag`` (another node's part of
    it, or an attempt a kill cut off), and those an older version put for ``key`` (12 random
    hex digits, no tag: taken for this commit's, as that version did)."""
    prefix = f"{CLAIM_PREFIX}{key[0]}-{key[1]}-"  # (run "a" commit 1 is not run "a-1"'s)
    out = set()
    for n in listed:
        rest = n[len(prefix) :] if n.startswith(prefix) else "-"
        if "-" not in rest and (
            len(rest) == 12 or (len(rest) == len(tag) + 8 and rest.startswith(tag))
        ):
            out.add(n)
    return out


def marks_of(names: Collection[str], key: tuple[str, int], tag: str) -> list[str]:
    """The marks among ``names`` (a listing of one checkpoint's folder) that the nodes' uploads
    of the commit ``key`` tagged ``tag`` put: the coordinator removes them once it committed."""
    return sorted(_own_marks(set(names), key, tag))


def claim(store: RemoteStore, name: str, m: Manifest, existing: bytes | None) -> str:
    """Before an upload of ``m`` puts anything under ``name``: mark it (an empty object
    ``<name>/.writer-<run id>-<seq>-<tag><random>``, :func:`commit_tag`), then list ``name``.
    Another mark, or a manifest other than ``existing`` (read before) and not of this commit,
    raises :class:`RemoteNameTaken` (ours removed): two processes uploading one name at once
    (another run given the same URL, a ``push`` from another directory) interleaved their files
    and manifests, and the one that committed first lost its checkpoint. Of two writers that
    mark one name at once the one listing last sees both and yields (if both list last, both
    do: neither writes there). A mark of this same commit (its key and tag: one a killed upload
    left, or another process's upload of the very same bytes) is removed and the upload goes
    on under ``name`` (a restart uploads what a killed process could not). One of the same key
    but another tag is another process's commit of this run (two processes resumed it: they
    number alike) and is yielded to, as one of another commit, which keeps the name (it takes
    ``name-rN``) until ``gc --remote`` removes the folder. Returns the mark, which the caller
    removes when the upload ends."""
    key = (m.run_id, m.seq)
    return _claim(store, name, key, commit_tag(m), existing, lambda raw: same_commit(raw, m))


def part_mark(store: RemoteStore, name: str, key: tuple[str, int], tag: str, node: int) -> str:
    """Node ``node``'s mark of its part of the node-local commit ``key`` (tagged ``tag``) under
    ``name``: one path for every attempt (a killed one's is the next one's), which the node
    removes with its part when the commit is dropped, also after a restart."""
    return store._path(name, f"{CLAIM_PREFIX}{key[0]}-{key[1]}-{tag}{node:08x}")


def claim_part(
    store: RemoteStore,
    name: str,
    key: tuple[str, int],
    tag: str,
    node: int,
    files: list[FileEntry] | None = None,
) -> str:
    """:func:`claim` for node ``node``'s part of the node-local commit ``key`` (tagged
    ``tag``; its mark: :func:`part_mark`): the marks of this commit's other parts stay (their
    uploads go on; the coordinator removes every one once it committed: :func:`marks_of`), and
    any manifest under ``name`` is another's (a node uploads before its commit), unless it is
    of ``key`` and lists every one of the part's ``files`` as they are: then this checkpoint is
    committed remotely already (a restart that could not list the store uploads its parts
    again), and :class:`RemoteNameTaken` says so (``committed``)."""

    def committed(raw: bytes) -> bool:
        try:
            m = Manifest.from_json(json.loads(raw), "")
        except Exception:
            return False
        listed = {f.path: f for f in m.files}
        return (m.run_id, m.seq) == key and all(listed.get(f.path) == f for f in files or [])

    mark = part_mark(store, name, key, tag, node)
    return _claim(store, name, key, tag, None, None, mark, committed if files else None)


def _claim(
    store: RemoteStore,
    name: str,
    key: tuple[str, int],
    tag: str,
    existing: bytes | None,
    ours: Callable[[bytes], bool] | None,
    mark: str | None = None,
    done: Callable[[bytes], bool] | None = None,
) -> str:
    mark = mark or store._path(name, f"{CLAIM_PREFIX}{key[0]}-{key[1]}-{tag}{uuid.uuid4().hex[:8]}")
    mine = mark.rsplit("/", 1)[-1]
    if store.is_local:
        store.fs.makedirs(store._path(name), exist_ok=True)
    store.fs.pipe_file(mark, b"")
    store.fs.invalidate_cache()
    listed: set[str] = {
        p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(store._path(name), False)
    }
    own = _own_marks(listed, key, tag) - {mine}
    for stale in sorted(own) if ours is not None else []:  # (node parts: the others' live ones)
        with contextlib.suppress(Exception):
            store.fs.rm_file(store._path(name, stale))
        log.info("%s: an upload of this commit was cut off there; uploading it again", name)
    others = sorted(n for n in listed if n.startswith(CLAIM_PREFIX) and n != mine and n not in own)
    taken: list[tuple[str, int] | None] = []  # (None: a manifest that cannot be read)
    if others:
        run, seq, *_ = [*others[0][len(CLAIM_PREFIX) :].rsplit("-", 2), "", ""]
        taken.append((run, int(seq)) if seq.isdigit() else UNREADABLE)  # (a deletion's)
    elif MANIFEST_NAME in listed and (raw := store._manifest_bytes(name)) not in (None, existing):
        if done is not None and done(raw):
            with contextlib.suppress(Exception):
                store.fs.rm_file(mark)
            raise RemoteNameTaken(name, key, committed=True)
        taken += [] if ours is not None and ours(raw) else [key_of(raw)]
    if taken:
        with contextlib.suppress(Exception):
            store.fs.rm_file(mark)
        raise RemoteNameTaken(name, taken[0])
    return mark


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


class ManifestLastCommit:
    """The :class:`~.commit.CommitStrategy` of an object store, which has no rename and no
    atomic directory: the files go under the checkpoint's final name, and the manifest goes
    last, once every file it lists is visible there with its size (and its MD5, where the
    store's ETag is one). A remote checkpoint exists only when its manifest does
    (:meth:`~.remote.RemoteStore.scan`), so a crash before the manifest leaves an invisible,
    incomplete folder that ``gc`` removes. ``local_dir`` holds the files being uploaded (for
    the MD5 check); the staging location is the checkpoint's name under the store's URL.

    Which ranks call what: the one process that uploads (the coordinator) calls all three."""

    def __init__(self, store: RemoteStore, name: str, local_dir: str) -> None:
        self.store, self.name, self.local_dir = store, name, local_dir

    def begin(self, step: int, uncommit: bool = True) -> str:
        """Uncommit whatever checkpoint had this name (its manifest first, so it is never seen
        with files missing; ``uncommit=False``: the caller saw none) and return the name to
        put the files under."""
        st = self.store
        with contextlib.suppress(FileNotFoundError):
            if uncommit:
                st.fs.rm_file(st._path(self.name, MANIFEST_NAME))
        if st.is_local:
            st.fs.makedirs(st._path(self.name), exist_ok=True)
        return self.name

    def commit(self, staging: str, step: int, manifest: bytes) -> str:
        """Check every listed file, then put the manifest: the checkpoint exists from then on.
        Raises ``OSError`` naming a file that is missing or differs (nothing is committed)."""
        st = self.store
        where = f"{st.url}/{staging}/{MANIFEST_NAME}"
        m = Manifest.from_json(json.loads(manifest), where)
        st._check_uploaded(self.local_dir, m, staging)
        if st.is_local:
            st._fsync_local([st._path(staging, f.path) for f in m.files])
        put_manifest(st, st._path(staging, MANIFEST_NAME), manifest)
        return f"{st.url}/{staging}"

    def abort(self, staging: str) -> None:
        """Remove what was put under ``staging`` (no manifest was written)."""
        self.store.delete(staging)
