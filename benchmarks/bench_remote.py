"""The remote tier against a raw s3fs upload and against no remote, in one run.

    .venv/bin/python benchmarks/bench_remote.py [--mb 256] [--reps 5] [--loop-rounds 3] \
        [--out benchmarks/results] [--quick]

A real S3 API server (moto, in its own process at nice 19 so it neither shares the benchmark's
GIL nor competes with training for the CPUs, as a store on other machines would not) on
127.0.0.1, reached through s3fs, as in the tests. State: the MLP + AdamW state of
``bench_async.py`` (~``--mb`` MB, fp32).

Upload throughput (``--reps`` repetitions, round-robin, median): one committed checkpoint of the
state on local disk is uploaded

- ours: ``RemoteStore.upload`` (what the background uploader runs: every file through s3fs's
  concurrent ``put`` with parallel multipart parts, then the listing check of every size, then
  the manifest last);
- raw: ``s3fs.put`` of the same files to the same server (the same concurrency, no checks, no
  manifest ordering);

each to a fresh prefix that is deleted right after. Goal: ours >= 0.8x raw throughput.

Training-blocking time: the training loop of ``bench_async.py`` (forward/backward + AdamW step
calibrated to ~``--step-target`` s) for ``--loop-steps`` steps with a background save every
``--every`` steps, with and without ``remote=`` (keep_last=2 on both tiers), ``--loop-rounds``
interleaved runs each. Blocking = the whole ``ck.step`` call on save steps; loop time = the
steps, without the final wait (for the remote run, ``close()`` then waits for the uploads; that
time is reported apart). Goal: blocking with remote <= 1.05x without.

Writes ``bench_remote.json`` and ``bench_remote.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_async import build_state, calibrate_batch, train_step
from common import apply_quick, library_version, med, write_results

from resilient_callbacks import Checkpointer
from resilient_callbacks.manifest import read_manifest
from resilient_callbacks.remote import RemoteStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoProcess:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # The server stands in for a store on other machines: at the lowest priority, its
            # CPU use (parsing, hashing and keeping every byte in memory) takes what training
            # leaves, instead of competing with it as no real S3 endpoint would.
            preexec_fn=lambda: os.nice(19),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.2)
        self.options = {
            "endpoint_url": f"http://127.0.0.1:{self.port}",
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.options["endpoint_url"],
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def bench_upload(mb: int, reps: int, work: str, server: MotoProcess) -> dict[str, Any]:
    model, opt = build_state(mb)
    local = os.path.join(work, "upload_src")
    with Checkpointer(local, async_save=False, preemption=False) as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        path = ck.last_save.path if ck.last_save else ""
    manifest = read_manifest(path)
    nbytes = manifest.total_bytes
    store = RemoteStore("s3://bench/upload", server.options)
    fs = store.fs
    files = [f.path for f in manifest.files]
    times: dict[str, list[float]] = {"ours": [], "raw s3fs put": []}
    print(f"  upload: {nbytes / 1e6:.0f} MB in {len(files)} files", flush=True)
    for rep in range(reps + 1):  # the first round is a discarded warm-up
        for name in ["ours", "raw s3fs put"] if rep % 2 == 0 else ["raw s3fs put", "ours"]:
            prefix = f"r{rep}-{'ours' if name == 'ours' else 'raw'}"
            t0 = time.perf_counter()
            if name == "ours":
                store.upload(path, manifest, prefix)
            else:
                fs.put(
                    [os.path.join(path, f) for f in files],
                    [f"bench/upload/{prefix}/{f}" for f in files],
                )
            dt = time.perf_counter() - t0
            fs.rm(f"bench/upload/{prefix}", recursive=True)
            if rep:
                times[name].append(dt)
                print(f"    {name:14} {dt:7.3f} s  {nbytes / dt / 1e6:7.1f} MB/s", flush=True)
    shutil.rmtree(local, ignore_errors=True)
    ours, raw = med(times["ours"]), med(times["raw s3fs put"])
    return {
        "bytes": nbytes,
        "seconds": times,
        "ours_MBps": nbytes / ours / 1e6,
        "raw_MBps": nbytes / raw / 1e6,
        "ratio": raw / ours,
    }


def run_loop(
    remote: bool,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    every: int,
    work: str,
    server: MotoProcess,
    tag: str,
) -> dict[str, Any]:
    d = os.path.join(work, f"loop_{tag}")
    kw: dict[str, Any] = {}
    if remote:
        kw = {"remote": f"s3://bench/loop-{tag}", "remote_options": server.options}
    ck = Checkpointer(d, every_n_steps=every, keep_last=2, preemption=False, **kw)
    state = {"model": model, "optimizer": opt}
    blocking: list[float] = []
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(model, opt, x)
        tb = time.perf_counter()
        if ck.step(step, state):
            blocking.append(time.perf_counter() - tb)
    t_loop = time.perf_counter() - t_start
    t0 = time.perf_counter()
    ck.close()
    t_close = time.perf_counter() - t0
    uploaded = 0
    if remote:
        store = RemoteStore(f"s3://bench/loop-{tag}", server.options)
        uploaded = sum(1 for e in store.scan() if e.manifest is not None and e.problem is None)
        store.fs.rm(f"bench/loop-{tag}", recursive=True)
    shutil.rmtree(d, ignore_errors=True)
    return {
        "loop_s": t_loop,
        "close_s": t_close,
        "blocking_s": blocking,
        "remote_checkpoints": uploaded,
    }


def bench_loop(
    mb: int, rounds: int, steps: int, every: int, target: float, work: str, server: MotoProcess
) -> dict[str, Any]:
    model, opt = build_state(mb)
    width = model[0].in_features
    batch, step_s = calibrate_batch(model, opt, width, target)
    x = torch.randn(batch, width)
    print(f"  loop: batch {batch}, one step {step_s:.3f} s, save every {every}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"without remote": [], "with remote": []}
    for r in range(rounds):
        order = (
            ["without remote", "with remote"] if r % 2 == 0 else ["with remote", "without remote"]
        )
        for kind in order:
            out = run_loop(kind == "with remote", model, opt, x, steps, every, work, server, f"{r}")
            runs[kind].append(out)
            print(
                f"    {kind:15} loop {out['loop_s']:7.2f} s  blocking/save "
                f"{med(out['blocking_s']):.3f} s  close {out['close_s']:.2f} s",
                flush=True,
            )
    summary = {}
    for kind, outs in runs.items():
        summary[kind] = {
            "loop_s": med([o["loop_s"] for o in outs]),
            "blocking_per_save_s": med([b for o in outs for b in o["blocking_s"]]),
            "blocking_total_s": med([sum(o["blocking_s"]) for o in outs]),
            "close_s": med([o["close_s"] for o in outs]),
        }
    w, wo = summary["with remote"], summary["without remote"]
    return {
        "batch": batch,
        "step_s": step_s,
        "runs": runs,
        "summary": summary,
        "blocking_ratio": w["blocking_total_s"] / wo["blocking_total_s"],
        "loop_ratio": w["loop_s"] / wo["loop_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loop-rounds", type=int, default=3)
    ap.add_argument("--loop-steps", type=int, default=22)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-target", type=float, default=0.5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--quick",
        action="store_true",
        help="64 MB, 2 reps, 1 round (a smoke run; options given win)",
    )
    args = ap.parse_args()
    if args.quick:
        apply_quick(ap, args, mb=64, reps=2, loop_rounds=1, loop_steps=12)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    server = MotoProcess()
    work = tempfile.mkdtemp(prefix="bench_remote_")
    try:
        print(f"bench_remote: {args.mb} MB state, S3 API server on port {server.port}")
        upload = bench_upload(args.mb, args.reps, work, server)
        loop = bench_loop(
            args.mb, args.loop_rounds, args.loop_steps, args.every, args.step_target, work, server
        )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    goals = [
        ("upload throughput vs raw s3fs put", upload["ratio"], ">= 0.8", upload["ratio"] >= 0.8),
        (
            "training-blocking time with remote vs without",
            loop["blocking_ratio"],
            "<= 1.05",
            loop["blocking_ratio"] <= 1.05,
        ),
    ]
    result = {
        "args": vars(args),
        "version": library_version(),
        "cpus": os.cpu_count(),
        "upload": upload,
        "loop": loop,
        "goals": [{"what": g[0], "ratio": g[1], "goal": g[2], "met": g[3]} for g in goals],
    }
    s = loop["summary"]
    lines = [
        f"# bench_remote ({args.mb} MB state, {os.cpu_count()} CPUs, {library_version()})",
        "",
        "| upload | MB/s (median) |",
        "|---|---:|",
        f"| ours (`RemoteStore.upload`: checks + manifest last) | {upload['ours_MBps']:.1f} |",
        f"| raw `s3fs.put` of the same files | {upload['raw_MBps']:.1f} |",
        "",
        "| training loop | loop s | blocking/save s | blocking total s | close s |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("without remote", "with remote"):
        k = s[kind]
        lines.append(
            f"| {kind} | {k['loop_s']:.2f} | {k['blocking_per_save_s']:.3f} | "
            f"{k['blocking_total_s']:.3f} | {k['close_s']:.2f} |"
        )
    lines += ["", "| goal | ratio | target | |", "|---|---:|---|---|"]
    lines += [f"| {g[0]} | {g[1]:.2f} | {g[2]} | {'met' if g[3] else 'MISSED'} |" for g in goals]
    text = "\n".join(lines) + "\n"
    write_results(args.out, "bench_remote", result, text)
    print()
    print(text)


if __name__ == "__main__":
    main()
