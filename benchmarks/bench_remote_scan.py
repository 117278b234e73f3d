"""Listing a remote tier that holds many checkpoints: ``RemoteStore.scan`` against reading the
manifests one request after another (what it did before), in one run.

    .venv/bin/python benchmarks/bench_remote_scan.py [--checkpoints 200] [--reps 5] \
        [--out benchmarks/results]

A real S3 API server (moto, in its own process, as in ``bench_remote.py``) on 127.0.0.1, reached
through s3fs and a proxy that holds each response ``--latency-ms`` (default 20: a store in
another zone or region; 0: loopback, where moto's own CPU time is all there is). The bucket gets ``--checkpoints`` committed checkpoints (a small real checkpoint's
files and manifest, renumbered). Every remote command of the CLI (``ls --remote``, ``pull``,
``push``, ``gc --remote``, ``report --remote``), a restore that consults the remote tier and the
uploader's retention list the store this way.

- ours, first scan: ``RemoteStore(...).scan()`` of a new store object, as a CLI command or a
  restore lists the store (one listing, then every manifest fetched in one ``cat`` call, which
  s3fs runs concurrently);
- ours, again: ``scan()`` of the same store object once more, as the uploader lists the store
  after each upload (one listing; a manifest whose listed size, time and etag are unchanged is
  not fetched again);
- sequential: the same listing, then ``read_manifest`` of each checkpoint in turn.

All parse and check every manifest (the second scan those it fetches). Medians of ``--reps``, alternating which goes first.
Writes ``bench_remote_scan.json`` and ``bench_remote_scan.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_remote import MotoProcess
from common import library_version, med, write_results

from resilient_callbacks import Checkpointer
from resilient_callbacks.manifest import MANIFEST_NAME, read_manifest
from resilient_callbacks.remote import RemoteStore


def fill(st: RemoteStore, n: int, work: str) -> None:
    """``n`` committed checkpoints in the store: one real checkpoint's files, renumbered."""
    local = os.path.join(work, "local")
    with Checkpointer(local, async_save=False) as ck:
        ck.save(1, {"w": torch.randn(64, 64), "extra": {"note": "bench"}})
        path = ck.last_save.path if ck.last_save else ""
    m = read_manifest(path)
    blobs: dict[str, bytes] = {}
    for i in range(1, n + 1):
        name = f"step_{i:09d}"
        for f in m.files:
            with open(os.path.join(path, f.path), "rb") as fh:
                blobs[st._path(name, f.path)] = fh.read()
        m.step, m.seq = i, i
        blobs[st._path(name, MANIFEST_NAME)] = json.dumps(m.to_json()).encode()
    st.fs.pipe(blobs)


def sequential(st: RemoteStore) -> int:
    """The listing, then each manifest read on its own (the scan before 2026-11-25)."""
    st.fs.invalidate_cache()
    listing = st.fs.find(st.root, detail=True)
    names = sorted(
        {p[len(st.root) + 1 :].split("/", 1)[0] for p in listing if p.endswith(MANIFEST_NAME)}
    )
    return len([st.read_manifest(n) for n in names])


class DelayProxy:
    """A TCP proxy in front of the server that holds each chunk the server sends for
    ``latency_s``: a store across a network, where each request waits a round trip."""

    def __init__(self, port: int, latency_s: float) -> None:
        import asyncio
        import threading

        self.latency_s = latency_s
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def pump(reader: Any, writer: Any, delay: float) -> None:
            try:
                while data := await reader.read(1 << 16):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
            finally:
                writer.close()

        async def handle(creader: Any, cwriter: Any) -> None:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.gather(
                pump(creader, swriter, 0.0), pump(sreader, cwriter, self.latency_s)
            )

        async def start() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            box["port"] = server.sockets[0].getsockname()[1]
            ready.set()
            await server.serve_forever()

        threading.Thread(target=self.loop.run_until_complete, args=(start(),), daemon=True).start()
        ready.wait(30)
        self.port = int(box["port"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--latency-ms", type=float, default=20.0, help="each response held this long (0: none)"
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    server = MotoProcess()
    work = tempfile.mkdtemp(prefix="bench_remote_scan_")
    times: dict[str, list[float]] = {"ours": [], "again": [], "sequential": []}
    try:
        fill(RemoteStore("s3://bench/scan", server.options), args.checkpoints, work)
        options = dict(server.options)
        if args.latency_ms:
            proxy = DelayProxy(server.port, args.latency_ms / 1000)
            options["endpoint_url"] = f"http://127.0.0.1:{proxy.port}"
        st = RemoteStore("s3://bench/scan", options)
        ours = [e for e in st.scan() if e.manifest is not None and e.problem is None]
        assert len(ours) == args.checkpoints, len(ours)
        assert sequential(st) == args.checkpoints
        runs = {
            "ours": lambda: RemoteStore("s3://bench/scan", options).scan(),
            "again": st.scan,
            "sequential": lambda: sequential(st),
        }
        for rep in range(args.reps):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for kind in order:
                t0 = time.perf_counter()
                runs[kind]()
                times[kind].append(time.perf_counter() - t0)
                print(f"rep {rep} {kind}: {times[kind][-1]:.3f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    ours_s, again_s, seq_s = med(times["ours"]), med(times["again"]), med(times["sequential"])
    ratio = ours_s / seq_s
    result: dict[str, Any] = {
        "args": vars(args),
        "version": library_version(),
        "cpus": os.cpu_count(),
        "seconds": times,
        "ours_s": ours_s,
        "again_s": again_s,
        "sequential_s": seq_s,
        "ratio": ratio,
        "again_ratio": again_s / seq_s,
    }
    text = "\n".join(
        [
            f"# bench_remote_scan ({args.checkpoints} checkpoints, moto S3 on 127.0.0.1 behind "
            f"{args.latency_ms:g} ms per response, {os.cpu_count()} CPUs, {library_version()})",
            "",
            "| listing the remote tier | s (median) |",
            "|---|---:|",
            f"| ours, first scan: `RemoteStore(...).scan()` (manifests fetched concurrently) "
            f"| {ours_s:.3f} |",
            f"| ours, again (the uploader after each upload: known manifests not fetched) "
            f"| {again_s:.3f} |",
            f"| one manifest request after another | {seq_s:.3f} |",
            "",
            f"ours / sequential: **{ratio:.2f}x** first scan, **{again_s / seq_s:.2f}x** again",
            "",
        ]
    )
    write_results(args.out, "bench_remote_scan", result, text)
    print()
    print(text)


if __name__ == "__main__":
    main()
