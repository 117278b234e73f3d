"""Requests the remote tier sends per save once the store holds many checkpoints, counted (not
timed: counts do not depend on the machine's load).

    .venv/bin/python benchmarks/bench_remote_requests.py [--checkpoints 150] [--out benchmarks/results]

A real S3 API server (moto, in its own process, as in ``bench_remote.py``) on 127.0.0.1 through
s3fs; every S3 call of the store's client is counted by its operation. An incremental run
(``incremental=True``, four unchanged tensors shared as blobs) keeps ``--checkpoints`` remote
checkpoints (``remote_keep_last``), so from then on each save's upload is followed by the remote
retention deleting one and by the remote blob collection. Reported: the calls of each such save
(the uploader scans the store twice per save, for the retention and for the collection; a
manifest read by an earlier scan of the same store object, with the same listed size, time and
etag, is not fetched again), against the baseline of one scan by a new store object (a
``gc --remote``, a restore, or a collection that fetched every manifest each time), which
fetches every manifest.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_remote import MotoProcess
from common import library_version, write_results

from resilient_callbacks import Checkpointer
from resilient_callbacks.remote import RemoteStore


def counting(fs: Any, counts: collections.Counter) -> None:
    """Count every S3 call ``fs`` (an s3fs filesystem object) makes, by operation."""
    real = fs._call_s3

    async def call(method: str, *a: Any, **k: Any) -> Any:
        counts[method] += 1
        return await real(method, *a, **k)

    fs._call_s3 = call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=int, default=150)
    ap.add_argument("--after", type=int, default=5, help="saves measured once N are kept")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    n = a.checkpoints
    moto = MotoProcess()
    work = tempfile.mkdtemp()
    url = "s3://bench/run"
    counts: collections.Counter = collections.Counter()
    base = {f"t{i}": torch.randn(4096) for i in range(4)}  # unchanged: shared blobs
    per_save = []
    try:
        with Checkpointer(
            os.path.join(work, "local"),
            remote=url,
            remote_options=moto.options,
            keep_last=1,
            remote_keep_last=n,
            incremental=True,
            async_save=False,
        ) as ck:
            assert ck._dir.remote is not None and ck._dir.sync is not None
            counting(ck._dir.remote.fs, counts)
            for s in range(1, n + a.after + 1):
                before = counts.copy()
                ck.save(s, {**base, "x": torch.full((4096,), float(s))})
                assert ck._dir.sync.wait(300)
                if s > n:
                    per_save.append(dict(counts - before))
        fresh: collections.Counter = collections.Counter()
        st = RemoteStore(url, moto.options)
        counting(st.fs, fresh)
        assert len([e for e in st.scan() if e.manifest is not None]) == n
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    ops = sorted({k for d in per_save for k in d} | set(fresh))
    rows = [f"| {op} | {max(d.get(op, 0) for d in per_save)} | {fresh.get(op, 0)} |" for op in ops]
    md = (
        f"# Remote requests per save ({n} remote checkpoints kept, library {library_version()})\n\n"
        "| S3 operation | one save: upload, retention, blob collection (max of "
        f"{len(per_save)}) | one scan by a new store object |\n|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    write_results(
        a.out,
        "bench_remote_requests",
        {"n": n, "per_save": per_save, "fresh_scan": dict(fresh)},
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
