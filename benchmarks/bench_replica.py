"""Peak host memory of a replica transfer (``replicas=1``, :func:`resilient_callbacks.peers.exchange`)
for one large file, by piece size: two gloo processes on this machine send each other the same
checkpoint folder (one file of ``--mib`` MiB) and store the copy. Each mode runs in fresh
processes; reported: each rank's peak RSS over its RSS before the exchange (``ru_maxrss``), and
the seconds. ``whole``: one piece the size of the file (what the transfer held before pieces:
the whole file, on each end); ``64mib``: :data:`peers.CHUNK_BYTES`'s default. Memory is exact,
seconds are noise on a shared machine (medians of ``--reps``, the order rotated).

    python benchmarks/bench_replica.py --mib 512 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

from common import med, round_robin

MODES = {"whole": None, "64mib": 64 << 20}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(rank: int, port: int, src: str, into: str, chunk: int) -> None:
    import datetime

    import torch.distributed as dist

    from resilient_callbacks import peers

    peers.CHUNK_BYTES = chunk
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    other = 1 - rank
    dist.barrier()
    before = _rss_mib()
    t0 = time.perf_counter()
    got = peers.exchange(src, other, other, into, None)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.barrier()
    dist.destroy_process_group()
    assert got is not None
    print("RESULT " + json.dumps({"extra_mib": peak - before, "seconds": seconds}), flush=True)


def make_checkpoint(root: str, mib: int) -> str:
    from resilient_callbacks.filewrite import digest_file, write_json
    from resilient_callbacks.manifest import MANIFEST_NAME, FileEntry, Manifest

    path = os.path.join(root, "step_000000001")
    os.makedirs(path)
    block = os.urandom(1 << 20)
    with open(os.path.join(path, "rank_00000.safetensors"), "wb") as f:
        for _ in range(mib):
            f.write(block)
    d = digest_file(os.path.join(path, "rank_00000.safetensors"))
    m = Manifest(1, "bench", 1, 1, [FileEntry("rank_00000.safetensors", d.size, d.xxh3_64)])
    write_json(os.path.join(path, MANIFEST_NAME), m.to_json())
    return path


def run_mode(mode: str, src: str, work: str, mib: int) -> dict[str, float]:
    chunk = MODES[mode] or (mib << 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    into = tempfile.mkdtemp(dir=work)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                str(r),
                str(port),
                src,
                f"{into}/{r}",
                str(chunk),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    subprocess.run(["rm", "-rf", into], check=True)
    return {
        "seconds": max(r["seconds"] for r in results),
        "extra_mib": max(r["extra_mib"] for r in results),
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        r, port, src, into, chunk = sys.argv[2:]
        child(int(r), int(port), src, into, int(chunk))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as work:
        src = make_checkpoint(work, a.mib)
        runs = round_robin(tuple(MODES), a.reps, lambda m, _: run_mode(m, src, work, a.mib))
    print(f"file {a.mib} MiB, {a.reps} rep(s); peak RSS over RSS before (max of the 2 ranks)")
    for mode, rs in runs.items():
        extra = med([r["extra_mib"] for r in rs])
        secs = med([r["seconds"] for r in rs])
        print(f"{mode:8s} extra {extra:8.0f} MiB   {secs:6.2f} s")


if __name__ == "__main__":
    main()
