"""The checkpoints a restore may try (:class:`Candidate`), and how the coordinator merges the
local and the remote tier's into one list, newest first (by commit number)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import branches, errors, stall
from .commit import CKPT_RE
from .errors import (
    AT_CALLER,
    RemoteUnavailableError,
    RemoteWaitPreemptedError,
    ResumeFallbackWarning,
    warn_and_log,
)
from .redact import command, url_text

if TYPE_CHECKING:
    from .catalog import Entry
    from .directory import Directory
    from .remote import RemoteEntry

log = logging.getLogger("resilient_callbacks")


@dataclass(frozen=True)
class Candidate:
    """A checkpoint restore may try: a local directory (``path``) or a remote copy (``remote``,
    its name in the remote tier; ``path`` is set once it is downloaded). ``key`` identifies a
    checkpoint across tiers: (run id, commit number). ``problem``: why it cannot be used, as far
    as rank 0 could tell from the manifest and the file sizes."""

    path: str | None
    step: int | None
    problem: str | None = None
    key: tuple[str, int] | None = None
    remote: str | None = None
    problem_type: str | None = None  # the class of the error that found the problem, if any
    # on a branch a roll-back abandoned (branches.py): tried only after the current lineage
    abandoned: bool = False

    @property
    def where(self) -> str | None:
        return self.path if self.path is not None else self.remote

    @classmethod
    def of(cls, e: Entry) -> Candidate:
        """A local checkpoint of the listing, as a candidate."""
        return cls(e.path, e.step, e.problem, problem_type=e.problem_type)

    def refused(self) -> errors.CheckpointCorruptError:
        """The error a resume that names this (broken) checkpoint raises: of the class of the
        one that found its problem (an UnsafeManifestError, say)."""
        kind = getattr(errors, self.problem_type or "", None)
        if not (isinstance(kind, type) and issubclass(kind, errors.CheckpointCorruptError)):
            kind = errors.CheckpointCorruptError
        return kind(f"cannot resume from {self.where}: {self.problem}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Candidate:
        key = d.get("key")
        return cls(
            d["path"],
            d["step"],
            d.get("problem"),
            (str(key[0]), int(key[1])) if key is not None else None,
            d.get("remote"),
            d.get("problem_type"),
            bool(d.get("abandoned", False)),
        )


def number_after_remote(d: Directory) -> None:
    """Coordinator, for a restore that does not list the tiers (``resume="never"``, a
    path): new commits still number after the remote's, or a later resume (which takes the
    highest commit number) would prefer an older run's checkpoint to this run's."""
    if d.sync is None or d.remote is None:
        return
    try:
        entries = stall.run(d.sync.refresh, f"listing {d.remote.url}", preemptible=True)
    except RemoteWaitPreemptedError:  # (the limit is longer than a grace period)
        raise
    except Exception as e:
        log.warning(
            "could not list the remote checkpoints in %s (%s: %s): this run's checkpoints "
            "are numbered after the local ones only",
            d.remote.url,
            type(e).__name__,
            url_text(str(e)),
        )
        return
    for re_ in entries:
        if re_.manifest is not None:
            d.seq = max(d.seq, re_.manifest.seq)


def merge_tiers(d: Directory, local: list[Entry]) -> list[Candidate]:
    """Coordinator: the committed checkpoints of both tiers, newest first; where one exists
    in both, the local copy comes first and the remote copy right after it (used if the
    local one turns out damaged). Numbers this run's commits after the remote's."""
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    # remote checkpoints whose manifest cannot be read (damaged, or the read failed): no commit
    # number, maybe the newest, so tried (and named) first, as local ones are: skipping them
    # silently let a node with an empty dirpath start from scratch beside the run's checkpoints
    unreadable: list[Candidate] = []
    for e in local:
        assert e.manifest is not None
        key = (e.manifest.run_id, e.manifest.seq)
        by_key[key] = {"local": e, "step": e.manifest.step, "seq": e.manifest.seq}
        by_key[key]["lineage"] = e.manifest.lineage
    if d.sync is not None and d.remote is not None:
        try:  # (bounded: a store that stalls every read hung the restart forever)
            remote_entries = stall.run(d.sync.refresh, f"listing {d.remote.url}", preemptible=True)
        except RemoteWaitPreemptedError:  # not resumed from an older one: it ends the run
            raise
        except Exception as e:
            why = (
                f"could not list the remote checkpoints in {d.remote.url} ({type(e).__name__}: {e})"
            )
            if not local:  # not "nothing to resume from": the store may hold the run
                raise RemoteUnavailableError(
                    f"{why}, and {d.dirpath} holds no checkpoint: not starting from scratch. "
                    "Retry when the store is reachable, or pass resume='never' to start "
                    "a new run"
                ) from e
            msg = f"{why}; resuming from the local ones only (the remote may hold newer)"
            warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=2)
            remote_entries = []
        unreadable = unreadable_remote(d.remote.url, remote_entries)
        for re_ in remote_entries:
            if re_.manifest is None:
                continue
            key = (re_.manifest.run_id, re_.manifest.seq)
            item = by_key.setdefault(key, {"step": re_.manifest.step, "seq": re_.manifest.seq})
            item["remote"] = re_
            item.setdefault("lineage", re_.manifest.lineage)
            # new saves must number after everything either tier holds
            d.seq = max(d.seq, re_.manifest.seq)
    # the current lineage of each run first, newest first; then what a roll-back abandoned
    off = branches.off_lineage((k[0], k[1], item["lineage"]) for k, item in by_key.items())
    out: list[Candidate] = []
    for key, item in sorted(
        by_key.items(), key=lambda kv: (kv[0] not in off, kv[1]["seq"], kv[1]["step"])
    ):
        pair: list[Candidate] = []
        gone = key in off
        if "local" in item:
            le = item["local"]
            pair.append(Candidate(le.path, le.step, le.problem, key, abandoned=gone))
        if "remote" in item:
            re_ = item["remote"]
            pair.append(Candidate(None, item["step"], re_.problem, key, re_.name, abandoned=gone))
        out[:0] = pair  # newest first
    return unreadable + out


def unreadable_remote(url: str, entries: list[RemoteEntry]) -> list[Candidate]:
    """The remote checkpoints of ``entries`` (a listing of ``url``) whose manifest is listed
    but cannot be read (damaged, of a newer format, or the store did not answer that read),
    newest first by the step in their name: candidates with that problem, which a restore
    names (never skips silently: they may be the run's newest, on every node of it)."""
    from .remote import NO_MANIFEST

    out = []
    for e in entries:
        if e.manifest is not None or e.problem == NO_MANIFEST:
            continue
        m = CKPT_RE.match(e.name)
        where = f"{url}/{e.name}"
        problem = e.problem or "unreadable manifest"
        problem = problem if where in problem else f"its remote copy {where}: {problem}"
        out.append(Candidate(None, int(m.group(1)) if m else None, problem, remote=e.name))
    out.sort(key=lambda c: -1 if c.step is None else c.step, reverse=True)
    return out


def warn_abandoned(c: Candidate, skipped: list[str], coordinator: bool) -> None:
    """Every rank (the coordinator warns, the others log): a restore loaded ``c`` by fallback,
    a checkpoint of a branch the run abandoned when it resumed from an older one (none of the
    current lineage could be restored: ``skipped``, what it tried)."""
    msg = (
        f"restored {c.where} (step {c.step}), a checkpoint of a branch this run abandoned when "
        "it resumed from an older checkpoint: no checkpoint of the run's current lineage could "
        f"be restored (tried: {', '.join(skipped) or 'none left'}). Training continues the "
        "abandoned timeline: if that is not what you want, stop and pass resume=<step or path> "
        "of the checkpoint to continue, or resume='never' to start anew"
    )
    warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=AT_CALLER, warn=coordinator)


def tried_as(c: Candidate) -> str:
    """What a candidate skipped for damage is known by when the directory is listed again."""
    return f"remote:{c.remote}" if c.remote is not None else str(c.path)


def repair_hint(dirpath: str, remote: Any, options: Any, tried: set[str]) -> str:
    """The commands that check, repair and remove the checkpoints a restore ``tried`` (local
    paths, ``remote:<name>``, :func:`.candidates.tried_as`): of the directory, of the remote
    tier (its URL: ``verify DIR --all`` reads no remote copy, and finds nothing at all in the
    empty directory of a new machine), or of both. ``gc --remove-corrupt`` keeps a checkpoint
    corrupt only through a shared blob (it can be repaired): ``--remove-blob-corrupt`` deletes
    it. A remote copy is repaired by ``push DIR URL --verify`` from a whole local copy (plain
    ``push`` compares sizes only: a changed byte of the same size stays)."""
    remove = "deletes them (`--remove-corrupt` keeps those corrupt only through a blob)"
    here = f"{command('verify', dirpath, '--all')} names what is damaged"
    if remote is None or not any(t.startswith("remote:") for t in tried):
        return (
            f"{here} (a blob they share, with its repair); "
            f"{command('gc', dirpath, '--remove-blob-corrupt')} {remove}"
        )
    url = url_text(str(remote).rstrip("/"))
    local = any(not t.startswith("remote:") for t in tried)
    there = f"{command('verify', url, '--all')} names what is damaged in the remote tier"
    return (
        (f"{here} in the directory, and " if local else "")
        + f"{there} (a blob they share: each one's own files may be whole); "
        + f"{command('push', 'DIR', url, '--verify')}, DIR a directory that holds whole copies "
        + "of them (the run's own on the machine that wrote them"
        + (f", not {dirpath}, whose copies are damaged too" if local else "")
        + "), uploads what is damaged again, which repairs them; without one they cannot be "
        + f"repaired: {command('gc', dirpath, '--remote', url, '--remove-blob-corrupt')} "
        + remove[:-1]
        + "; add `--keep-last N` where gc asks for it: a store whose manifests record no "
        + "remote retention)"
        + (" (each with `-o KEY=VALUE` for the remote_options)" if options else "")
    )
