"""``ResilientStorageReader``: a drop-in ``StorageReader`` for ``dcp.load`` that reads the newest
valid checkpoint a :class:`~.storage_writer.ResilientStorageWriter` committed -- verified before
anything is loaded, falling back loudly (and on every rank together) past a damaged one, and
never unpickling.

Which ranks call what (DCP's sequence, see ``torch.distributed.checkpoint.StorageReader``):
every rank calls ``read_metadata`` -- rank 0 lists the committed checkpoints, every rank
checks the checksums of a share of the newest one's files (the files of the ranks ``r`` with
``r % world_size == rank``), and the ranks agree (the core's JSON collectives, no pickle)
before moving to an older one -- then ``set_up_storage_reader``, ``prepare_local_plan`` and
``read_data``; the coordinator also calls ``prepare_global_plan``.

``read_data`` reads only the chunks this rank's plan asks for (DCP's planner computes the
overlaps when the number of ranks changed): tensors from the safetensors files, objects from
JSON, set into the state dict directly (DCP's ``DefaultLoadPlanner.load_bytes`` would
``torch.load(..., weights_only=False)`` them).

:func:`plain_dcp_reader` opens a checkpoint written by plain ``dcp.save`` (to migrate): opt-in,
because DCP's format unpickles.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch.distributed.checkpoint
from safetensors import safe_open
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import catalog, dist, notices
from ..catalog import Depth
from ..config import local_dirpath
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    NoValidCheckpointError,
    ResumeFallbackWarning,
    UnsupportedStateError,
    caller_stacklevel,
    relayed,
    warn_and_log,
)
from ..export_target import within
from ..manifest import MANIFEST_NAME, check_relative, read_manifest
from ..reader import abandoned, by_commit, committed, find, unordered
from ..tensor_headers import read_verified
from . import lineage
from .chunks import join
from .metadata_json import METADATA_NAME, from_json

log = logging.getLogger("resilient_callbacks")
_DCP_DIR = os.path.dirname(torch.distributed.checkpoint.__file__)  # dcp.load calls the reader
_DCP_LOAD = os.path.abspath(os.path.join(_DCP_DIR, "state_dict_loader.py"))


_ABANDONED = (
    "dcp.load: loaded {path}, a checkpoint of a branch abandoned when the run resumed from an "
    "older checkpoint: no checkpoint of the current lineage could be loaded (skipped: "
    "{skipped}). Training continues the abandoned timeline: if that is not what you want, "
    "pass ResilientStorageReader(dirpath, step=N) of the checkpoint to continue"
)


class _ReadMetadataFailed(BaseException):
    """``read_metadata``'s error on its way out of ``dcp.load``, whose ``local_step`` catches
    ``Exception`` there to try per-rank metadata: torch 2.11 then drops it (the user read only
    "metadata is None"), torch 2.13 appends it to that. Not an ``Exception``, it passes; DCP
    wraps it, as any error of a rank, in the ``CheckpointException`` (itself a ``BaseException``)
    that ``dcp.load`` raises, whose message is then this one: the error's type and message."""


class ResilientStorageReader(StorageReader):
    """Read, for ``dcp.load``, the newest valid checkpoint in ``dirpath`` (a directory of
    ``step_*`` checkpoints, or one of them), or the one of ``step``. Every rank constructs it
    with the same arguments. After ``read_metadata``, :attr:`path` and :attr:`step` say which
    checkpoint was chosen and :attr:`skipped` the newer ones that could not be used, and why.

    The ranks agree on the checkpoint with collectives of their own, which DCP does not tell
    the group of: give the reader what ``dcp.load`` gets -- ``process_group=`` (the ranks
    loading this checkpoint) or ``no_dist=True`` (one process loading alone in a job of
    several).

    ``remote`` (an fsspec URL, the writer's ``remote=``; ``remote_options`` as there): rank 0
    first downloads the remote's newest checkpoint (or that of ``step``) into ``dirpath`` when
    ``dirpath`` holds nothing as new -- a new machine, a lost disk -- every checksum verified,
    moved into place atomically. ``dirpath`` must be one directory every loading rank sees (a
    local disk with one process, a shared filesystem); not while a writer is open on it."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        step: int | None = None,
        process_group: Any = None,
        no_dist: bool = False,
        remote: str | None = None,
        remote_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.dirpath = local_dirpath(dirpath)  # (a remote URL goes to remote=)
        self.step = step
        self.remote = remote
        self.remote_options = remote_options
        self.process_group = process_group
        self.no_dist = no_dist
        self.path: str | None = None
        self.loaded_step: int | None = None
        self.skipped: list[str] = []
        self._abandoned: list[str] = []  # rank 0: of the candidates, those a roll-back left
        self.storage: dict[MetadataIndex, dict[str, Any]] = {}
        self.rank = 0
        self.resumes = True  # the next unnumbered save continues the step loaded (lineage.py)
        self._seq = 0  # rank 0: the directory's newest commit when it was listed

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """``checkpoint_id`` (from ``dcp.load(..., checkpoint_id=...)``): a step to load (an
        int, as the writer's ``checkpoint_id``), or a checkpoint directory or one checkpoint in
        it (a path)."""
        if checkpoint_id is None:
            return
        if isinstance(checkpoint_id, bool) or not isinstance(
            checkpoint_id, (int, str, os.PathLike)
        ):
            raise ConfigError(
                f"checkpoint_id={checkpoint_id!r}: with ResilientStorageReader, checkpoint_id is "
                "a step to load (an int) or a checkpoint directory (a path)"
            )
        if isinstance(checkpoint_id, int):
            self.step = checkpoint_id
        else:
            self.dirpath = local_dirpath(checkpoint_id, "checkpoint_id")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically: pass storage_reader=ResilientStorageReader(...)

    # ------------------------------------------------------------------ choosing (every rank)

    def _candidates(self) -> list[str]:
        """Rank 0: the checkpoints to try, best first."""
        root = self.dirpath
        if os.path.exists(os.path.join(root, MANIFEST_NAME)):
            self._seq = lineage.newest_seq(committed(os.path.dirname(root)))
            return [root]
        if self.remote is not None:
            self._fetch_remote(root)
        if not os.path.isdir(root):
            raise CheckpointNotFoundError(f"{root}: no such checkpoint directory")
        entries = committed(root)
        self._seq = lineage.newest_seq(entries)  # (lineage.py)
        if not entries:
            from ..cli_scan import no_checkpoints  # names what is there instead

            raise no_checkpoints(root)
        if self.step is not None:
            return [find(entries, root, self.step).path]
        ordered = by_commit(entries)  # the current lineage first (branches.py)
        off = abandoned(entries)
        self._abandoned = [e.path for e in ordered if e.name in off]
        # a manifest that cannot be read may be the newest: tried first, so its skip is said
        maybe_newer = unordered(entries, ordered[0].step if ordered else None)
        return [e.path for e in maybe_newer + ordered]

    def _fetch_remote(self, root: str) -> None:
        """Rank 0: download the remote's newest checkpoint (or ``step``'s) unless ``root``
        holds it or a newer commit; one whose checksums do not match is skipped (said) for the
        next newest. A remote that cannot be read or fetched is said, and the local
        checkpoints decide."""
        from ..pulling import pull_newest_whole, usable
        from ..remote import RemoteStore

        try:
            st = RemoteStore(self.remote or "", self.remote_options)
            entries = usable(st, self.step)
            local = [e.manifest for e in committed(root) if e.manifest is not None]
            held = {(m.run_id, m.seq) for m in local}
            ahead = max((m.seq for m in local), default=-1) if self.step is None else -1
            # what the local directory neither holds nor is ahead of: newest first, one found
            # damaged (a file that rotted in place, its size right) skipped, loudly
            fresh = [e for e in entries if e.key not in held and (e.key or ("", -1))[1] > ahead]
            if not fresh or entries[-1].key in held:
                return

            def skipping(e: Any, err: Exception) -> None:
                why = f"{st.url}/{e.name} (remote): {err}"
                self._remote_skipped.append(why)
                msg = f"dcp.load: skipping the remote checkpoint {why}; fetching an older one"
                level = caller_stacklevel(_DCP_DIR)  # the user's dcp.load(...)
                warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=level)

            entry, path, _ = pull_newest_whole(st, fresh, root, skipping=skipping)
            log.warning("dcp.load: fetched %s/%s into %s", st.url, entry.name, path)
        except CheckpointNotFoundError as e:  # nothing remote (a mistyped URL reads so too)
            log.warning("dcp.load: the remote was not used: %s", e)
        except Exception as e:
            log.warning("dcp.load: the remote %s was not used: %s", self.remote, e)

    def read_metadata(self, *args: Any) -> Metadata:
        """Every rank: choose the checkpoint (verified, agreed) and read its metadata. (No
        ``**kwargs``: DCP then does not retry with per-rank metadata, which this format has
        not.) Called by ``dcp.load``, an error leaves as :class:`_ReadMetadataFailed`."""
        try:
            return self._read_metadata()
        except Exception as e:
            if os.path.abspath(sys._getframe(1).f_code.co_filename) != _DCP_LOAD:
                raise
            raise _ReadMetadataFailed(f"{type(e).__name__}: {e}") from e

    def _read_metadata(self) -> Metadata:
        group = self.process_group
        together = dist.is_initialized() and not self.no_dist
        rank, world = (_group_rank(group), _group_size(group)) if together else (0, 1)
        listing: dict[str, Any] = {"paths": [], "error": None, "seq": 0, "abandoned": []}
        self._remote_skipped: list[str] = []  # rank 0: remote checkpoints found damaged
        pending: Exception | None = None
        if rank == 0:
            try:
                self._abandoned = []
                listing["paths"] = self._candidates()
                listing["seq"], listing["abandoned"] = self._seq, self._abandoned
                listing["remote_skipped"] = self._remote_skipped
            except Exception as e:  # raised on rank 0, relayed to the others
                listing["error"], pending = [type(e).__name__, str(e)], e
        if together:
            listing = dist.broadcast_json(listing, src=_global_rank(group, 0), group=group)
        if isinstance(pending, CheckpointError):
            raise pending
        if pending is not None:  # (an OSError, a remote's: not found, as on the other ranks)
            raise CheckpointNotFoundError(f"{type(pending).__name__}: {pending}") from pending
        if listing["error"] is not None:
            name, msg = listing["error"]
            raise relayed(name, msg, default=CheckpointNotFoundError)
        if not listing["paths"]:
            raise CheckpointNotFoundError(f"no checkpoints in {self.dirpath}")
        here = self.dirpath
        foreign = [p for p in listing["paths"] if p != here and not within(p, here)]
        if foreign:  # rank 0 read another directory: another group's reader, or other args
            raise CheckpointNotFoundError(
                f"rank 0 of the group chose {foreign[0]}, which is not in this rank's "
                f"{self.dirpath}: every rank of a dcp.load must construct the reader with the "
                "same dirpath, and with dcp.load's process_group= (or no_dist=True)"
            )
        self.skipped = list(listing.get("remote_skipped", []))  # the newer ones, remote first
        for path in listing["paths"]:
            result: dict[str, Any] = {"problem": None, "meta": None}
            try:
                manifest = read_manifest(path)
                entry = next((f for f in manifest.files if f.path == METADATA_NAME), None)
                if entry is None:
                    raise CheckpointCorruptError(f"{path}: {_not_dcp(manifest.extra)}")
                mine = [r for r in range(manifest.world_size) if r % world == rank]
                catalog.verify(path, manifest, Depth.FULL, ranks=mine)
                raw = read_verified(os.path.join(path, METADATA_NAME), entry.digest)
                result["meta"] = from_json(json.loads(bytes(raw)))
                _check_storage(path, manifest, result["meta"][1])
            except (CheckpointCorruptError, OSError, ValueError, KeyError, TypeError) as e:
                result["problem"] = str(e)
            said = (
                dist.all_gather_json(result["problem"], group) if together else [result["problem"]]
            )
            problems = [p for p in said if p]
            if not problems:
                meta, self.storage = result["meta"]
                self.path, self.loaded_step = path, manifest.step
                if self.resumes:  # (an export's read is no resume)
                    lineage.loaded(os.path.dirname(path), manifest.step, listing["seq"], manifest)
                if self.skipped:  # the ranks agreed on it: said once, on rank 0
                    level = logging.WARNING if rank == 0 else logging.INFO  # (group rank)
                    log.log(level, "dcp.load: restored %s after skipping %s", path, self.skipped)
                if path in listing["abandoned"]:  # loudly: the run's timeline changes
                    msg = _ABANDONED.format(path=path, skipped=self.skipped)
                    level = caller_stacklevel(_DCP_DIR)
                    warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=level, warn=rank == 0)
                return meta
            why = "; ".join(problems)
            self.skipped.append(f"{path}: {why}")
            if self.step is not None or len(listing["paths"]) == 1:
                raise CheckpointCorruptError(f"cannot load {path}: {why}")
            msg = f"skipping checkpoint {path}: {why}; falling back to an older checkpoint"
            level = caller_stacklevel(_DCP_DIR)  # the user's dcp.load(...)
            warn_and_log(log, msg, ResumeFallbackWarning, stacklevel=level, warn=rank == 0)
        raise NoValidCheckpointError(
            f"{self.dirpath} holds {len(listing['paths'])} checkpoint(s) but none can be loaded:"
            "\n  - " + "\n  - ".join(self.skipped)
        )

    # ------------------------------------------------------------------ DCP's sequence

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.rank = int(kwargs.get("rank", dist.rank()))
        if not self.storage and isinstance(metadata.storage_data, dict):
            self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank: read the items of this rank's plan, grouped by file."""
        assert self.path is not None, "read_data() before read_metadata()"
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage[item.storage_index]["file"], []).append(item)
        for name, items in sorted(by_file.items()):
            full = os.path.join(self.path, *name.split("/"))
            if name.endswith(".json"):
                with open(full, "rb") as f:
                    objects = json.loads(f.read())
                for item in items:
                    obj = join(objects[self.storage[item.storage_index]["key"]], _no_tensor)
                    _set_object(planner, item, obj)
                continue
            with safe_open(full, framework="pt") as f:
                for item in items:
                    key = self.storage[item.storage_index]["key"]
                    if len(item.lengths) == 0:
                        src = f.get_tensor(key)
                    else:
                        src = f.get_slice(key)[
                            tuple(
                                slice(o, o + n)
                                for o, n in zip(item.storage_offsets, item.lengths, strict=True)
                            )
                        ]
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != src.shape:
                        raise CheckpointCorruptError(
                            f"{full}: {key} gives {list(src.shape)}, the plan needs "
                            f"{list(target.shape)}"
                        )
                    target.copy_(src)
                    planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _group_rank(group: Any) -> int:
    import torch.distributed as tdist

    return int(tdist.get_rank(group))


def _group_size(group: Any) -> int:
    import torch.distributed as tdist

    return int(tdist.get_world_size(group))


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as tdist

    return rank if group is None else int(tdist.get_global_rank(group, rank))


def _check_storage(path: str, manifest: Any, storage: Any) -> None:
    """Every file the metadata names is one the manifest lists (and so was verified): a
    tampered metadata naming ``../x`` or another file is refused before anything is read."""
    listed = {f.path for f in manifest.files}
    for info in storage.values():
        name = info["file"]
        check_relative(name, f"{path}/{METADATA_NAME}")
        if name not in listed:
            raise CheckpointCorruptError(
                f"{path}/{METADATA_NAME} names {name!r}, which the manifest does not list"
            )


def _no_tensor(name: str) -> Any:
    raise CheckpointCorruptError(f"an object in {METADATA_NAME} refers to a tensor ({name})")


def _not_dcp(extra: dict[str, Any]) -> str:
    """Why a checkpoint of ours is not for ``dcp.load``, and what loads it."""
    parts = sorted(extra.get("parts") or {})
    how = (
        f"a Checkpointer's, with the Sharded part(s) {', '.join(parts)}: load it with "
        f"Checkpointer(dirpath, read_only=True).restore({{{parts[0]!r}: Sharded(model, "
        "optimizer)}) (docs/fsdp.md)"
        if parts
        else "a Checkpointer's or a framework callback's: load it with a Checkpointer"
    )
    return f"not written by ResilientStorageWriter (no {METADATA_NAME}): {how}"


def _set_object(planner: LoadPlanner, item: ReadItem, obj: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does, with a JSON value instead of unpickling."""
    if item.type != LoadItemType.BYTE_IO:
        raise CheckpointCorruptError(f"{item.dest_index.fqn}: a tensor stored as JSON")
    if not isinstance(planner, DefaultLoadPlanner):
        raise UnsupportedStateError(
            f"{item.dest_index.fqn}: loading objects needs DefaultLoadPlanner (another planner's "
            f"load_bytes may unpickle); got {type(planner).__name__}"
        )
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], obj)
    else:  # DCP's sets it into planner.state_dict, a copy of yours here (it flattens
        # ShardedTensors): the value you passed stayed, in silence
        planner.state_dict[item.dest_index.fqn] = obj
        planner.original_state_dict[item.dest_index.fqn] = obj


def plain_dcp_reader(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> StorageReader:
    """A reader for a checkpoint written by plain ``dcp.save`` (``.metadata`` + ``*.distcp``),
    to migrate it: load it with ``dcp.load(sd, storage_reader=plain_dcp_reader(p,
    allow_pickle=True))`` and save it again with :class:`ResilientStorageWriter`.

    DCP's format **unpickles**: its ``.metadata`` is a pickle, and its non-tensor items are
    loaded with ``torch.load(weights_only=False)``; a tampered checkpoint runs code. Hence the
    opt-in: without ``allow_pickle=True`` this raises :class:`UnsupportedStateError`. Read only
    checkpoints you trust."""
    if not allow_pickle:
        raise UnsupportedStateError(
            f"{os.fspath(path)}: a plain dcp.save checkpoint is read by unpickling its .metadata "
            "and objects (a tampered file runs code); pass allow_pickle=True only for a "
            "checkpoint you trust"
        )
    from torch.distributed.checkpoint import FileSystemReader

    notices.say_once(  # (every rank reads it: said once, on rank 0)
        log,
        f"reading the plain DCP checkpoint {os.fspath(path)} unpickles its metadata and objects",
        UserWarning,
        stacklevel=2,
    )
    return FileSystemReader(os.fspath(path))
