"""CommitStrategy, one protocol with two implementations: ``RenameCommit`` (a POSIX directory:
staging directory, manifest, fsync, rename) and ``ManifestLastCommit`` (an object store: files
under the final name, manifest last). The same contract holds for both, on a local directory, a
real S3 API server (moto) and a ``file://`` remote: nothing is visible before ``commit``; after
it, the checkpoint with every listed file; a manifest listing a file that is not there raises
and leaves nothing visible; ``abort`` leaves nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import xxhash

from resilient_callbacks import catalog
from resilient_callbacks.commit import CommitStrategy, RenameCommit
from resilient_callbacks.errors import CheckpointWriteError
from resilient_callbacks.filewrite import encode_json
from resilient_callbacks.manifest import FileEntry, Manifest
from resilient_callbacks.remote import ManifestLastCommit, RemoteStore

PAYLOAD = {"a.bin": b"a" * 1000, "sub/b.bin": os.urandom(3000)}


def _manifest(files: dict[str, bytes]) -> bytes:
    entries = [
        FileEntry(name, len(data), xxhash.xxh3_64_hexdigest(data), 0)
        for name, data in files.items()
    ]
    m = Manifest(step=7, run_id="r1", seq=1, world_size=1, files=entries)
    return encode_json(m.to_json())


class Posix:
    def __init__(self, tmp_path: Path, _remote: Any) -> None:
        self.root = str(tmp_path / "ck")
        os.makedirs(self.root)
        self.strategy: CommitStrategy = RenameCommit(self.root)

    def put(self, staging: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(staging, name)), exist_ok=True)
            Path(staging, name).write_bytes(data)

    def visible(self) -> list[str]:
        return [e.name for e in catalog.committed(catalog.scan(self.root, catalog.Depth.FULL))]

    def leftovers(self) -> list[str]:
        return sorted(os.listdir(self.root))


class ObjectStore:
    def __init__(self, tmp_path: Path, remote: tuple[str, dict[str, Any]]) -> None:
        url, options = remote
        self.store = RemoteStore(url, options)
        self.local = tmp_path / "local"
        self.strategy = ManifestLastCommit(self.store, "step_000000007", str(self.local))

    def put(self, staging: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            (self.local / name).parent.mkdir(parents=True, exist_ok=True)
            (self.local / name).write_bytes(data)
            if self.store.is_local:
                self.store.fs.makedirs(
                    os.path.dirname(self.store._path(staging, name)), exist_ok=True
                )
            self.store.fs.put_file(str(self.local / name), self.store._path(staging, name))

    def visible(self) -> list[str]:
        return [e.name for e in self.store.scan() if e.committed]

    def leftovers(self) -> list[str]:
        return sorted(e.name for e in self.store.scan())


@pytest.fixture(params=["posix", "s3", "file"])
def tier(request, tmp_path):
    if request.param == "posix":
        return Posix(tmp_path, None)
    if request.param == "s3":
        return ObjectStore(tmp_path, request.getfixturevalue("s3_remote"))
    return ObjectStore(tmp_path, (f"file://{tmp_path / 'remote'}", {}))


def test_nothing_is_visible_before_commit_and_everything_after(tier):
    staging = tier.strategy.begin(7)
    tier.put(staging, PAYLOAD)
    assert tier.visible() == []
    where = tier.strategy.commit(staging, 7, _manifest(PAYLOAD))
    assert tier.visible() == ["step_000000007"]
    assert where.rstrip("/").endswith("step_000000007")


def test_a_manifest_listing_a_file_that_is_not_there_commits_nothing(tier):
    staging = tier.strategy.begin(7)
    tier.put(staging, {"a.bin": PAYLOAD["a.bin"]})
    with pytest.raises((CheckpointWriteError, OSError), match=r"sub/b\.bin"):
        tier.strategy.commit(staging, 7, _manifest(PAYLOAD))
    assert tier.visible() == []
    tier.strategy.abort(staging)
    assert tier.visible() == [] and tier.leftovers() == []


def test_abort_leaves_nothing(tier):
    staging = tier.strategy.begin(7)
    tier.put(staging, PAYLOAD)
    tier.strategy.abort(staging)
    assert tier.visible() == [] and tier.leftovers() == []
