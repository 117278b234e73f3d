"""Scale of the node-local commit protocol, by simulation (issue 20; docs/scale.md).

Drives the real protocol code -- each rank's :class:`RankReport`, each node leader's node
manifest and :class:`NodeUploader` upload + check, the coordinator's merge
(:func:`global_files`), global manifest and :class:`RemoteCommitter` commit (listing + manifest
last) -- for 8 ... 4096 simulated ranks (8 per node) against a local fake object store
(``file://``), counting every object-store request the way S3 would bill it (a PUT per object,
a HEAD per ``info``, a LIST per 1,000 keys listed, a GET per read) and every message of the
collectives (a gather to the leader, a gather of leaders to the coordinator, two broadcasts).

Reports per checkpoint: coordinator time (merge + manifest + commit) and peak memory
(tracemalloc), messages and bytes (total, per rank, at the coordinator), requests (total, per
rank, per prefix) -- and, as the baseline measured on the same reports, what the shared-dirpath
protocol's all-gather (every rank receives every report) would move.

    python benchmarks/bench_scale.py [--ranks 8,64,512,4096] [--per-node 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))

from common import library_version, write_results

from resilient_callbacks.filewrite import encode_json, write_bytes
from resilient_callbacks.manifest import FileEntry, Manifest
from resilient_callbacks.node_files import global_files
from resilient_callbacks.remote import RemoteStore
from resilient_callbacks.remote_commit import (
    NodeUploader,
    PendingCommit,
    RemoteCommitter,
    UploadCounters,
    UploadJob,
)
from resilient_callbacks.remote_owned import OwnCheckpoints
from resilient_callbacks.retention import RetentionPolicy
from resilient_callbacks.session import RankReport


class Counting:
    """Wraps a store's filesystem: S3-style request counts per operation and per prefix."""

    def __init__(self, fs: Any) -> None:
        self.fs, self.counts, self.by_prefix = fs, {"PUT": 0, "HEAD": 0, "LIST": 0, "GET": 0}, {}

    def _count(self, op: str, n: int, path: str = "") -> None:
        self.counts[op] += n
        prefix = "/".join(path.split("/")[:-1])
        self.by_prefix[prefix] = self.by_prefix.get(prefix, 0) + n

    def put(self, lpaths: list[str], rpaths: list[str], **kw: Any) -> Any:
        for r in rpaths:
            self._count("PUT", 1, r)
        return self.fs.put(lpaths, rpaths, **kw)

    def pipe_file(self, path: str, data: bytes, **kw: Any) -> Any:
        self._count("PUT", 1, path)
        return self.fs.pipe_file(path, data, **kw)

    def info(self, path: str, **kw: Any) -> Any:
        self._count("HEAD", 1, path)
        return self.fs.info(path, **kw)

    def find(self, path: str, **kw: Any) -> Any:
        out = self.fs.find(path, **kw)
        self._count("LIST", max(1, math.ceil(len(out) / 1000)), path + "/x")
        return out

    def cat_file(self, path: str, **kw: Any) -> Any:
        self._count("GET", 1, path)
        return self.fs.cat_file(path, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def simulate(n_ranks: int, per_node: int, file_bytes: int, root: str) -> dict[str, Any]:
    nodes = [list(range(i, min(i + per_node, n_ranks))) for i in range(0, n_ranks, per_node)]
    store = RemoteStore(f"file://{root}/remote")
    counting = Counting(store.fs)
    store.fs = counting  # type: ignore[assignment]
    name, key = "step_000000100", ("bench", 1)
    msgs = {"rank_to_leader": 0, "leader_to_coord": 0, "broadcast": 0}
    bytes_ = {"rank_to_leader": 0, "leader_to_coord": 0, "broadcast": 0}
    node_msgs: list[dict[str, Any]] = []
    # 1. ranks write and report to their leader; leaders commit the node and upload it
    for k, ranks in enumerate(nodes):
        local = os.path.join(root, f"node{k}", name)
        os.makedirs(local)
        reports = []
        for r in ranks:
            files = []
            names = [f"rank_{r:05d}.json", f"rank_{r:05d}.safetensors"]
            if r == ranks[0]:
                names += ["shared.json", "shared.safetensors"]
            for fname in names:
                d = write_bytes(os.path.join(local, fname), os.urandom(file_bytes))
                files.append(FileEntry(fname, d.size, d.xxh3_64, r, "tensors"))
            rep = json.dumps(RankReport(r, files).to_json())
            msgs["rank_to_leader"] += 1
            bytes_["rank_to_leader"] += len(rep)
            reports.append(RankReport.from_json(json.loads(rep)))
        files = [f for rep in reports for f in rep.files]
        mine = [f for f in files if not (f.path.startswith("shared.") and f.rank != 0)]
        up = NodeUploader.__new__(NodeUploader)  # the upload itself, without its thread
        up.store, up.local_root, up.node = store, os.path.join(root, f"node{k}"), k
        up._reports, up.counters, up._uploaded = [], UploadCounters(), {}
        import threading

        up._cond = threading.Condition()
        up._upload(UploadJob(name, name, key, mine))
        msg = json.dumps(
            {
                "failed": [],
                "files": [f.__dict__ for f in files],
                "path": name,
                "uploads": up._reports,
            }
        )
        msgs["leader_to_coord"] += 1
        bytes_["leader_to_coord"] += len(msg)
        node_msgs.append(json.loads(msg))
    outcome = json.dumps({"ok": True, "seq": 1, "name": name, "renamed": {}})
    msgs["broadcast"] += 2 * n_ranks  # begin and outcome: one receive per rank
    bytes_["broadcast"] += 2 * n_ranks * len(outcome)
    uploads_counts = dict(counting.counts)
    # 2. the coordinator: merge, global manifest, reports, remote commit (timed, traced)
    committer = RemoteCommitter.__new__(RemoteCommitter)
    committer.store, committer.nodes = store, len(nodes)
    committer.policy = RetentionPolicy(keep_last=None)
    committer._pending, committer._ready, committer.index = {}, [], {}
    committer.own = OwnCheckpoints(store.url)  # what its remote retention may count and delete
    import threading

    committer._cond = threading.Condition()
    tracemalloc.start()
    t0 = time.perf_counter()
    files = global_files([FileEntry(**f) for g in node_msgs for f in g["files"]])
    m = Manifest(step=100, run_id="bench", seq=1, world_size=n_ranks, files=files)
    data = encode_json(m.to_json())
    committer._pending[key] = PendingCommit(name, data)
    for k, g in enumerate(node_msgs):
        for rep in g["uploads"]:
            committer.report(k, rep)
    assert committer._ready == [key], "every node reported"
    committer.commit_one(committer._pending[key])
    coord_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert os.path.exists(os.path.join(root, "remote", name, "manifest.json"))
    total_req = sum(counting.counts.values())
    n_msgs = sum(msgs.values())
    allgather_bytes_per_rank = bytes_["rank_to_leader"]  # every rank would receive every report
    return {
        "ranks": n_ranks,
        "nodes": len(nodes),
        "coordinator_s": coord_s,
        "coordinator_peak_mb": peak / 1e6,
        "manifest_kb": len(data) / 1e3,
        "messages": n_msgs,
        "messages_per_rank": n_msgs / n_ranks,
        "coordinator_messages_in": len(nodes),
        "coordinator_bytes_in": bytes_["leader_to_coord"],
        "bytes_per_rank_in": (bytes_["broadcast"] / n_ranks),
        "allgather_bytes_per_rank_in": allgather_bytes_per_rank,
        "requests": dict(counting.counts),
        "requests_total": total_req,
        "requests_per_rank": total_req / n_ranks,
        "requests_coordinator": total_req - sum(uploads_counts.values()),
        "max_requests_one_prefix": max(counting.by_prefix.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,512,4096")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--file-bytes", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        root = tempfile.mkdtemp(prefix="rc-scale-")
        try:
            rows.append(simulate(n, args.per_node, args.file_bytes, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r = rows[-1]
        print(
            f"{r['ranks']:>5} ranks {r['nodes']:>4} nodes: coordinator {r['coordinator_s'] * 1e3:8.1f} ms "
            f"{r['coordinator_peak_mb']:6.2f} MB peak, manifest {r['manifest_kb']:7.1f} kB; "
            f"messages {r['messages']:>6} ({r['messages_per_rank']:.2f}/rank), coordinator in "
            f"{r['coordinator_messages_in']:>4} msgs {r['coordinator_bytes_in'] / 1e3:8.1f} kB; "
            f"bytes in per rank {r['bytes_per_rank_in']:.0f} (all-gather baseline "
            f"{r['allgather_bytes_per_rank_in'] / 1e3:.1f} kB); requests {r['requests_total']:>6} "
            f"({r['requests_per_rank']:.2f}/rank, coordinator {r['requests_coordinator']}, "
            f"max on one prefix {r['max_requests_one_prefix']}) {r['requests']}",
            flush=True,
        )
    base = rows[0]
    for r in rows[1:]:
        g = r["ranks"] / base["ranks"]
        print(
            f"x{g:.0f} ranks: coordinator time x{r['coordinator_s'] / base['coordinator_s']:.1f}, "
            f"memory x{r['coordinator_peak_mb'] / base['coordinator_peak_mb']:.1f}, "
            f"messages/rank x{r['messages_per_rank'] / base['messages_per_rank']:.2f}, "
            f"requests/rank x{r['requests_per_rank'] / base['requests_per_rank']:.2f}"
        )
    if args.out:
        md = "| ranks | nodes | coord ms | coord MB | msgs/rank | req/rank | req total |\n"
        md += "|---|---|---|---|---|---|---|\n" + "".join(
            f"| {r['ranks']} | {r['nodes']} | {r['coordinator_s'] * 1e3:.1f} | "
            f"{r['coordinator_peak_mb']:.2f} | {r['messages_per_rank']:.2f} | "
            f"{r['requests_per_rank']:.2f} | {r['requests_total']} |\n"
            for r in rows
        )
        write_results(args.out, "bench_scale", {"version": library_version(), "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
