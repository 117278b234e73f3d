"""Several nodes without a shared filesystem (docs/multinode.md), on one machine: two "nodes", each
with its own checkpoint directory that the other cannot see, the remote tier on the moto S3
server. A node is a torchrun launcher (``--nnodes=2 --node_rank=0/1``, a rendezvous on
127.0.0.1), or the process torchrun would start, forked from a pre-started zygote
(tests/node_zygote.py) that paid the imports once.

Checked: a SIGKILL of both nodes resumes bit-exactly from the local copies without any download;
a wiped node fetches only its own ranks' files (and the replicated ``shared.*``) while the other
downloads nothing, and tries its download again through a burst of 500s; with ``replicas=1`` a
wiped node restores from its peer with its remote objects deleted; random kills in every phase
never leave a remote manifest naming a missing or wrong object. (Option errors:
tests/test_remote_commit.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import spawn_ranks
from flaky_proxy import FlakyProxy
from resilient_callbacks.commit import STAGING_PREFIX
from resilient_callbacks.remote import RemoteStore
from spawn_ranks import free_port

SCRIPT = Path(__file__).with_name("train_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


class Zygotes:
    """The processes of each run, forked from the test session's zygote
    (tests/node_zygote.py, spawn_ranks.shared_zygote): the imports are paid once per session
    instead of twice per run. Each one is a fresh process with its node's environment and
    directory, as on a node of its own."""

    def __init__(self) -> None:
        self.zygote = spawn_ranks.shared_zygote()

    def spawn(self, node: int, env: dict[str, str], argv: list[str], log: Path) -> Forked:
        forked = self.zygote.spawn([sys.executable, str(SCRIPT), *argv], env, log)
        assert isinstance(forked, spawn_ranks.Forked), "env lacks the zygote's PYTHONHASHSEED"
        return Forked(forked.pid, log)


class Forked:
    """A training process forked by a zygote: finished once the zygote wrote its exit status
    to ``<log>.rc`` (before reaping it: a zombie is not finished yet); gone without it only if
    the zygote is."""

    def __init__(self, pid: int, log: Path) -> None:
        self.pid, self.rc_file = pid, Path(f"{log}.rc")
        self.returncode: int | None = None

    def _alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return bool(f.read())
        except OSError:
            return False

    def poll(self) -> int | None:
        if self.returncode is None:
            alive = self._alive()  # (first: a child reaped had its status written before)
            if self.rc_file.exists():
                self.returncode = int(self.rc_file.read_text())
            elif not alive:
                self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.poll()


def _node_env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONHASHSEED="0",
        TORCHELASTIC_ERROR_FILE="",
    )


@pytest.fixture(scope="module")
def zygotes():
    if spawn_ranks.FRESH:  # (torchrun launchers instead)
        yield None
        return
    yield Zygotes()


class Nodes:
    """Two simulated nodes: two torchrun launchers (``zygotes=None``), or the two processes
    torchrun would start, forked by :class:`Zygotes`."""

    def __init__(
        self,
        tmp: Path,
        remote: tuple[str, dict],
        tag: str = "",
        zygotes: Zygotes | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.tmp, (self.url, self.opts) = tmp, remote
        self.zygotes = zygotes
        self.env = env or {}
        self.dirs = [tmp / f"node{i}{tag}" / "ckpt" for i in range(2)]
        self.out = tmp / f"out{tag}"
        self.out.mkdir(exist_ok=True)
        self.runs = 0

    def start(
        self, total: int, *extra: str, sleep: float = 0.0, every: int = 2
    ) -> list[subprocess.Popen | Forked]:
        port = free_port()
        self.runs += 1
        procs: list[subprocess.Popen | Forked] = []
        for i in range(2):
            env = dict(_node_env(), **self.env)
            argv = [
                str(self.dirs[i]),
                "--distributed",
                "--total-steps",
                str(total),
                "--every-n-steps",
                str(every),
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
            log_path = self.log_path(i)
            if self.zygotes is not None:  # the processes torchrun would start
                env.update(
                    RANK=str(i),
                    LOCAL_RANK="0",
                    WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
                procs.append(self.zygotes.spawn(i, env, argv, log_path))
                continue
            launcher = [
                str(TORCHRUN),
                "--nnodes=2",
                f"--node_rank={i}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "--max_restarts=0",
            ]
            log = open(log_path, "w")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [*launcher, str(SCRIPT), *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
            log.close()
        return procs

    def log_path(self, node: int) -> Path:
        return self.out / f"run{self.runs}.node{node}.log"

    def logs(self) -> list[str]:
        out = []
        for i in range(2):
            try:
                out.append(self.log_path(i).read_text())
            except FileNotFoundError:
                out.append("")
        return out

    def run(self, total: int, *extra: str, timeout: float = 120, every: int = 2) -> list[dict]:
        procs = self.start(total, *extra, every=every)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.02)
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
                with contextlib.suppress(ValueError):  # a line a kill cut short
                    rec = json.loads(line)
                    out[rec["step"]] = rec["loss"]  # a resumed step overwrites the killed run's
        return out

    def lines(self, rank: int) -> int:
        """Steps logged so far by ``rank`` (every run)."""
        try:
            return (self.out / f"losses.jsonl.rank{rank}").read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

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


def _kill(p: subprocess.Popen | Forked) -> None:
    """SIGKILL a node: its launcher and every worker at once."""
    if isinstance(p, Forked):
        p.kill()
        return
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
    there with its size and checksum (the library's download: every file fetched and verified
    against the manifest's size and xxh3 checksum)."""
    store = RemoteStore(url, opts)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"rc-verify-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    names = []
    try:
        for e in store.scan():
            if e.manifest is None:
                continue
            assert e.problem is None, (
                f"remote manifest names a missing object: {e.name}: {e.problem}"
            )
            staging, _ = store.download(e, str(tmp), progress=False)  # raises if anything is off
            shutil.rmtree(staging)
            names.append(e.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def _reference(
    tmp: Path,
    s3_server,
    total: int,
    *extra: str,
    zygotes: Zygotes | None = None,
    every: int = 2,
    timeout: float = 120,
) -> Nodes:
    bucket = s3_server.create_bucket()
    ref = Nodes(tmp, (f"s3://{bucket}/ref", s3_server.options), tag="-ref", zygotes=zygotes)
    ref.run(total, *extra, every=every, timeout=timeout)
    return ref


def _assert_same(run: Nodes, ref: Nodes) -> None:
    for rank in (0, 1):
        got, want = run.losses(rank), ref.losses(rank)
        assert got == want, (
            f"rank {rank}: losses differ at {[s for s in want if got.get(s) != want[s]]}"
        )
        assert run.params(rank) == ref.params(rank)


def _wait_until(cond, procs, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.005)
    return False


def test_two_nodes_kill_resume_locally_then_a_wiped_node_fetches_only_its_files(
    zygotes, tmp_path, s3_remote, s3_server
):
    """The default suite's two-node check: two processes as torchrun starts them (forked by
    pre-started zygotes), each node with its own directory, the remote on moto S3. SIGKILL of
    both once step 2 is committed on both disks: the re-run resumes from the local copies,
    nothing downloaded; node 1's disk wiped: it fetches rank 1's and the replicated files only,
    node 0 nothing; losses and weights bit-identical to an uninterrupted run."""
    ref = _reference(tmp_path, s3_server, 10, zygotes=zygotes)
    nodes = Nodes(tmp_path, s3_remote, zygotes=zygotes, env={"RC_LOG": "INFO"})
    procs = nodes.start(10**6, sleep=0.05)
    saved = _wait_until(lambda: all("saved step 2 " in t for t in nodes.logs()), procs, 120)
    for p in procs:
        _kill(p)
    assert saved, "\n".join(nodes.logs())
    remote_is_sound(nodes.url, nodes.opts)
    # the re-run resumes from both local disks, without a download
    restores = nodes.run(8)
    assert [r["tier"] for r in restores] == ["local", "local"], restores
    assert [r["downloaded_files"] for r in restores] == [0, 0]
    assert restores[0]["step"] == restores[1]["step"] >= 2
    assert len(remote_is_sound(nodes.url, nodes.opts)) == 2  # keep_last=2: steps 6 and 8
    # node 1 loses its disk: it fetches rank 1's files and shared.* only; node 0 nothing
    shutil.rmtree(nodes.dirs[1])
    restores = nodes.run(10)
    assert [r["step"] for r in restores] == [8, 8]
    assert (restores[0]["tier"], restores[0]["downloaded_files"]) == ("local", 0), restores
    assert (restores[1]["tier"], restores[1]["downloaded_files"]) == ("remote", 4), restores
    names = sorted(p.name for p in (nodes.dirs[1] / "step_000000008").iterdir())
    assert names == [
        "manifest.json",
        "rank_00001.json",
        "rank_00001.safetensors",
        "remote_manifest.json",  # the record that it was committed on every node
        "shared.json",
        "shared.safetensors",
    ]
    _assert_same(nodes, ref)
    assert len(remote_is_sound(nodes.url, nodes.opts)) == 2


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_a_wiped_nodes_download_that_fails_is_tried_again_not_rolled_back(
    zygotes, tmp_path, s3_remote, s3_server
):
    """Node 1's disk is wiped and the store answers 500 to every read of its files of the
    newest checkpoint (step 4) for a while, longer than the client's own retries: its download
    is tried again, as in shared mode, and both nodes resume from step 4. Every node fell back
    to step 2 at once (a whole save interval lost over an error burst the next try rides out)."""
    opts = s3_remote[1]
    nodes = Nodes(tmp_path, s3_remote, zygotes=zygotes)
    nodes.run(4)  # steps 2 and 4, committed remotely
    shutil.rmtree(nodes.dirs[1])
    failed: list[str] = []

    def rule(method: str, path: str, query: str) -> str | None:
        # node 1's files of step 4 fail until node 1's log says their download is tried again
        if method == "GET" and "/step_000000004/rank_00001." in path:
            log = nodes.log_path(1)
            if "trying again" not in (log.read_text() if log.exists() else ""):
                failed.append(path)
                return "error"
        return None

    proxy = FlakyProxy(s3_server.endpoint, rule)
    try:
        retries = {"retries": {"max_attempts": 2, "mode": "standard"}}  # (the burst outlasts them)
        nodes.opts = {**opts, "endpoint_url": proxy.endpoint, "config_kwargs": retries}
        restores = nodes.run(6)
    finally:
        proxy.close()
    assert failed, "no read of node 1's files of step 4 was failed"
    assert [r["step"] for r in restores] == [4, 4], (restores, nodes.logs()[1][-3000:])
    assert (restores[1]["tier"], restores[1]["downloaded_files"]) == ("remote", 4), restores
    assert "ResumeFallbackWarning" not in "".join(nodes.logs())


@pytest.mark.slow
def test_two_torchrun_nodes_kill_resume_locally_then_a_wiped_node_fetches_only_its_files(
    tmp_path, s3_remote, s3_server
):
    """The same with two real torchrun launchers (``--nnodes=2 --node_rank=0/1``)."""
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
def test_two_nodes_replica_restores_a_wiped_node_without_the_remote(tmp_path, s3_remote, s3_server):
    ref = _reference(tmp_path, s3_server, 12, "--replicas", "1")
    nodes = Nodes(tmp_path, s3_remote)
    nodes.run(8, "--replicas", "1")
    replicas = nodes.dirs[0] / ".replicas" / "ranks_00001-00001"
    assert "step_000000008" in os.listdir(replicas)
    # node 0's replica carries the record that the coordinator committed it on every node
    of_node0 = nodes.dirs[1] / ".replicas" / "ranks_00000-00000" / "step_000000008"
    assert (of_node0 / "remote_manifest.json").is_file()
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


def _count(text: str, pattern: str) -> Counter[str]:
    return Counter(re.findall(pattern, text))


def _interrupted(nodes: Nodes) -> set[str]:
    """The phases a kill interrupted, from what the run left: a staging folder on a node's
    disk (a local write), an upload a node's log began but did not finish, a remote commit
    rank 0's log began but did not finish, a remote checkpoint with one node's objects only."""
    hit = set()
    for d in nodes.dirs:
        if d.is_dir() and any(n.startswith(STAGING_PREFIX) for n in os.listdir(d)):
            hit.add("local write")
    logs = nodes.logs()
    for i, text in enumerate(logs):
        up = _count(text, r"uploading node \d+'s part of (\S+) ")
        if up - _count(text, r"uploaded node \d+'s part of (\S+) "):
            hit.add(f"upload (node {i})")
    if _count(logs[0], r"committing \S+/(\S+) remotely") - _count(
        logs[0], r"committed \S+/(\S+) remotely"
    ):
        hit.add("remote commit")
    for e in RemoteStore(nodes.url, nodes.opts).scan():
        ranks = {f.split(".")[0] for f in e.sizes if f.startswith("rank_")}
        if e.manifest is None and len(ranks) == 1:
            hit.add("one node uploaded")
    return hit


def _upload_failures(nodes: Nodes, run: int) -> list[str]:
    out = []
    for i in range(2):
        text = (nodes.out / f"run{run}.node{i}.log").read_text()
        out += [ln for ln in text.splitlines() if "failed (" in ln and "uploading" in ln]
    return out


def _kill_point(nodes: Nodes, procs: list, rnd: random.Random) -> tuple[str, bool]:
    """Wait for a random point of the run's own progress: k more steps logged (local writes
    under way), a node's log saying its n-th upload began, or rank 0's log saying its n-th
    remote commit began. Returns the trigger and whether it fired."""
    trigger = rnd.choice(["steps", "upload", "commit"])
    if trigger == "steps":
        target = nodes.lines(0) + rnd.randint(1, 6)
        return trigger, _wait_until(lambda: nodes.lines(0) >= target, procs, 60)
    if trigger == "upload":
        node, n = rnd.randint(0, 1), rnd.randint(1, 3)
        return trigger, _wait_until(
            lambda: nodes.logs()[node].count("uploading node") >= n, procs, 60
        )
    n = rnd.randint(1, 2)
    return trigger, _wait_until(lambda: nodes.logs()[0].count("committing ") >= n, procs, 60)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 100 kill cycles of several seconds each on a loaded machine
def test_random_kills_never_leave_a_torn_remote_checkpoint(zygotes, tmp_path, s3_remote, s3_server):
    """>= 100 SIGKILLs (``RC_TORTURE_KILLS``) of both nodes, a random 0-0.1 s apart, at random
    points of the run's own progress after its restore: after k more steps (local writes), just
    after a node's log says an upload began, or just after rank 0's log says a remote commit
    began. After each kill every committed remote checkpoint is downloaded and verified (a
    manifest naming a missing or wrong object fails), and the phases the kill interrupted are
    counted from what it left (each must have been hit). Then the run finishes and matches an
    uninterrupted one (which saves nothing but its final checkpoint) bit for bit; and no upload
    ever failed (a spurious failure is retried, so only the logs show it)."""
    kills = int(os.environ.get("RC_TORTURE_KILLS", "100"))
    seed = int(os.environ.get("RC_TORTURE_SEED", str(time.time_ns() % 2**32)))
    rnd = random.Random(seed)
    nodes = Nodes(tmp_path, s3_remote, zygotes=zygotes, env={"RC_LOG": "INFO"})
    hits: Counter[str] = Counter()
    triggers: Counter[str] = Counter()
    t0 = time.monotonic()
    for _ in range(kills):
        procs = nodes.start(10**6, sleep=0.05)
        started = _wait_until(lambda: all("restored" in t for t in nodes.logs()), procs, 120)
        assert started, f"a node failed to start (seed {seed}):\n" + "\n".join(nodes.logs())
        trigger, fired = _kill_point(nodes, procs, rnd)
        time.sleep(rnd.uniform(0.0, 0.03))
        first, second = rnd.sample(procs, 2)
        _kill(first)
        time.sleep(rnd.uniform(0.0, 0.1))
        _kill(second)
        assert fired, f"trigger {trigger} never fired (seed {seed}):\n" + "\n".join(nodes.logs())
        triggers[trigger] += 1
        hits.update(_interrupted(nodes))
        remote_is_sound(nodes.url, nodes.opts)
    elapsed = time.monotonic() - t0
    # the final run: a few steps past the furthest any run got, then close (uploads, commit)
    total = max(_last_step(nodes), 1) + 4
    restores = nodes.run(total, timeout=600)
    committed = remote_is_sound(nodes.url, nodes.opts)
    summary = (
        f"{kills} kills in {elapsed:.0f} s (seed {seed}); triggers {dict(triggers)}; "
        f"interrupted {dict(hits)}; final run restored step {restores[0]['step']} "
        f"({restores[0]['tier']}), ran to {total}; remote holds {committed}"
    )
    print(summary)
    (tmp_path.parent / "torture-summary.txt").write_text(summary + "\n")
    assert committed
    assert restores[0]["step"] > 0
    failed = [ln for i in range(1, nodes.runs + 1) for ln in _upload_failures(nodes, i)]
    assert not failed, failed[:5]
    if kills >= 50:  # the kills reached every phase
        for phase in ("local write", "upload (node 0)", "upload (node 1)", "remote commit"):
            assert hits[phase] > 0, summary
    # the uninterrupted run saves nothing but its final checkpoint: saving never changes results
    ref = _reference(tmp_path, s3_server, total, zygotes=zygotes, every=10**6, timeout=600)
    _assert_same(nodes, ref)
