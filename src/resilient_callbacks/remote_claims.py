"""Which remote name a commit may take: never one of another run writing to the same URL, nor
one whose manifest cannot be read. Before an upload puts anything under a name it marks it
(:func:`claim`; a node-local commit's part: :func:`claim_part`) and lists it: another writer's
mark or manifest there raises :class:`RemoteNameTaken`, and the caller takes a free name
(:func:`free_name`). A commit's marks carry its key and tag (:func:`commit_tag`), so that the
marks of one commit are told from another's of the same key.

Which ranks call what: the process that uploads (the coordinator's upload thread, or a CLI
``push``) calls :func:`claim`; each node leader in node-local mode calls :func:`claim_part`
for its part, and the coordinator :func:`marks_of` once it committed. Nothing here is
collective."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from .manifest import MANIFEST_NAME, FileEntry, Manifest

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("resilient_callbacks")


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
