"""A healthy slow upload is never given up on (close()'s stall judgement sees its bytes move),
and an upload thread the next writer took over stops between the files it puts.

The clock of the stall judgement (``progress``, ``sync``, ``upload_wait``) is moved only by the
test, and the copies move when the test lets them: no sleeps, no timing asserts. The outage
limit is lowered to one second of that clock; close() runs in the main thread, whose reads of
the clock tell the test that close() has looked again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flaky_proxy import FlakyProxy
from resilient_callbacks import Checkpointer, progress, sync, upload_thread, upload_wait
from resilient_callbacks import checkpointer as ckmod
from resilient_callbacks.blobs import NAME_RE
from resilient_callbacks.errors import RemoteUnavailableError, UploadIncompleteError
from resilient_callbacks.manifest import read_manifest
from resilient_callbacks.progress import Progress
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_blobs import listing
from resilient_callbacks.remote_put import in_flight

TIMEOUT_S = 60.0


class Clock:
    """``time`` of the modules that judge a stall: ``monotonic()`` is moved only by
    :meth:`advance`; everything else is the real ``time``."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.main_reads = 1000.0, 0
        self.cond = threading.Condition()
        for mod in (progress, sync, upload_wait):
            monkeypatch.setattr(mod, "time", self)
        monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)

    def monotonic(self) -> float:
        with self.cond:
            if threading.current_thread() is threading.main_thread():
                self.main_reads += 1
                self.cond.notify_all()
            return self.now

    def advance(self, s: float) -> None:
        with self.cond:
            self.now += s

    def main_looked(self, times: int = 3) -> bool:
        """Wait until the main thread (close()'s wait) has read the clock ``times`` more times:
        False once it stopped (close() gave up: a few reads after it decided, then none)."""
        with self.cond:
            seen = self.main_reads
            return self.cond.wait_for(lambda: self.main_reads >= seen + times, TIMEOUT_S)

    def __getattr__(self, name: str):
        return getattr(time, name)


class Gate:
    """The source files of a copy into a local store (``remote_put._source``), read one chunk
    per :meth:`step`; each chunk that moves bytes takes 0.6 s of the clock (less than the
    outage limit, 1 s), so the copy as a whole takes far longer than the limit."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.reads, self.open = clock, 0, False
        self.cond = threading.Condition()
        self.allowed = 0

    def source(self, path: str):
        gate, f = self, open(path, "rb", buffering=0)  # noqa: SIM115 (closed by the copy)

        class Gated:
            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                f.close()

            def readinto(self, b) -> int:
                with gate.cond:
                    assert gate.cond.wait_for(lambda: gate.open or gate.allowed > 0, TIMEOUT_S)
                    gate.allowed -= 0 if gate.open else 1
                    n = f.readinto(b)
                    if n and not gate.open:
                        gate.clock.advance(0.6)
                    gate.reads += 1
                    gate.cond.notify_all()
                    return n

        return Gated()

    def step(self) -> None:
        with self.cond:
            seen = self.reads
            self.allowed += 1
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.reads > seen, TIMEOUT_S), "no chunk read"

    def release(self) -> None:
        with self.cond:
            self.open = True
            self.cond.notify_all()


def _closed_after(ck: Checkpointer, drive) -> dict:
    """close() ``ck`` in this (the main) thread while ``drive(out)`` runs in another; close()
    must raise UploadIncompleteError (given up). ``out``: what ``drive`` recorded; its
    ``done`` is set once close() has returned or raised."""
    out: dict = {"done": threading.Event()}

    def run() -> None:
        try:
            drive(out)
        except BaseException as e:  # (said by the test)
            out["error"] = e

    driver = threading.Thread(target=run, name="test-driver", daemon=True)
    driver.start()
    try:
        with pytest.raises(UploadIncompleteError):
            ck.close()
    finally:
        out["closed"] = True
        out["done"].set()
    driver.join(TIMEOUT_S)
    assert "error" not in out, out["error"]
    return out


def test_a_slow_copy_into_a_local_store_is_waited_for_while_its_bytes_move(tmp_path, monkeypatch):
    """fsspec's local put counts no byte until it ends: close() gave up on a healthy copy into
    a ``file://`` store that took longer than the outage limit (5 minutes). The copy now counts
    each chunk: close() waits while chunks move (here 6 of them, 3.6 s of the clock against a
    1 s limit) and gives up only once none has moved for the limit."""
    from resilient_callbacks import remote_put

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    monkeypatch.setattr(remote_put, "CHUNK", 4096)
    clock = Clock(monkeypatch)
    gate = Gate(clock)
    monkeypatch.setattr(remote_put, "_source", gate.source)
    ck = Checkpointer(
        tmp_path / "local", remote=f"file://{tmp_path}/durable", async_save=False, preemption=False
    )
    thread = ck._dir.sync._thread
    ck.save(1, {"w": torch.ones(16384)})  # (64 KiB: 16 chunks)

    def drive(out: dict) -> None:
        for _ in range(6):
            gate.step()
            out["waits"] = clock.main_looked(2)
            if not out["waits"]:
                return  # (close() gave up: it no longer looks)
        out["waits"] = clock.main_looked(10)  # (no chunk, but for less than the limit)
        clock.advance(5.0)  # then no chunk for 5 s: stalled

    try:
        out = _closed_after(ck, drive)
    finally:
        gate.release()
        thread.join(TIMEOUT_S)
    assert out["waits"], "close() gave up on a copy that moved bytes"
    assert not thread.is_alive()


def test_an_upload_counted_per_part_is_not_a_stall_while_its_part_may_still_move(
    s3_server, s3_remote, tmp_path, monkeypatch
):
    """s3fs counts a file's bytes when its put (or a 50 MiB part) ends: on a link under about
    170 KB/s a healthy upload moved no counted byte for the outage limit, and close() gave up
    on it. The stall is now judged after the time the bytes in flight take on the slowest link
    tolerated (lowered here so that they take 10^3 s: the put is held 5 s of the clock past a 1 s
    limit, close() waits), and close() still gives up once that has passed."""
    url, opts = s3_remote
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    monkeypatch.setattr(progress, "SLOWEST_LINK_BPS", 64)  # (64 KiB in flight: 1024 s)
    clock = Clock(monkeypatch)
    held, release = threading.Event(), threading.Event()

    def rule(method: str, path: str, query: str) -> str | None:
        name = path.rsplit("/", 1)[-1]
        data = not name.startswith(".writer-") and name != "manifest.json"
        if method == "PUT" and "/step_000000001/" in path and data and not held.is_set():
            held.set()  # the data file's put is under way: its answer held
            assert release.wait(120)
        return None

    proxy = FlakyProxy(s3_server.endpoint, rule)
    ck = None
    try:
        options = {**opts, "endpoint_url": proxy.endpoint, "config_kwargs": {"read_timeout": 120}}
        ck = Checkpointer(tmp_path / "local", remote=url, remote_options=options, async_save=False)
        thread = ck._dir.sync._thread
        ck.save(1, {"w": torch.ones(16384)})

        def drive(out: dict) -> None:
            assert held.wait(TIMEOUT_S), "the data file's PUT was not seen"
            clock.advance(5.0)  # no byte counted for 5 times the limit: its part in flight
            out["waits"] = clock.main_looked(10)  # (one that gave up looks no more)
            clock.advance(1e6)  # past the time its bytes in flight may take: stalled

        out = _closed_after(ck, drive)
        assert out["waits"], "close() gave up while the part may still be moving"
    finally:
        release.set()
        if ck is not None:
            ck._dir.sync._thread.join(TIMEOUT_S)
        proxy.close()
    assert not thread.is_alive()


def _held_s3_upload(s3_server, s3_remote, tmp_path, held_name: str | None, drive) -> dict:
    """Save step 1 to an S3 store through a proxy that holds the answer to the PUT of
    ``held_name`` (None: the data file) under ``step_000000001/``, then close() (it must give
    up) while ``drive(ck, held, out)`` moves the clock; the PUT is answered after. ``out``."""
    url, opts = s3_remote
    held, release = threading.Event(), threading.Event()

    def rule(method: str, path: str, query: str) -> str | None:
        name = path.rsplit("/", 1)[-1]
        data = not name.startswith(".writer-") and name != "manifest.json"
        target = data if held_name is None else name == held_name
        if method == "PUT" and "/step_000000001/" in path and target and not held.is_set():
            held.set()  # its answer held
            assert release.wait(120)
        return None

    proxy = FlakyProxy(s3_server.endpoint, rule)
    ck = None
    try:
        options = {**opts, "endpoint_url": proxy.endpoint, "config_kwargs": {"read_timeout": 120}}
        ck = Checkpointer(tmp_path / "local", remote=url, remote_options=options, async_save=False)
        thread = ck._dir.sync._thread
        ck.save(1, {"w": torch.ones(16384)})
        out = _closed_after(ck, lambda out: drive(ck, held, out))
    finally:
        release.set()
        if ck is not None:
            ck._dir.sync._thread.join(TIMEOUT_S)
        proxy.close()
    assert not thread.is_alive()
    return out


def test_a_store_that_hangs_is_given_up_on_after_the_longest_allowance(
    s3_server, s3_remote, tmp_path, monkeypatch
):
    """The stall allowance had no cap: the bytes in flight at 32 KiB/s (the largest files
    fsspec puts at once, up to an eighth of the open-file limit: about 35 days for 100 GB), so
    a store that hangs without failing held close() that long. It is at most
    progress.MAX_ALLOWANCE_S (1 h): here the bytes in flight take 18 h at the slowest link
    (lowered), and close() gives up once none has counted for an hour; remote_status() says
    the capped allowance."""
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    monkeypatch.setattr(progress, "SLOWEST_LINK_BPS", 1)  # (64 KiB in flight: 18 h)
    clock = Clock(monkeypatch)

    def drive(ck: Checkpointer, held: threading.Event, out: dict) -> None:
        assert held.wait(TIMEOUT_S), "the data file's PUT was not seen"
        out["allowance"] = ck.remote_status().stall_allowance_s
        clock.advance(progress.MAX_ALLOWANCE_S - 10)  # (under the cap: still moving)
        out["waits"] = clock.main_looked(10)
        clock.advance(20.0)  # no count for longer than the cap: stalled
        out["gave_up"] = out["done"].wait(TIMEOUT_S)
        clock.advance(1e9)  # (if it did not: past the uncapped allowance too)

    out = _held_s3_upload(s3_server, s3_remote, tmp_path, None, drive)
    assert out["allowance"] == progress.MAX_ALLOWANCE_S, out
    assert out["waits"], "close() gave up while the bytes in flight may still move"
    assert out["gave_up"], "close() waited past the longest allowance for a hung store"


def test_the_allowance_of_a_put_ends_with_it(s3_server, s3_remote, tmp_path, monkeypatch):
    """The allowance of the files' put stayed set after it, so the settle and the commit that
    follow (no bytes in flight: a manifest) inherited it: a store hanging on the commit held
    close() for the data's allowance. It ends with the put: close() gives up on a held commit
    after the outage limit, and remote_status() says no allowance meanwhile."""
    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 1.0)
    monkeypatch.setattr(progress, "SLOWEST_LINK_BPS", 64)  # (64 KiB in flight: 1024 s)
    clock = Clock(monkeypatch)

    def drive(ck: Checkpointer, held: threading.Event, out: dict) -> None:
        assert held.wait(TIMEOUT_S), "the manifest's PUT was not seen"
        out["allowance"] = ck.remote_status().stall_allowance_s
        clock.advance(5.0)  # no count for 5 times the outage limit: stalled
        out["gave_up"] = out["done"].wait(TIMEOUT_S)
        clock.advance(1e6)  # (if it did not: past the data's allowance too)

    out = _held_s3_upload(s3_server, s3_remote, tmp_path, "manifest.json", drive)
    assert out["allowance"] == 0.0, out
    assert out["gave_up"], "close() waited for the allowance of a put that had ended"


def test_the_bytes_in_flight_of_an_s3_put_are_those_of_its_open_requests(s3_remote):
    """The bytes in flight of an s3fs put summed the largest files fsspec puts at once (128 to
    over 100,000): 64 GB for 128 files of 1 GiB. They are those of the requests botocore's
    connection pool (max_pool_connections, 10) has open at once: a part (50 MiB) each of a
    large file (up to 10 parts of one file), a whole small file each."""
    url, opts = s3_remote
    mib = 1 << 20
    fs = RemoteStore(url, opts).fs
    assert in_flight(fs, [1 << 30] * 300) == 10 * 50 * mib
    assert in_flight(fs, [80 * mib] * 300) == 10 * 80 * mib
    assert in_flight(fs, [120 * mib, 1]) == 120 * mib + 1  # (parts of 50, 50, 20 MiB)
    assert in_flight(fs, [1 << 30, 80 * mib]) == 80 * mib + 9 * 50 * mib
    two = RemoteStore(url, {**opts, "config_kwargs": {"max_pool_connections": 2}}).fs
    assert in_flight(two, [1 << 30] * 300) == 2 * 50 * mib


def _blobbed(tmp_path):
    """A local incremental checkpoint of 4 blobs: (its folder, its manifest)."""
    state = {k: torch.full((65536,), float(i)) for i, k in enumerate("abcd")}  # (256 KiB each)
    with Checkpointer(tmp_path / "local", incremental=True, async_save=False) as ck:
        ck.save(1, state)
    local = str(tmp_path / "local" / "step_000000001")
    m = read_manifest(local)
    assert len(m.blobs) == 4
    return local, m


def _taken_over_at_first_byte(store: RemoteStore, local: str, m) -> BaseException | None:
    """Upload ``m`` in a thread that the next writer takes over (as ``_wait_previous`` does)
    once its first bytes are counted; what the upload raised."""
    out: dict = {}
    uploader: list[threading.Thread] = []

    class TakenOver(Progress):
        def update(self, n: int) -> None:
            super().update(n)
            upload_thread._superseded.add(uploader[0])  # (counted in fsspec's loop on S3)

    def run() -> None:
        try:
            store.upload(local, m, "step_000000001", TakenOver(m.total_bytes, "test", bar=False))
        except BaseException as e:
            out["error"] = e

    uploader.append(threading.Thread(target=run, name="test-uploader"))
    uploader[0].start()
    uploader[0].join(TIMEOUT_S)
    assert not uploader[0].is_alive()
    return out.get("error")


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_writer_taken_over_puts_no_more_blobs_nor_files(backend, tmp_path, request):
    """The fence (a next writer of the store gave up waiting for this upload thread) was
    checked only before the commit, a retention delete or a collection: a writer taken over
    while it put blobs went on putting every blob and every file of the checkpoint for as long
    as they took. Each file's put now checks it (and each count of its bytes): the upload stops
    with the superseded error, none of the checkpoint's files put, on a local store no blob
    either (taken over during the first)."""
    local, m = _blobbed(tmp_path)
    if backend == "s3":
        url, opts = request.getfixturevalue("s3_remote")
        store = RemoteStore(url, opts)
    else:
        store = RemoteStore(f"file://{tmp_path}/durable")
    error = _taken_over_at_first_byte(store, local, m)
    assert isinstance(error, RemoteUnavailableError), error
    assert "the next writer of this store took it over" in str(error)
    store.fs.invalidate_cache()
    try:
        put = store.fs.find(store._path("step_000000001"))
    except FileNotFoundError:
        put = []
    assert put == [], put  # (none of its files: it stopped in its blobs)
    if backend == "file":  # (on S3, those put at once with the first are there: a batch)
        assert not [n for n in listing(store) if NAME_RE.match(n) or n.startswith(".upload-")]
    assert not [n for n in listing(store) if n.startswith(".inflight-")]
