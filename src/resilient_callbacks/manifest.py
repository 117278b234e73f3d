"""The manifest: the commit point and the table of contents of one checkpoint.

A checkpoint exists only once ``manifest.json`` is in place; it is written last. It lists every
file with size and xxh3-64 checksum, and records step, metrics, time, world size, the run the
checkpoint belongs to and the versions that wrote it. File names in a manifest are validated:
a manifest naming anything outside its own directory is rejected.

The manifest carries a checksum of itself (``manifest_xxh3_64``: xxh3-64 of the rest of it in a
canonical JSON form), so a damaged manifest that still parses -- a flipped digit of its step or
commit number, of a metric or of a file's size -- is refused rather than believed. A manifest
without one (written before it existed) is read as before, but its step must be the one its
directory is named after (``step_<step>``): a damaged digit of it made a restore resume from
another step's state, silently.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from . import branches
from .checksum import is_segmented
from .errors import CheckpointCorruptError, UnsafeManifestError
from .filewrite import FileDigest

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "resilient_callbacks.checkpoint"
FORMAT_VERSION = 3  # the newest this library reads; it writes the oldest its features allow
SELF_CHECKSUM = "manifest_xxh3_64"
NEWER_FORMAT = "is newer than this library understands"  # in the refusal: never "corrupt" to gc
# version 2: "blobs" (tensors shared with other checkpoints, incremental=True) and a "codec" on
# compressed files. Version 3: segmented checksums ("seg26:...", checksum.py), which files
# larger than one segment get. A checkpoint using none of these is written as version 1,
# readable by every version of the library.
BLOB_KIND = "blob"
# <xxh3-128>.safetensors, or compressed <xxh3-128>.z[s]<level>.safetensors.zst (s: shuffled):
# one name per stored byte sequence, so a blob is never replaced by other bytes of its name
# a checkpoint's directory name (step_<step>, -<n> for another commit of one step; -r<n> on a
# remote store: beside an unreadable one)
_STEP_NAME_RE = re.compile(r"^step_(\d+)(?:-\d+)?(?:-r\d+)?$")
BLOB_NAME_RE = re.compile(r"^[0-9a-f]{32}(\.zs?-?[0-9]{1,2}\.safetensors\.zst|\.safetensors)$")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint directory, '/'-separated
    size: int
    xxh3_64: str
    rank: int = 0
    kind: str = "tensors"  # "tensors" | "structure" | "blob" (in Manifest.blobs)
    codec: str = ""  # "" (stored as is) | "zstd" | "zstd+shuffle" (see compression.py)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.codec:
            del d["codec"]  # version 1 entries stay as they were
        return d

    @property
    def digest(self) -> FileDigest:
        return FileDigest(self.size, self.xxh3_64)


@dataclass
class Manifest:
    step: int
    run_id: str
    seq: int  # commit sequence number within the directory; higher = committed later
    world_size: int
    files: list[FileEntry]
    metrics: dict[str, float | None] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    reason: str = "periodic"  # periodic | final | forced | emergency | close
    fingerprint: str = ""
    retention: dict[str, Any] = field(default_factory=dict)
    # what the remote tier keeps (RetentionPolicy.to_json), for `gc --remote`; {}: no remote
    remote_retention: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # blobs of the run's store this checkpoint refers to (incremental=True); their ``path`` is
    # the blob's name, resolved by blobs.blob_path. Writers may pass them in ``files`` with
    # kind "blob": they are moved here.
    blobs: list[FileEntry] = field(default_factory=list)
    # the checkpoint it descends from and the commits of its run it does not (branches.py);
    # {}: none recorded (written before the field existed): commit order
    lineage: dict[str, Any] = field(default_factory=dict)
    # read from a manifest that carries its checksum of itself (SELF_CHECKSUM): written on or
    # after 2026-11-25, by a version that records ``remote_retention`` whenever its run has a
    # remote tier (an older one, with a remote tier, recorded only the local tier's policy).
    # Not a field of the JSON: it says which writer wrote it
    sealed: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if any(f.kind == BLOB_KIND for f in self.files):
            seen = {b.path for b in self.blobs}
            for f in self.files:
                if f.kind == BLOB_KIND and f.path not in seen:
                    self.blobs.append(f)
                    seen.add(f.path)
            self.files = [f for f in self.files if f.kind != BLOB_KIND]

    @property
    def total_bytes(self) -> int:
        """Bytes of the checkpoint's own files (the blobs it shares are not counted)."""
        return sum(f.size for f in self.files)

    @property
    def blob_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    @property
    def format_version(self) -> int:
        if any(is_segmented(f.xxh3_64) for f in (*self.files, *self.blobs)):
            return 3
        return 2 if self.blobs or any(f.codec for f in self.files) else 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["sealed"]
        d["files"] = [f.to_json() for f in self.files]
        if self.blobs:
            d["blobs"] = [b.to_json() for b in self.blobs]
        else:
            del d["blobs"]
        if not self.remote_retention:
            del d["remote_retention"]
        if not self.lineage:
            del d["lineage"]
        d["format"] = FORMAT_NAME
        d["format_version"] = self.format_version
        d["created_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        d[SELF_CHECKSUM] = self_checksum(json.loads(json.dumps(d, allow_nan=False)))
        return d

    @classmethod
    def from_json(
        cls, d: dict[str, Any], where: str = "manifest", dir_name: str | None = None
    ) -> Manifest:
        """The manifest ``d`` (parsed JSON) of the checkpoint named ``dir_name`` (where known),
        or :class:`CheckpointCorruptError` saying what is wrong with it."""
        if d.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{where}: not a resilient_callbacks manifest")
        try:
            version = int(d.get("format_version", 0))
        except (TypeError, ValueError, OverflowError):
            raise CheckpointCorruptError(
                f"{where}: malformed manifest (format_version={d.get('format_version')!r})"
            ) from None
        if version > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{where}: format version {d['format_version']} {NEWER_FORMAT} "
                f"({FORMAT_VERSION}); upgrade resilient-callbacks to read it"
            )
        try:
            files = [_entry(f) for f in d["files"]]
            for f in files:
                check_relative(f.path, where)
            blobs = [_entry(b) for b in d.get("blobs") or []]
            for b in blobs:
                check_blob_name(b.path, where)
            m = cls(
                step=int(d["step"]),
                run_id=str(d["run_id"]),
                seq=int(d["seq"]),
                world_size=int(d["world_size"]),
                files=files,
                metrics=dict(d.get("metrics") or {}),
                created=_finite(float(d.get("created", 0.0))),
                reason=str(d.get("reason", "periodic")),
                fingerprint=str(d.get("fingerprint", "")),
                retention=dict(d.get("retention") or {}),
                remote_retention=dict(d.get("remote_retention") or {}),
                versions=dict(d.get("versions") or {}),
                extra=dict(d.get("extra") or {}),
                blobs=blobs,
                lineage=dict(d.get("lineage") or {}),
                sealed=SELF_CHECKSUM in d,
            )
            branches.of(m.lineage)  # a malformed one makes the checkpoint corrupt
        except UnsafeManifestError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            raise CheckpointCorruptError(
                f"{where}: malformed manifest ({type(e).__name__}: {e})"
            ) from None
        _check_self(d, where)
        if SELF_CHECKSUM not in d and dir_name is not None:
            _check_named_step(m.step, dir_name, where)
        return m


def self_checksum(d: dict[str, Any]) -> str:
    """The checksum of manifest ``d`` as parsed from JSON (its own checksum left out)."""
    rest = {k: v for k, v in d.items() if k != SELF_CHECKSUM}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_64_hexdigest(canonical.encode("ascii"))


def _check_self(d: dict[str, Any], where: str) -> None:
    claimed = d.get(SELF_CHECKSUM)
    if claimed is None:
        return  # written before manifests carried one
    got = self_checksum(d)
    if claimed != got:
        raise CheckpointCorruptError(
            f"{where}: the manifest's own checksum does not match ({SELF_CHECKSUM} {claimed!r}, "
            f"its content hashes to {got!r}): it was changed or damaged after it was written"
        )


def _check_named_step(step: int, dir_name: str, where: str) -> None:
    """A manifest without its own checksum (an older writer's): its step must be the one its
    checkpoint's directory ``dir_name`` is named after (no check for a name of another form,
    a copy named by hand). Its other values cannot be checked."""
    named = _STEP_NAME_RE.match(dir_name)
    if named is not None and int(named.group(1)) != step:
        raise CheckpointCorruptError(
            f"{where}: the manifest says step {step}, but its checkpoint is named {dir_name}: "
            "it was damaged after it was written (it was written by an older version, without "
            "the checksum of itself that would tell more); a checkpoint of another step is used"
        )


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"{x} is not a time")
    return x


def _entry(f: Any) -> FileEntry:
    """A file entry of a manifest, its fields of the right types (a TypeError otherwise)."""
    e = FileEntry(**f)
    if not (
        isinstance(e.path, str)
        and type(e.size) is int
        and e.size >= 0
        and isinstance(e.xxh3_64, str)
        and type(e.rank) is int
        and isinstance(e.kind, str)
        and isinstance(e.codec, str)
    ):
        raise TypeError(f"file entry {f!r:.200}: a field of the wrong type")
    return e


def check_relative(name: str, where: str = "manifest") -> None:
    """Reject names that could escape the checkpoint directory."""
    if (
        not name
        or name.startswith(("/", "\\"))
        or (len(name) > 1 and name[1] == ":")
        or "\\" in name
        or "\x00" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise UnsafeManifestError(
            f"{where}: names the file {name!r}, which is outside its checkpoint directory; "
            "refusing to read or delete it (the manifest was tampered with or is corrupt)"
        )


def check_blob_name(name: str, where: str = "manifest") -> None:
    """Reject a blob reference that is not a plain blob name (nothing outside the store)."""
    if not BLOB_NAME_RE.match(name):
        raise UnsafeManifestError(
            f"{where}: names the blob {name!r}, which is not a blob name (32 hex digits + "
            "'.safetensors' or '.z<level>.safetensors.zst'); refusing to read or delete it (tampered or corrupt manifest)"
        )


def read_manifest(ckpt_dir: str) -> Manifest:
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path}: manifest is not a JSON object")
    return Manifest.from_json(data, path, os.path.basename(os.path.normpath(ckpt_dir)))


def versions() -> dict[str, str]:
    import torch

    from ._version import __version__

    return {
        "resilient_callbacks": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
