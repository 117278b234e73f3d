"""Requests each remote operation sends to an incremental run's store, counted (not timed:
counts do not depend on the machine's load).

    .venv/bin/python benchmarks/bench_remote_ops.py [--checkpoints 30] [--tensors 70] \
        [--out benchmarks/results]

A real S3 API server (moto's ``ThreadedMotoServer``) on 127.0.0.1, reached through s3fs and a
proxy that counts every HTTP request by kind (``tests/flaky_proxy.py``). An incremental run
(``incremental=True``) of ``--tensors`` tensors, every one changed at every save, keeps
``--checkpoints`` remote checkpoints: ``checkpoints x tensors`` content-addressed blobs under
``blobs/`` (2,100 by default) beside the checkpoint folders. Counted, each from a new process's
point of view (a new store object, nothing cached):

- ``scan``: ``RemoteStore(url).scan()``, what every remote listing goes through;
- ``ls --remote``: ``resilient-ckpt ls DIR --remote URL`` (DIR empty);
- ``resume``: ``Checkpointer(empty dir, remote=url).restore(state)``, the auto-resume's search
  and download of the newest checkpoint;
- ``save``: one more save of the run (the uploader's object, as in a long run): its upload,
  the remote retention deleting the oldest checkpoint and the blob collection; then a save
  that changes only 2 tensors (2 new blobs).
- ``gc --remote``: ``resilient-ckpt gc DIR --remote URL --keep-last N-1``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import shutil
import sys
import tempfile
from urllib.parse import unquote

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import torch
from common import library_version, write_results

from flaky_proxy import FlakyProxy
from resilient_callbacks import Checkpointer
from resilient_callbacks.cli import main as cli
from resilient_callbacks.remote import RemoteStore


def kind(method: str, query: str) -> str:
    if method == "GET" and "list-type" in query:
        prefix = dict(q.partition("=")[::2] for q in query.split("&")).get("prefix", "")
        rel = unquote(prefix).split("/", 1)[1] if "/" in unquote(prefix) else ""
        top = rel.split("/")[0]
        return "LIST " + ("whole store" if not rel else "blobs/" if top == "blobs" else "a folder")
    if method == "GET":
        return "GET"
    if method == "POST" and "delete" in query:
        return "DELETE (batch)"
    return method


class Counter:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.keys = 0

    def rule(self, method: str, path: str, query: str) -> None:
        self.counts[kind(method, query)] += 1
        return None

    def take(self) -> dict[str, int]:
        out, self.counts = dict(self.counts), collections.Counter()
        return out


def state(n: int, step: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((4096,), float(step * 1000 + i)) for i in range(n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=int, default=30)
    ap.add_argument("--tensors", type=int, default=70)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    count = Counter()
    proxy = FlakyProxy(f"http://{host}:{port}", count.rule)
    opts = {
        "endpoint_url": proxy.endpoint,
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,  # every RemoteStore a new client, nothing cached
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    url, n = "s3://bench/run", a.checkpoints
    work = tempfile.mkdtemp()
    ops: dict[str, dict[str, int]] = {}
    try:
        with Checkpointer(
            os.path.join(work, "run"),
            remote=url,
            remote_options=opts,
            keep_last=1,
            remote_keep_last=n,
            incremental=True,
            async_save=False,
        ) as ck:
            for s in range(1, n + 1):
                ck.save(s, state(a.tensors, s))
                assert ck._dir.sync is not None and ck._dir.sync.wait(600)
            count.take()
            ck.save(n + 1, state(a.tensors, n + 1))
            assert ck._dir.sync.wait(600)
            ops["save (upload, retention, blob collection)"] = count.take()
            few = {**state(a.tensors, n + 1), "t0": torch.full((4096,), -1.0)}
            few["t1"] = torch.full((4096,), -2.0)
            ck.save(n + 2, few)  # 2 of the tensors changed: 2 new blobs among thousands
            assert ck._dir.sync.wait(600)
            ops["save changing 2 tensors (upload, retention, blob collection)"] = count.take()
        count.take()
        st = RemoteStore(url, opts)
        entries = st.scan()
        assert len([e for e in entries if e.committed and e.problem is None]) == n, entries
        ops["scan (a new store object)"] = count.take()
        empty = os.path.join(work, "empty")
        os.makedirs(empty)
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli(["ls", empty, "--remote", url, *_o(opts)]) == 0
        ops["ls DIR --remote URL"] = count.take()
        with Checkpointer(os.path.join(work, "fresh"), remote=url, remote_options=opts) as ck2:
            assert ck2.restore(state(a.tensors, 0)) == n + 2
        ops["resume from the remote (search and download)"] = count.take()
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli(["gc", empty, "--remote", url, "--keep-last", str(n - 1), *_o(opts)])
        assert rc == 0, rc
        ops["gc DIR --remote URL --keep-last N-1"] = count.take()
        blobs = len([p for p in st.fs.find(st._path("blobs")) if "/." not in p])
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    kinds = sorted({k for d in ops.values() for k in d})
    md = (
        f"# Remote requests per operation ({n} checkpoints, {blobs} blobs after the run, "
        f"library {library_version()})\n\n| operation | "
        + " | ".join(kinds)
        + " | all |\n|---|"
        + "---:|" * (len(kinds) + 1)
        + "\n"
        + "\n".join(
            f"| {op} | " + " | ".join(str(d.get(k, 0)) for k in kinds) + f" | {sum(d.values())} |"
            for op, d in ops.items()
        )
        + "\n"
    )
    write_results(a.out, "bench_remote_ops", {"n": n, "blobs": blobs, "ops": ops}, md)
    print(md)


def _o(opts: dict) -> list[str]:
    return [
        "-o",
        f"endpoint_url={opts['endpoint_url']}",
        "-o",
        "key=bench",
        "-o",
        "secret=bench",
        "-o",
        'client_kwargs={"region_name": "us-east-1"}',
        "-o",
        "skip_instance_cache=true",
    ]


if __name__ == "__main__":
    main()
