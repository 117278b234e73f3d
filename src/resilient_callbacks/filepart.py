"""FilePart: a piece of training state that owns its files (DeepSpeed ZeRO partitions, DCP
shards), put anywhere in a Checkpointer's state (in a dict, a list, a tuple).

The core stays in charge of everything that makes a checkpoint trustworthy; the part only says
what its files hold. At a save the part is recorded in the structure as a ``filepart`` node,
and its files live under ``parts/<id>/`` of the checkpoint (``id``: its place in the state, as
``"engine"`` or ``"models/0"``), listed in the manifest like every other file.

Which ranks call what (every rank holds the part at the same place in its state):

- :meth:`FilePart.capture` -- every rank, on the training thread, at every save: copy what this
  rank writes into ``buffers`` (a :class:`CaptureBuffers`: host buffers the core keeps for this
  part and reuses between saves) and return what :meth:`write` needs. Either
  ``buffers.get(name, like)`` and a copy by the part (complete when ``capture`` returns), or
  ``buffers.copy(tensors, step_only=...)``, which copies GPU tensors on a side stream (ordered as
  :mod:`.snapshot` describes) and, with ``overlap_snapshot=True``, copies the tensors that only
  an optimizer step changes in the background: the optimizers :meth:`FilePart.stepped_by` names
  wait for that copy at their next ``step()``. The training loop may change the live tensors as
  soon as ``capture`` returns, except that the optimizers' step waits; the core waits for every
  copy before :meth:`write` runs.
- :meth:`FilePart.write` -- every rank, in the background writer (or on the training thread for
  a synchronous save): write the captured copies only through ``writer`` (the core's hashing
  writers, into the part's own sub-folder). Each rank writes its own files; names must differ
  between ranks (put the rank in them). A failure is reported like any rank's failure: no
  commit, the error names the rank.
- :meth:`FilePart.describe` -- every rank, on the training thread, at every save (optional):
  JSON-able facts about how the part is laid out (a ZeRO stage, a data-parallel degree, a device
  mesh). The coordinator's are recorded in the manifest (``extra["parts"][id]``) and given back
  at restore as ``info.saved``.
- :meth:`FilePart.host_tensors` -- every rank, on the training thread, once, at the first
  ``step()`` that does not save (optional; no collective: ranks may differ in what they have):
  the tensors ``capture`` is expected to copy, under the names it gives ``buffers``, so that
  the core allocates their host buffers in a helper thread before the first save is due (as it
  does for the rest of the state). A buffer the first save does not use is freed after it.
- :meth:`FilePart.files_to_read` -- every rank, at restore: the names (in the part's folder)
  this rank needs, given what the checkpoint lists, who wrote it and ``info.saved``; raise
  :class:`~.errors.CheckpointMismatchError` to refuse a checkpoint early (e.g. another world
  size, another ZeRO stage): the refusal is agreed across ranks and restore raises it on every
  rank, before anything is loaded (an older checkpoint of the same run would not fit either).
  Any other error it raises but an ``OSError`` (:class:`~.errors.CheckpointCorruptError` for
  damage) is taken as such a refusal, naming it: it comes from the live objects the part
  holds, not from the checkpoint. The core verifies each file (size and checksum) before
  anything is loaded: a missing or corrupt file makes restore fall back, loudly, to the
  previous checkpoint.
- :meth:`FilePart.load` -- every rank, once every rank has read and verified its files: restore
  from the verified contents in ``reader``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .errors import UnsupportedStateError
from .filewrite import write_json
from .manifest import FileEntry
from .part_names import PARTS_EXTRA, part_dir
from .tensorfile import DirectBuffer, write_tensors

if TYPE_CHECKING:
    from .part_blobs import PartBlobSession
    from .snapshot import HostBuffers, Snapshot
    from .unchanged import PartTracker, Sig

log = logging.getLogger("resilient_callbacks")


def _check_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name == "manifest.json":
        raise UnsupportedStateError(
            f"a FilePart file name must be a plain name inside its folder, got {name!r}"
        )
    return name


@dataclass
class PartInfo:
    """What a part is told at restore: its id, this rank, the world size now and when saved,
    the names the checkpoint lists in the part's folder with the rank that wrote each, and what
    the part's :meth:`FilePart.describe` said at the save (``{}`` if nothing), and whether the
    restore may load a part of what was saved (``partial``: a read-only Checkpointer; a part
    then leaves out saved state its live objects lack, an optimizer, instead of refusing)."""

    part_id: str
    rank: int
    world_size: int
    saved_world_size: int
    listed: dict[str, int]
    saved: dict[str, Any] = field(default_factory=dict)
    partial: bool = False


class PartWriter:
    """Writes one part's files of one rank into a staging directory, through the core's hashing
    writers; the entries it made go into the manifest. With ``blobs`` (``incremental=True``),
    the tensors of at least :data:`~.blobs.BLOB_MIN` bytes are stored as blobs, written only
    when no earlier save stored their bytes (:mod:`.part_blobs`)."""

    def __init__(
        self,
        staging: str,
        part_id: str,
        rank: int,
        *,
        direct: bool = False,
        bounce: DirectBuffer | None = None,
        blobs: PartBlobSession | None = None,
    ) -> None:
        self.folder = part_dir(part_id)
        self._root = os.path.join(staging, *self.folder.split("/"))
        self.rank = rank
        self._direct, self._bounce = direct, bounce
        self._blobs = blobs
        self.entries: list[FileEntry] = []
        os.makedirs(self._root, exist_ok=True)

    def tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` as one safetensors file ``name``."""
        from .part_blobs import refs_metadata

        inline: dict[str, torch.Tensor] = dict(tensors)
        refs: dict[str, str] = {}
        if self._blobs is not None:
            inline, refs = self._blobs.split(tensors)
        d = write_tensors(
            os.path.join(self._root, _check_name(name)),
            inline,
            {"format": "resilient_callbacks", "part": self.folder, **refs_metadata(refs)},
            direct=self._direct,
            bounce=self._bounce,
        )
        self.entries.append(FileEntry(f"{self.folder}/{name}", d.size, d.xxh3_64, self.rank))
        if self._blobs is not None:
            self.entries += [self._blobs.entries[b] for b in sorted(set(refs.values()))]

    def json(self, name: str, obj: Any) -> None:
        """Write a JSON-able ``obj`` as file ``name``."""
        d = write_json(os.path.join(self._root, _check_name(name)), obj)
        entry = FileEntry(f"{self.folder}/{name}", d.size, d.xxh3_64, self.rank, "structure")
        self.entries.append(entry)


@dataclass
class PartReader:
    """The verified contents of the files one rank of one part asked for."""

    info: PartInfo
    _tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _json: dict[str, Any] = field(default_factory=dict)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} was not asked for by files_to_read()") from None

    def json(self, name: str) -> Any:
        try:
            return self._json[name]
        except KeyError:
            raise KeyError(f"{name!r} was not asked for by files_to_read()") from None


class FilePart(ABC):
    """A piece of state that owns its files. See the module docstring for the rank contract."""

    @abstractmethod
    def capture(self, buffers: CaptureBuffers) -> Any:
        """Training thread: copy this rank's state into ``buffers``; return it for write()."""

    @abstractmethod
    def write(self, captured: Any, writer: PartWriter) -> None:
        """Background: write ``captured`` through ``writer`` only."""

    def stepped_by(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers whose ``step()`` changes the tensors this part passes to
        ``buffers.copy(..., step_only=...)``: in overlapped mode their next step waits for the
        copy. Default: none (nothing may be deferred)."""
        return ()

    def describe(self) -> Mapping[str, Any]:
        """Training thread, at each save: JSON-able facts about this part's layout, recorded in
        the manifest and given back at restore as ``info.saved``. Default: nothing."""
        return {}

    def host_tensors(self) -> Mapping[str, torch.Tensor]:
        """Training thread, once before the first save, no collective: the tensors
        :meth:`capture` is expected to copy, by the names it gives ``buffers``, for allocating
        their host buffers ahead. Default: none (the first save allocates them)."""
        return {}

    @abstractmethod
    def files_to_read(self, info: PartInfo) -> list[str]:
        """Restore: the names in this part's folder that this rank reads."""

    @abstractmethod
    def load(self, reader: PartReader) -> None:
        """Restore from the verified files in ``reader``."""


class CaptureBuffers:
    """What :meth:`FilePart.capture` gets: the part's reused host buffers (:meth:`get`) and a
    copy into them that the core may finish later (:meth:`copy`)."""

    def __init__(
        self,
        buffers: HostBuffers,
        overlap: bool,
        tracker: PartTracker | None = None,
    ) -> None:
        self._buffers = buffers
        self._overlap = overlap
        self._tracker = tracker  # incremental=True: what need not be copied again
        self.snapshots: list[Snapshot] = []
        self.names: set[str] = set()  # the buffers this capture used
        self.hints: dict[Sig, str] = {}  # host copy -> content key, known unchanged
        self.watched: dict[str, tuple[torch.Tensor, tuple[Any, ...], int, torch.Tensor]] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The host buffer for ``name`` (allocated once, reused while shape and dtype match)."""
        self.names.add(name)
        return self._buffers.get(name, like)

    def copy(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        step_only: set[int] | None = None,
        frozen: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into this part's buffers and return the copies, by name (for
        :meth:`FilePart.write`; the core waits for the copies before it calls write).

        ``step_only``: storage addresses (``t.untyped_storage().data_ptr()``) of tensors that
        only an optimizer step of :meth:`FilePart.stepped_by` changes. With
        ``overlap_snapshot=True`` those are copied in the background (a helper thread on the CPU,
        the side stream on a GPU) and the next optimizer step waits for the copy; every other
        tensor is copied (or, on a GPU, ordered before later kernels) before this returns.

        ``frozen=True``: the part vouches that nothing but in-place writes that bump the
        version counter changes ``tensors`` (frozen parameters: no optimizer holds them, no
        kernel updates them as BatchNorm updates its running statistics). With
        ``incremental=True`` such a tensor known unchanged since the last committed save
        (:class:`~.unchanged.PartTracker`) is not copied: its buffer holds its bytes already.
        Every other tensor is copied (and hashed) at every save."""
        from .snapshot import Snapshot
        from .unchanged import buffer_sig, watch_all

        self.names.update(tensors)
        kept: dict[str, torch.Tensor] = {}
        watch: dict[str, tuple[torch.Tensor, tuple[Any, ...], int]] = {}
        if self._tracker is not None and frozen:
            for name, w in watch_all(tensors, None).items():
                watch[name] = w
                buf = self._buffers.existing(name)
                key = self._tracker.unchanged(name, w, buf)
                if key is not None and buf is not None:
                    kept[name] = buf
                    self.hints[buffer_sig(buf)] = key
        snap = Snapshot(
            {k: t for k, t in tensors.items() if k not in kept},
            self._buffers,
            overlap_storages=step_only if self._overlap else None,
        )
        self.snapshots.append(snap)
        copies = {k: kept[k] if k in kept else snap.copies[k] for k in tensors}
        for name, (t, where, version) in watch.items():
            self.watched[name] = (t, where, version, copies[name])
        return copies


class CapturedParts:
    """The parts of one save, captured on the training thread, for the writer to write."""

    def __init__(
        self,
        parts: dict[str, tuple[FilePart, Any]],
        described: dict[str, dict[str, Any]] | None = None,
        snapshots: list[Snapshot] | None = None,
    ) -> None:
        self.parts = parts
        self.described = described or {}
        self.snapshots = snapshots or []
        self.hints: dict[Sig, str] = {}  # incremental: host copies known unchanged -> key
        self.watched: dict[str, dict[str, Any]] = {}  # part id -> CaptureBuffers.watched

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose step must wait for the parts' deferred copies."""
        return [o for part, _ in self.parts.values() for o in part.stepped_by()]

    def wait_device(self) -> None:
        """Order what comes next (the optimizer step) after the deferred copies."""
        for snap in self.snapshots:
            snap.wait_device()

    def wait_host(self) -> None:
        """Block until every copy is in host memory (the writer, before write())."""
        for snap in self.snapshots:
            snap.wait_host()

    def manifest_extra(self) -> dict[str, Any]:
        """What the manifest records of the parts (``extra["parts"]``), if any said anything."""
        said = {pid: d for pid, d in self.described.items() if d}
        return {PARTS_EXTRA: said} if said else {}

    def write(
        self,
        staging: str,
        rank: int,
        *,
        direct: bool,
        bounce: DirectBuffer | None,
        blobs: PartBlobSession | None = None,
    ) -> list[FileEntry]:
        out: list[FileEntry] = []
        for part_id, (part, captured) in self.parts.items():
            writer = PartWriter(staging, part_id, rank, direct=direct, bounce=bounce, blobs=blobs)
            part.write(captured, writer)
            out += writer.entries
        return out


class PartBuffers:
    """The reused host buffers of each FilePart of the state, by part id."""

    def __init__(self, track: bool = False) -> None:
        self._by_id: dict[str, HostBuffers] = {}
        self._track = track  # incremental=True: copy no tensor known unchanged
        self._trackers: dict[str, PartTracker] = {}

    def capture(self, parts: Mapping[str, FilePart], *, overlap: bool = False) -> CapturedParts:
        """Training thread: let each part copy its state into its own buffers (``overlap``:
        what a part marks as changed only by an optimizer step may be copied in the
        background)."""
        for gone in [k for k in self._by_id if k not in parts]:
            del self._by_id[gone]
        for gone in [k for k in self._trackers if k not in parts]:
            del self._trackers[gone]
        described = {}
        for part_id, part in parts.items():
            said = dict(part.describe())
            try:
                json.dumps(said)
            except (TypeError, ValueError) as e:
                raise UnsupportedStateError(
                    f"FilePart {part_id!r}: describe() must return JSON-able values ({e})"
                ) from None
            described[part_id] = said
        captured: dict[str, tuple[FilePart, Any]] = {}
        snapshots: list[Snapshot] = []
        hints: dict[Sig, str] = {}
        watched: dict[str, dict[str, Any]] = {}
        for part_id, part in parts.items():
            host = self._by_id.setdefault(part_id, _host_buffers())
            buffers = CaptureBuffers(host, overlap, self._tracking(part_id))
            try:
                captured[part_id] = (part, part.capture(buffers))
            except BaseException:
                for snap in snapshots + buffers.snapshots:  # no copy outlives the failed save
                    with contextlib.suppress(BaseException):
                        snap.wait_host()
                raise
            snapshots += buffers.snapshots
            host.keep_only(buffers.names)  # e.g. made ahead for what this save did not copy
            hints.update(buffers.hints)
            if buffers.watched:
                watched[part_id] = buffers.watched
        out = CapturedParts(captured, described, snapshots)
        out.hints, out.watched = hints, watched
        return out

    def _tracking(self, part_id: str) -> PartTracker | None:
        """The part's tracker, with ``incremental=True``."""
        if not self._track:
            return None
        from .unchanged import PartTracker

        return self._trackers.setdefault(part_id, PartTracker())

    def forget(self) -> None:
        """After a restore: nothing is known unchanged any more (the restore wrote the live
        tensors, perhaps in ways no version counter sees)."""
        self._trackers.clear()

    def committed(self, captured: CapturedParts, keys: Mapping[Sig, str]) -> None:
        """The save of ``captured`` committed, storing the host copies ``keys`` names as blobs:
        each part's tracker remembers its unchanged tensors."""
        for part_id, tracker in self._trackers.items():
            tracker.record(captured.watched.get(part_id, {}), keys)

    def allocate_ahead(self, parts: Mapping[str, FilePart]) -> None:
        """Training thread, once before the first save: start allocating each part's host
        buffers in a helper thread, from what :meth:`FilePart.host_tensors` says."""
        for part_id, part in parts.items():
            try:
                tensors = dict(part.host_tensors())
            except Exception as e:  # the save itself reports what is wrong with the part
                log.debug("not allocating host buffers ahead for part %r: %r", part_id, e)
                continue
            if tensors:
                self._by_id.setdefault(part_id, _host_buffers()).allocate_in_background(tensors)

    def wait_allocated(self) -> None:
        """Wait for the allocations :meth:`allocate_ahead` started."""
        for buffers in self._by_id.values():
            buffers.wait_allocated()


def _host_buffers() -> HostBuffers:
    from .snapshot import HostBuffers

    return HostBuffers()
