"""Node-local mode resuming incremental checkpoints (docs/multinode.md): a run with a shared
``dirpath`` and ``incremental=True`` uploads checkpoints whose tensors are in the remote blob
store; the run then grows to two "nodes", each with a directory of its own (``<base>/node<N>``,
the remote a ``file://`` directory), where ``incremental`` is refused. Each node fetches the
blobs with its files, restores exactly, and its retention deletes them once no checkpoint on
its disk names them. (Before, every remote copy was skipped as "listed in the manifest but
missing" and the restart failed with NoValidCheckpointError though the remote was whole.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading

import pytest

import spawn_ranks
from resilient_callbacks.remote import RemoteStore

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _outs(ranks) -> list[dict]:
    return [
        json.loads(line[4:])
        for out in ranks.outputs
        for line in out.splitlines()
        if line.startswith("OUT ")
    ]


def test_node_local_nodes_restore_a_shared_runs_incremental_checkpoint_and_collect_its_blobs(
    tmp_path,
):
    zygote = spawn_ranks.shared_zygote()
    first = spawn_ranks.run(
        [sys.executable, __file__, str(tmp_path), "shared"], 1, tmp_path, "shared", zygote=zygote
    )
    (saved,) = _outs(first)
    remote = tmp_path / "remote"
    assert os.listdir(remote / "blobs"), "the shared run stored no blob: nothing is tested"
    second = spawn_ranks.run(
        [sys.executable, __file__, str(tmp_path), "nodes"], 2, tmp_path, "nodes", zygote=zygote
    )
    outs = _outs(second)
    assert [o["restored"] for o in outs] == [3, 3], outs
    assert [o["digest"] for o in outs] == [saved["digest"]] * 2  # exactly the state of step 3
    for node in ("node0", "node1"):
        names = sorted(os.listdir(tmp_path / node))
        assert [n for n in names if n.startswith("step_")] == ["step_000000005"], names
        left = [n for n in os.listdir(tmp_path / node / "blobs") if not n.startswith(".")]
        assert left == [], f"{node}: blobs no checkpoint names were kept: {left}"
    committed = sorted(n for n in os.listdir(remote) if n.startswith("step_"))
    assert committed == ["step_000000005"], committed  # (remote_keep_last: as keep_last, 1)
    left = [n for n in os.listdir(remote / "blobs") if not n.startswith(".")]
    assert left == [], f"remote blobs no remote checkpoint names were kept: {left}"


def test_a_downloaded_incremental_checkpoint_is_never_committed_again_without_its_blobs(
    tmp_path,
):
    """The nodes restore step 3 (the shared run's, on as many ranks) and stop before their
    first save; the remote loses the run. The restart took step 3 for an upload a stop cut
    off and committed it again, its manifest naming a blob the store lacked (a remote
    checkpoint corrupt from its commit). It stays local now; the new saves go up whole."""
    zygote = spawn_ranks.shared_zygote()
    argv = [sys.executable, __file__, str(tmp_path)]
    spawn_ranks.run([*argv, "shared"], 2, tmp_path, "shared", zygote=zygote)
    spawn_ranks.run([*argv, "nodes-stop"], 2, tmp_path, "stop", zygote=zygote)
    shutil.rmtree(tmp_path / "remote")
    outs = _outs(spawn_ranks.run([*argv, "nodes"], 2, tmp_path, "nodes", zygote=zygote))
    assert [o["restored"] for o in outs] == [3, 3], outs
    store = RemoteStore(f"file://{tmp_path}/remote")
    committed = {e.name: e.problem for e in store.scan() if e.manifest is not None}
    assert committed == {"step_000000005": None}, committed


def test_a_blob_download_that_stalls_is_given_up_naming_it(tmp_path):
    """The store lists the checkpoint and sends its files, never a blob's bytes: the node's
    restore gives up once no byte arrived for the (lowered) outage limit, naming the blobs'
    download, and the job fails rather than waiting or starting from scratch."""
    zygote = spawn_ranks.shared_zygote()
    spawn_ranks.run(
        [sys.executable, __file__, str(tmp_path), "shared"], 1, tmp_path, "shared", zygote=zygote
    )
    second = spawn_ranks.run(
        [sys.executable, __file__, str(tmp_path), "nodes"],
        2,
        tmp_path,
        "nodes",
        expect=4,
        env={"RC_BLOB_GETS_HANG": "1"},
        zygote=zygote,
    )
    for out in _outs(second):
        assert out["error"] == "NoValidCheckpointError", out
        assert "downloading the blobs of file://" in out["msg"], out["msg"]
        assert "no byte arrived" in out["msg"], out["msg"]


def test_each_node_fetches_only_the_blobs_its_ranks_read(tmp_path):
    """A shared run on 2 ranks whose FilePart stores a 64 KiB frozen tensor (a blob) on rank
    0 only; resumed on 2 nodes: node 1 fetched every blob the checkpoint names, though its
    rank reads none of them (after an outage each node downloaded the whole job's part
    blobs). Now each node fetches the blobs its own files name (shared.json's, its part
    files'), restores exactly, and a restart with the remote lost does not upload node 1's
    downloaded copy as one a stop cut off (its manifest now names no blob)."""
    zygote = spawn_ranks.shared_zygote()
    argv = [sys.executable, __file__, str(tmp_path)]
    first = _outs(spawn_ranks.run([*argv, "parts-shared"], 2, tmp_path, "shared", zygote=zygote))
    remote = tmp_path / "remote"
    stored = [n for n in os.listdir(remote / "blobs") if not n.startswith(".")]
    assert len(stored) == 1, stored  # rank 0's frozen tensor
    second = _outs(spawn_ranks.run([*argv, "parts-stop"], 2, tmp_path, "stop", zygote=zygote))
    assert [o["restored"] for o in second] == [3, 3], second
    assert [o["digest"] for o in second] == [o["digest"] for o in first]  # each rank's part
    assert [n for n in os.listdir(tmp_path / "node0" / "blobs") if n[0] != "."] == stored
    node1 = tmp_path / "node1" / "blobs"
    assert not node1.exists() or not [n for n in os.listdir(node1) if n[0] != "."]
    shutil.rmtree(remote)
    third = _outs(spawn_ranks.run([*argv, "parts-nodes"], 2, tmp_path, "nodes", zygote=zygote))
    assert [o["restored"] for o in third] == [3, 3], third
    assert sorted(n for n in os.listdir(remote) if n.startswith("step_")) == ["step_000000005"]


def test_a_rotten_shared_json_kept_from_a_cut_try_is_fetched_again_before_it_names_blobs(
    tmp_path,
):
    """A node's download is cut after shared.json arrived with its size but one character of
    its blob's name changed (a transfer of the cut try still writing it, a torn write): the
    next try kept it, the node read it for the blobs to fetch (none that the checkpoint names)
    and, once that file was fetched again after the checksum check, committed a copy whose
    blob it never fetched. Kept files are now checked before they are read for blob names:
    both nodes fetch the blob and restore step 3 exactly."""
    zygote = spawn_ranks.shared_zygote()
    argv = [sys.executable, __file__, str(tmp_path)]
    (saved,) = _outs(spawn_ranks.run([*argv, "shared"], 1, tmp_path, "shared", zygote=zygote))
    env = {"RC_SHARED_JSON_ROT": "1"}
    outs = _outs(spawn_ranks.run([*argv, "nodes"], 2, tmp_path, "nodes", env=env, zygote=zygote))
    assert [o["restored"] for o in outs] == [3, 3], outs
    assert [o["digest"] for o in outs] == [saved["digest"]] * 2


def _cut_with_a_rotten_shared_json(fs) -> None:
    """``fs.get``'s first call of several files brings shared.json alone, its size kept and
    one character of its first blob's name changed, then the connection is reset."""
    real_get, calls = fs.get, []

    def get(rpath, lpath, *args, **kw):
        if not isinstance(rpath, list) or calls:
            return real_get(rpath, lpath, *args, **kw)
        calls.append(rpath)
        i = next(i for i, r in enumerate(rpath) if r.endswith("/shared.json"))
        real_get(rpath[i], lpath[i])
        with open(lpath[i]) as f:
            doc = f.read()
        blob = next(iter(json.loads(doc)["blobs"].values()))
        other = ("0" if blob[0] != "0" else "1") + blob[1:]
        with open(lpath[i], "w") as f:
            f.write(doc.replace(blob, other))
        raise ConnectionResetError(104, "Connection reset by peer")

    fs.get = get


def _make_part(rank: int):
    """A FilePart: a 64 KiB frozen tensor on rank 0 only (a blob), a small one on every rank."""
    import torch

    from resilient_callbacks.filepart import FilePart

    class Part(FilePart):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(rank)
            self.t = {"small": torch.randn(16, generator=g)}
            if rank == 0:
                self.t["frozen"] = torch.randn(16 * 1024, generator=g)

        def capture(self, buffers):
            return buffers.copy(self.t)

        def write(self, captured, writer) -> None:
            writer.tensors(f"rank_{writer.rank:05d}.safetensors", captured)

        def files_to_read(self, info):
            return [f"rank_{info.rank:05d}.safetensors"]

        def load(self, reader) -> None:
            got = reader.tensors(f"rank_{reader.info.rank:05d}.safetensors")
            for name, live in self.t.items():
                live.copy_(got[name])

    return Part()


def _digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def worker(base: str, phase: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from resilient_callbacks import Checkpointer, checkpointer
    from resilient_callbacks.errors import NoValidCheckpointError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 4))  # a 32 KiB weight: a blob
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    state = {"model": model, "opt": opt}

    def step(n: int) -> None:
        torch.manual_seed(n)
        model(torch.randn(2, 128)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    remote = f"file://{base}/remote"
    if phase.startswith("parts-"):
        rank = dist.get_rank()
        part = _make_part(rank)
        state = {"model": nn.Linear(4, 4), "engine": part}  # (no replicated blob)
        shared = phase == "parts-shared"
        if not shared:
            for v in part.t.values():
                v.zero_()
        with Checkpointer(
            f"{base}/shared" if shared else f"{base}/node{rank}",
            incremental=shared,
            compression="zstd" if shared else "none",  # (node 1 reads a compressed header)
            remote=remote,
            keep_last=1,
            remote_timeout=5,
            async_save=False,
        ) as ck:
            got = 0 if shared else ck.restore(state)
            digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in part.t.values()))
            print("OUT " + json.dumps({"restored": got, "digest": digest.hexdigest()}))
            sys.stdout.flush()
            if phase == "parts-stop":
                os._exit(0)
            for n in (1, 2, 3) if shared else (4, 5):
                ck.save(n, state)
        dist.destroy_process_group()
        return
    if phase == "shared":  # one process, a dirpath of its own: not node-local
        with Checkpointer(
            f"{base}/shared", incremental=True, remote=remote, keep_last=1, async_save=False
        ) as ck:
            for n in (1, 2, 3):
                step(n)
                ck.save(n, state)
        print("OUT " + json.dumps({"digest": _digest(model)}), flush=True)
    else:
        rank = dist.get_rank()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with Checkpointer(
            f"{base}/node{rank}", remote=remote, keep_last=1, remote_timeout=5, async_save=False
        ) as ck:
            if os.environ.get("RC_BLOB_GETS_HANG"):  # files come, a blob's bytes never do
                checkpointer.CLOSE_OUTAGE_S = 1.0
                fs = ck._dir.remote.fs
                real_get = fs.get

                def get(src, *a, **k):
                    if "/blobs/" in str(src):
                        threading.Event().wait(20)
                        raise ConnectionError("the store never answered")
                    return real_get(src, *a, **k)

                fs.get = get
                try:
                    ck.restore(state)
                except NoValidCheckpointError as e:
                    print("OUT " + json.dumps({"error": type(e).__name__, "msg": str(e)}))
                    sys.stdout.flush()
                    os._exit(4)
            if os.environ.get("RC_SHARED_JSON_ROT"):  # see the test
                _cut_with_a_rotten_shared_json(ck._dir.remote.fs)
            got = ck.restore(state)
            print("OUT " + json.dumps({"restored": got, "digest": _digest(model)}), flush=True)
            if phase == "nodes-stop":  # killed before its first save
                sys.stdout.flush()
                os._exit(0)
            for n in (4, 5):
                step(n)
                ck.save(n, state)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
