"""Several nodes without a shared filesystem (docs/multinode.md), on one machine: two torchrun
launchers (``--nnodes=2 --node_rank=0/1``, a rendezvous on 127.0.0.1), each node with its own
checkpoint directory that the other cannot see, the remote tier on the moto S3 server.

Checked: a SIGKILL of both nodes resumes bit-exactly from the local copies without any download;
a wiped node fetches only its own ranks' files (and the replicated ``shared.*``) while the other
downloads nothing; with ``replicas=1`` a wiped node restores from its peer with its remote objects
deleted; random kills in every phase never leave a remote manifest naming a missing or wrong
object; detection and configuration errors."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient_callbacks.catalog import Depth, verify
from resilient_callbacks.remote import RemoteStore

SCRIPT = Path(__file__).with_name("train_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun launchers, one per simulated node."""

    def __init__(
        self, tmp: Path, remote: tuple[str, dict], tag: str = "", torchrun: bool = True
    ) -> None:
        self.tmp, (self.url, self.opts) = tmp, remote
        self.torchrun = torchrun
        self.dirs = [tmp / f"node{i}{tag}" / "ckpt" for i in range(2)]
        self.out = tmp / f"out{tag}"
        self.out.mkdir(exist_ok=True)
        self.runs = 0

    def start(self, total: int, *extra: str, sleep: float = 0.0) -> list[subprocess.Popen]:
        port = _free_port()
        self.runs += 1
        procs = []
        for i in range(2):
            env = dict(
                os.environ,
                PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="lo",
                PYTHONHASHSEED="0",
                TORCHELASTIC_ERROR_FILE="",
            )
            launcher = [
                str(TORCHRUN),
                "--nnodes=2",
                f"--node_rank={i}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "--max_restarts=0",
            ]
            if not self.torchrun:  # the processes torchrun would start, without the launcher
                launcher = [sys.executable]
                env.update(
                    RANK=str(i),
                    LOCAL_RANK="0",
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            argv = [
                *launcher,
                str(SCRIPT),
                str(self.dirs[i]),
                "--distributed",
                "--total-steps",
                str(total),
                "--every-n-steps",
                "2",
                "--keep-last",
                "2",
                "--remote",
                self.url,
                "--remote-options",
                json.dumps(self.opts),
                "--out-jsonl",
                str(self.out / "losses.jsonl"),
                "--out-params",
                str(self.out / "params.st"),
                "--sleep",
                str(sleep),
                *extra,
            ]
            log = open(self.out / f"run{self.runs}.node{i}.log", "w")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            log.close()
        return procs

    def logs(self) -> list[str]:
        return [(self.out / f"run{self.runs}.node{i}.log").read_text() for i in range(2)]

    def run(self, total: int, *extra: str, timeout: float = 120) -> list[dict]:
        procs = self.start(total, *extra)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        failed = [p.poll() for p in procs]
        if failed != [0, 0]:
            for p in procs:
                _kill(p)
            raise AssertionError(f"nodes failed ({failed}):\n" + "\n".join(self.logs()))
        return self.restores()

    def restores(self) -> list[dict]:
        out = []
        for text in self.logs():
            for line in text.splitlines():
                if line.startswith("RESTORE "):
                    out.append(json.loads(line[len("RESTORE ") :]))
        return sorted(out, key=lambda r: r["rank"])

    def losses(self, rank: int) -> dict[int, str]:
        out: dict[int, str] = {}
        path = self.out / f"losses.jsonl.rank{rank}"
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]  # a resumed step overwrites the killed run's
        return out

    def params(self, rank: int) -> bytes:
        return (self.out / f"params.st.rank{rank}").read_bytes()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher and every worker at once."""
    for pid in [*_descendants(p.pid), p.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait()


def _last_step(nodes: Nodes) -> int:
    try:
        return max(nodes.losses(0), default=0)
    except FileNotFoundError:
        return 0


def remote_is_sound(url: str, opts: dict) -> list[str]:
    """Names of the committed remote checkpoints; asserts every file each manifest names is
    there with its size and checksum (downloaded and hashed)."""
    store = RemoteStore(url, opts)
    names = []
    for e in store.scan():
        if e.manifest is None:
            continue
        assert e.problem is None, f"remote manifest names a missing object: {e.name}: {e.problem}"
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"rc-verify-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for f in e.manifest.files:
                (tmp / f.path).parent.mkdir(parents=True, exist_ok=True)
                (tmp / f.path).write_bytes(store.fs.cat_file(f"{store.root}/{e.name}/{f.path}"))
            verify(str(tmp), e.manifest, Depth.FULL)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        names.append(e.name)
    return names


def _reference(tmp: Path, s3_server, total: int, *extra: str, torchrun: bool = True) -> Nodes:
    bucket = s3_server.create_bucket()
    ref = Nodes(tmp, (f"s3://{bucket}/ref", s3_server.options), tag="-ref", torchrun=torchrun)
    ref.run(total, *extra)
    return ref


def _assert_same(run: Nodes, ref: Nodes) -> None:
    for rank in (0, 1):
        got, want = run.losses(rank), ref.losses(rank)
        assert got == want, (
            f"rank {rank}: losses differ at {[s for s in want if got.get(s) != want[s]]}"
        )
        assert run.params(rank) == ref.params(rank)


@pytest.mark.slow
def test_two_nodes_kill_resume_locally_then_a_wiped_node_fetches_only_its_files(
    tmp_path, s3_remote, s3_server
):
    total = 16
    ref = _reference(tmp_path, s3_server, total)
    nodes = Nodes(tmp_path, s3_remote)
    # 1. run, SIGKILL both nodes at a random step after a few saves
    kill_after = random.Random().randint(5, 11)
    procs = nodes.start(total, sleep=0.15)
    deadline = time.monotonic() + 90
    while _last_step(nodes) < kill_after and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.02)
    for p in procs:
        _kill(p)
    killed_at = _last_step(nodes)
    assert killed_at >= kill_after, "\n".join(nodes.logs())
    remote_is_sound(nodes.url, nodes.opts)
    # 2. re-run to step 12: both nodes resume from their local copies, nothing is downloaded
    restores = nodes.run(12)
    assert [r["tier"] for r in restores] == ["local", "local"], restores
    assert [r["downloaded_files"] for r in restores] == [0, 0]
    assert restores[0]["step"] == restores[1]["step"] >= 4
    # 3. node 1 loses its disk: it fetches only rank 1's files and shared.*; node 0 nothing
    shutil.rmtree(nodes.dirs[1])
    restores = nodes.run(total)
    assert restores[0]["tier"] == "local" and restores[0]["downloaded_files"] == 0, restores
    assert restores[1]["tier"] == "remote", restores
    # rank_00001.{json,safetensors} + shared.{json,safetensors}; rank 0's files stay remote
    assert restores[1]["downloaded_files"] == 4, restores
    assert restores[0]["step"] == restores[1]["step"] == 12
    _assert_same(nodes, ref)
    assert remote_is_sound(nodes.url, nodes.opts)


@pytest.mark.slow
def test_two_nodes_a_wiped_node_fetches_only_its_own_files(tmp_path, s3_remote):
    """The default suite's two-node check (two processes, each with its own directory, as
    torchrun starts them): a complete run, node 1's disk lost, the re-run resumes with node 1
    fetching rank 1's and the replicated files only, node 0 nothing."""
    nodes = Nodes(tmp_path, s3_remote, torchrun=False)
    assert nodes.run(4) == []  # nothing to restore
    assert len(remote_is_sound(nodes.url, nodes.opts)) == 2  # keep_last=2: steps 2 and 4
    shutil.rmtree(nodes.dirs[1])
    restores = nodes.run(6)
    assert [r["step"] for r in restores] == [4, 4]
    assert (restores[0]["tier"], restores[0]["downloaded_files"]) == ("local", 0), restores
    assert (restores[1]["tier"], restores[1]["downloaded_files"]) == ("remote", 4), restores
    # node 1's disk holds rank 1's files and the replicated ones, never rank 0's
    names = sorted(p.name for p in (nodes.dirs[1] / "step_000000004").iterdir())
    assert names == [
        "manifest.json",
        "rank_00001.json",
        "rank_00001.safetensors",
        "shared.json",
        "shared.safetensors",
    ]
    assert len(remote_is_sound(nodes.url, nodes.opts)) == 2


@pytest.mark.slow
def test_two_nodes_replica_restores_a_wiped_node_without_the_remote(tmp_path, s3_remote, s3_server):
    ref = _reference(tmp_path, s3_server, 12, "--replicas", "1")
    nodes = Nodes(tmp_path, s3_remote)
    nodes.run(8, "--replicas", "1")
    replicas = nodes.dirs[0] / ".replicas" / "ranks_00001-00001"
    assert "step_000000008" in os.listdir(replicas)
    shutil.rmtree(nodes.dirs[1])
    # rank 1's objects are gone from the remote too: only the peer's replica has them
    store = RemoteStore(nodes.url, nodes.opts)
    gone = [p for p in store.fs.find(store.root) if "/rank_00001." in p]
    assert gone
    store.fs.rm(gone)
    restores = nodes.run(12, "--replicas", "1")
    assert [r["step"] for r in restores] == [8, 8]
    assert (restores[0]["tier"], restores[0]["downloaded_files"]) == ("local", 0)
    assert (restores[1]["tier"], restores[1]["downloaded_files"]) == ("peer", 4), restores
    _assert_same(nodes, ref)


@pytest.mark.slow
def test_random_kills_never_leave_a_torn_remote_checkpoint(tmp_path, s3_remote, s3_server):
    """>= 100 SIGKILLs of both nodes at random moments (local write, one node's upload, the
    remote commit, retention), the nodes killed a random 0-0.3 s apart; after each one every
    remote manifest names only present objects with the right checksum. Then the run finishes
    and matches an uninterrupted one bit for bit."""
    kills = int(os.environ.get("RC_TORTURE_KILLS", "100"))
    total = 400
    rnd = random.Random(int(os.environ.get("RC_TORTURE_SEED", str(time.time_ns()))))
    nodes = Nodes(tmp_path, s3_remote, torchrun=False)
    done = 0
    while done < kills:
        procs = nodes.start(total, sleep=0.01)
        time.sleep(rnd.uniform(0.5, 8.0))
        order = rnd.sample(procs, 2)
        _kill(order[0])
        time.sleep(rnd.uniform(0.0, 0.3))
        _kill(order[1])
        if any(p.returncode == 0 for p in procs):
            break  # finished before the kill
        done += 1
        remote_is_sound(nodes.url, nodes.opts)
    nodes.run(total, timeout=600)
    assert remote_is_sound(nodes.url, nodes.opts)
    ref = _reference(tmp_path, s3_server, total, torchrun=False)
    _assert_same(nodes, ref)
