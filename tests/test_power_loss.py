"""Durability under power loss (or a kernel crash), not only under SIGKILL.

After a power loss, bytes written but not fsynced may be lost, and a create, rename or unlink
whose directory was not fsynced since may be undone, or kept, in any order. These tests record
every filesystem operation of a short run (:mod:`fs_journal`: fsync, rename, replace, unlink,
mkdir, open for writing), check the orderings a checkpoint needs, then rebuild the worst cases
a power loss after each operation may leave and check each one:

- no folder named like a checkpoint holds a manifest whose files are missing or damaged (a torn
  checkpoint is never visible);
- the newest valid checkpoint is not older than the newest one whose commit had returned, and
  at least ``min(keep_last, commits returned)`` checkpoints are valid (retention deleted nothing
  before the newer commit was durable);
- the advisory ``latest`` pointer, where there is one, names a checkpoint that is there.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from fs_journal import Journal
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.catalog import Depth, Status
from resilient_callbacks.commit import RenameCommit
from resilient_callbacks.filepart import CaptureBuffers, FilePart, PartInfo, PartReader, PartWriter
from resilient_callbacks.manifest import read_manifest

KEEP_LAST = 2
STEPS = (1, 2, 3, 4)


class Shards(FilePart):
    """A part that owns its files (as DeepSpeed's partitions, DCP's shards): they live in a
    subfolder of the checkpoint, ``parts/<id>/``."""

    def __init__(self) -> None:
        self.weight = torch.zeros(8192)  # 32 KiB: a blob with incremental=True

    def capture(self, buffers: CaptureBuffers) -> dict[str, Any]:
        buf = buffers.get("weight", self.weight)
        buf.copy_(self.weight)
        return {"weight": buf}

    def write(self, captured: dict[str, Any], writer: PartWriter) -> None:
        writer.tensors("shard.safetensors", {"weight": captured["weight"]})
        writer.json("meta.json", {"n": 8192})

    def files_to_read(self, info: PartInfo) -> list[str]:
        return ["shard.safetensors", "meta.json"]

    def load(self, reader: PartReader) -> None:
        self.weight.copy_(reader.tensors("shard.safetensors")["weight"])


def _run(tmp_path, monkeypatch, **options: Any) -> tuple[Journal, str]:
    """Save STEPS with keep_last=2 while recording; return the journal and the run's dir."""
    torch.manual_seed(0)
    frozen = nn.Linear(128, 64)  # 32 KiB of weights: a blob, unchanged from save to save
    head = nn.Linear(64, 4)
    parts = Shards()
    state = {"frozen": frozen, "head": head, "engine": {"shards": parts}, "step": 0}
    tmp_path.mkdir()
    journal = Journal(str(tmp_path))
    real_commit = RenameCommit.commit

    def commit(self: RenameCommit, staging: str, step: int, manifest: bytes, **kw: Any) -> str:
        final = real_commit(self, staging, step, manifest, **kw)
        journal.mark("committed", step)  # the save's commit returned: it must be durable
        return final

    monkeypatch.setattr(RenameCommit, "commit", commit)
    run = str(tmp_path / "run")
    with journal.recording():
        ck = Checkpointer(run, keep_last=KEEP_LAST, preemption=False, **options)
        with ck:
            for step in STEPS:
                with torch.no_grad():
                    head.weight.add_(1.0)
                    parts.weight.add_(1.0)
                state["step"] = step
                assert ck.save(step, state)
    return journal, run


def _check_state(path: str, durable: list[int], where: str) -> None:
    run = os.path.join(path, "run")
    entries = catalog.scan(run, Depth.FULL) if os.path.isdir(run) else []
    torn = [f"{e.name}: {e.problem}" for e in entries if e.status is Status.CORRUPT]
    assert not torn, f"{where}: a torn checkpoint is visible: {torn}"
    valid = sorted(e.step for e in entries if e.status is Status.VALID and e.step is not None)
    if durable:
        assert valid and valid[-1] >= durable[-1], (
            f"{where}: the checkpoint of step {durable[-1]} was committed (its commit had "
            f"returned), but after the power loss the newest valid one is "
            f"{valid[-1] if valid else None}"
        )
        want = min(KEEP_LAST, len(durable))
        assert len(valid) >= want, (
            f"{where}: only {valid} valid after the power loss; {want} expected (keep_last="
            f"{KEEP_LAST}, commits returned: {durable})"
        )
    latest = os.path.join(run, "latest")
    if os.path.isfile(latest) and os.path.getsize(latest):
        with open(latest) as f:
            name = f.read().strip()
        assert os.path.isdir(os.path.join(run, name)), f"{where}: latest names {name}, gone"


def _check_published(journal: Journal) -> int:
    """Every file and folder of a staging directory is durable (the file fsynced after its
    last write, the folder after its last change) before the rename that publishes it."""
    ops = journal.ops
    n = 0
    for i, op in enumerate(ops):
        if op.kind != "rename" or ".staging-" not in os.path.basename(op.path):
            continue
        n += 1
        inside = op.path + "/"
        last_write: dict[str, int] = {}
        last_change: dict[str, int] = {}
        for j, o in enumerate(ops[:i]):
            for path in (o.path, o.dest):
                if not path.startswith(inside) and path != op.path:
                    continue
                if o.kind == "write":
                    last_write[path] = j
                if o.kind in ("write", "mkdir", "unlink", "rmdir", "rename", "replace"):
                    last_change[os.path.dirname(path)] = j
                if o.kind == "rmdir":
                    last_change.pop(path, None)
        for what, last in (("file", last_write), ("folder", last_change)):
            for path, j in last.items():
                if path.startswith(inside) or path == op.path:
                    fsynced = any((o.kind, o.path) == ("fsync", path) for o in ops[j + 1 : i])
                    assert fsynced, f"{what} {path} is not durable before {op.dest} is published"
    return n


def _check_orderings(journal: Journal) -> None:
    """The publishing renames and the deletions, in the order the log recorded them."""
    ops = journal.ops
    for i, op in enumerate(ops):
        if op.kind != "rename" or not op.path.startswith("run/.staging-"):
            continue
        later = [o for o in ops[i + 1 :] if o.kind == "fsync" and o.path == "run"]
        assert later, f"the rename that published {op.dest} is never made durable"
        j = ops.index(later[0], i + 1)
        between = [o for o in ops[i + 1 : j] if o.kind in ("unlink", "rmdir", "rename")]
        assert not between, (
            f"{between[0].kind} {between[0].path} before the publishing rename of {op.dest} "
            "was durable"
        )
    publish = [i for i, op in enumerate(ops) if op.kind == "rename" and ".staging-" in op.path]
    for i, op in enumerate(ops):
        if op.kind == "replace" and op.dest.startswith("run/blobs/"):  # a blob into the store
            nxt = next((j for j in publish if j > i), None)
            synced = any((o.kind, o.path) == ("fsync", "run/blobs") for o in ops[i + 1 : nxt])
            assert synced, f"blob {op.dest} is not durable before the next checkpoint is published"
        if op.kind == "replace" and op.dest == "run/latest":
            trashed = [o for o in ops[i + 1 :] if "/.trash-" in o.dest]
            first = ops.index(trashed[0], i + 1) if trashed else len(ops)
            synced = any((o.kind, o.path) == ("fsync", "run") for o in ops[i + 1 : first])
            assert synced, "`latest` was replaced and not made durable before retention deleted"
    for i, op in enumerate(ops):
        if op.kind == "mkdir" and ".staging-" not in op.path:  # run/, run/blobs/
            parent = os.path.dirname(op.path)
            nxt = next((j for j in publish if j > i), len(ops))
            synced = any((o.kind, o.path) == ("fsync", parent) for o in ops[i + 1 : nxt])
            assert synced, f"{op.path} was created and its parent not fsynced before a commit"
    for i, op in enumerate(ops):
        if op.kind != "rename" or "/.trash-" not in op.dest:
            continue
        gone = next((j for j in range(i + 1, len(ops)) if ops[j].kind in ("unlink", "rmdir")), None)
        synced = any((o.kind, o.path) == ("fsync", "run") for o in ops[i + 1 : gone])
        assert gone is None or synced, (
            f"{op.path} was moved to the trash, then {ops[gone].kind} {ops[gone].path} before "
            "the directory was fsynced: a power loss could bring back a torn checkpoint"
        )


def _crash_everywhere(journal: Journal, scratch: str) -> int:
    seen: dict[int, set[Any]] = {}  # (a state fine before a commit returned is not after)
    checked = 0
    durable: list[int] = []
    for i, op in enumerate(journal.ops):
        for mark in journal.marks.get(i, []):
            if mark[0] == "committed":
                durable.append(mark[1])
        if op.kind in ("write",):  # nothing durable changes with a write alone
            continue
        for state in journal.crash_states(i, scratch, seen.setdefault(len(durable), set())):
            _check_state(state, list(durable), f"power loss after op {i} ({op})")
            checked += 1
    return checked


@pytest.mark.parametrize(
    "options",
    [
        {"async_save": True, "incremental": True},
        pytest.param({"async_save": False}, marks=pytest.mark.slow),
        pytest.param(
            {"async_save": False, "incremental": True, "compression": "zstd"},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["async-incremental", "sync", "sync-incremental-zstd"],
)
def test_power_loss_leaves_a_checkpoint_no_older_than_the_last_commit(
    tmp_path, monkeypatch, options
):
    journal, _ = _run(tmp_path / "w", monkeypatch, **options)
    assert _check_published(journal) == len(STEPS)
    _check_orderings(journal)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # (thousands of small files)
    with tempfile.TemporaryDirectory(dir=shm) as scratch:
        checked = _crash_everywhere(journal, os.path.join(scratch, "crash"))
    assert checked > len(STEPS)


def test_a_checkpoint_downloaded_from_the_remote_is_durable_before_it_is_published(
    tmp_path, monkeypatch
):
    """Restoring from the remote tier into an empty dirpath downloads the checkpoint into a
    staging directory and renames it into place: its manifest and its folders (``parts/``)
    are fsynced first, or a power loss right after leaves a torn checkpoint."""
    remote = str(tmp_path / "remote")
    _run(tmp_path / "w", monkeypatch, async_save=False, remote=remote)
    journal = Journal(str(tmp_path / "w"))
    parts = Shards()
    state = {"frozen": nn.Linear(128, 64), "head": nn.Linear(64, 4), "engine": {"shards": parts}}
    state["step"] = 0
    fresh = tmp_path / "w" / "fresh"
    with journal.recording(), Checkpointer(fresh, remote=remote, preemption=False) as ck:
        assert ck.restore(state) == STEPS[-1]
    assert parts.weight[0].item() == len(STEPS)
    assert _check_published(journal) >= 1


def test_retention_deletes_nothing_while_the_trash_rename_is_not_durable(tmp_path, monkeypatch):
    """When the directory cannot be fsynced after retention renamed a checkpoint to the trash,
    neither its files nor the blobs only it named are deleted: after a power loss the rename
    may be undone, and the checkpoint must then be whole. The next writer's sweep deletes it."""
    import errno

    import resilient_callbacks.commit as rc_commit

    root = tmp_path / "run"
    frozen = nn.Linear(128, 64)
    with Checkpointer(root, keep_last=1, incremental=True, async_save=False) as ck:
        assert ck.save(1, {"frozen": frozen, "w": torch.ones(8192)})
        real = rc_commit.fsync_dir

        def fsync_dir(path: str) -> None:
            if os.path.samefile(path, root):
                raise OSError(errno.EIO, "Input/output error")
            real(path)

        monkeypatch.setattr(rc_commit, "fsync_dir", fsync_dir)
        assert ck.save(2, {"frozen": frozen, "w": torch.zeros(8192)})
        monkeypatch.setattr(rc_commit, "fsync_dir", real)
    trashed = [n for n in os.listdir(root) if n.startswith(".trash-step_000000001")]
    assert len(trashed) == 1, os.listdir(root)
    m = read_manifest(str(root / trashed[0]))
    catalog.verify(str(root / trashed[0]), m, Depth.FULL)  # whole, its blobs too
    assert [e.step for e in catalog.scan(str(root)) if e.status is Status.VALID] == [2]


def test_an_export_is_durable_before_it_replaces_the_previous_one(tmp_path):
    """``export_weights`` over an existing export: the new files and folder are fsynced before
    the rename, and the parent after it, before the old export is deleted; else a power loss
    can leave neither the old export nor a whole new one."""
    from resilient_callbacks.consolidate import export_weights

    run = tmp_path / "w" / "run"
    with Checkpointer(run, async_save=False, preemption=False) as ck:
        ck.save(1, {"model": nn.Linear(8, 4)})
        path = ck.checkpoints()[-1].path
    out = str(tmp_path / "w" / "export")
    weights = {"w": torch.ones(64)}
    export_weights(path, out, weights=weights)
    journal = Journal(str(tmp_path / "w"))
    with journal.recording():
        export_weights(path, out, overwrite=True, weights=weights)
    ops = journal.ops
    publish = next(i for i, o in enumerate(ops) if o.kind == "rename" and o.dest == "export")
    staged = ops[publish].path
    synced = {o.path for o in ops[:publish] if o.kind == "fsync"}
    for name in ("model.safetensors", "export.json", ""):
        assert os.path.join(staged, name).rstrip("/") in synced, f"{name or staged} not fsynced"
    gone = next(i for i, o in enumerate(ops) if o.kind == "unlink" and ".export.old-" in o.path)
    assert ("fsync", "") in [(o.kind, o.path) for o in ops[publish:gone]], (
        "the old export was deleted before the rename of the new one was durable"
    )


def test_a_dcp_save_through_our_storage_writer_survives_a_power_loss(tmp_path):
    """``dcp.save(..., storage_writer=ResilientStorageWriter(...))`` puts each rank's files in
    ``dcp/``: that folder is fsynced before the commit's rename too."""
    import torch.distributed.checkpoint as dcp

    from resilient_callbacks.dcp import ResilientStorageWriter

    (tmp_path / "w").mkdir()
    journal = Journal(str(tmp_path / "w"))
    model = nn.Linear(64, 32)
    real_commit = RenameCommit.commit

    def commit(self: RenameCommit, staging: str, step: int, manifest: bytes, **kw: Any) -> str:
        final = real_commit(self, staging, step, manifest, **kw)
        journal.mark("committed", step)
        return final

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RenameCommit, "commit", commit)
        with journal.recording(), ResilientStorageWriter(tmp_path / "w" / "run") as writer:
            for step in STEPS:
                with torch.no_grad():
                    model.weight.add_(1.0)
                writer.step = step
                dcp.save({"model": model.state_dict()}, storage_writer=writer)
    assert _check_published(journal) == len(STEPS)
    assert any(o.path.endswith("/dcp") and o.is_dir for o in journal.ops if o.kind == "fsync")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as scratch:
        assert _crash_everywhere(journal, os.path.join(scratch, "crash")) > len(STEPS)


def test_a_run_directory_created_in_a_parent_one_may_not_read_opens(tmp_path, monkeypatch, caplog):
    """A parent directory one may write in but not read (mode -wx, a drop-box folder): the new
    run directory's parent could not be opened to fsync it, and the Checkpointer refused to
    open with PermissionError where ``os.makedirs`` alone had worked. It opens now, with a
    warning that says how to have the parent synced."""
    import errno

    import resilient_callbacks.commit as rc_commit

    parent = tmp_path / "dropbox"
    parent.mkdir()
    real_open = os.open

    def open_(path, flags, *a, **kw):  # (as for a user other than root: read permission)
        if os.path.isdir(path) and os.path.samefile(path, parent):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(rc_commit.os, "open", open_)
    caplog.set_level("WARNING", logger="resilient_callbacks")
    with Checkpointer(parent / "run", async_save=False) as ck:
        assert ck.save(1, {"w": torch.ones(4)})
    monkeypatch.undo()
    assert "make the parent readable" in caplog.text
    assert [e.step for e in catalog.scan(str(parent / "run")) if e.status is Status.VALID] == [1]


def test_an_export_into_a_new_folder_is_durable_with_its_folder(tmp_path):
    """``export_weights`` into a folder that does not exist yet (``exports/v1``): the export
    was fsynced and renamed into place, but the new ``exports`` folder's own name was never
    fsynced into its parent, so a power loss after the export returned could take the folder,
    and the export with it, away."""
    from resilient_callbacks.consolidate import export_weights

    run = tmp_path / "w" / "run"
    with Checkpointer(run, async_save=False, preemption=False) as ck:
        ck.save(1, {"model": nn.Linear(8, 4)})
        path = ck.checkpoints()[-1].path
    journal = Journal(str(tmp_path / "w"))
    with journal.recording():
        export_weights(path, str(tmp_path / "w" / "exports" / "v1"), weights={"w": torch.ones(8)})
    ops = journal.ops
    made = next(i for i, o in enumerate(ops) if o.kind == "mkdir" and o.path == "exports")
    assert ("fsync", "") in [(o.kind, o.path) for o in ops[made:]], (
        "the new exports/ folder's name was never made durable"
    )
