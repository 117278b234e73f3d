"""Do the host buffers allocated ahead of the first save hold up training on a GPU?

    python benchmarks/bench_gpu_stall.py [--mb 1600] [--steps 24] [--rounds 2] [--pin-mb 16]

At the first ``step()`` that does not save, the ``Checkpointer`` starts allocating the pinned
host buffers of its first background save in a helper thread (``snapshot.HostBuffers``), so
the save does not pay for them. On an H200 (2026-12-04, docs/performance.md) one step of the
Transformers Trainer was 0.32 s slower while that happened (1.5 GB, pinned in slabs of up to
256 MB), where the H100 run with one allocation per tensor showed no slower step. This
measures it in a plain loop, each variant in a fresh process (torch's pinned-block cache
empty, as in a new run):

- ``none``: the loop without a ``Checkpointer``;
- ``ahead``: ``Checkpointer(every_n_steps=10**6)`` and ``ck.step()`` after each optimizer step
  (the buffers allocated from step 1; no save);
- ``ahead-64m``: the same, with pinned slabs of at most 64 MiB (``pinned.SLAB_MAX``);
- ``ahead-hostreg``: ``ahead`` with torch's pinned allocator told to ``malloc`` and then
  ``cudaHostRegister`` on 8 threads instead of calling ``cudaHostAlloc``
  (``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8``).
  A torch that does not know the option fails that process; the run goes on and says so.
- ``neighbour``: no ``Checkpointer``; at step 1 *another process* pins the same buffers (as
  ``ahead`` would, in slabs). Page-locking is serialized on driver-global locks, reported to
  stall other processes' CUDA calls (TensorRT-LLM issue 17429): on a node with a rank per GPU,
  every rank pins its buffers at the same step, so this is the stall one rank's pinning causes
  its neighbours.

Each with and without a pinned data path: every step pins ``--pin-mb`` MB of host memory and
copies it to the device, as a ``DataLoader(pin_memory=True)`` does (the Trainer's default), which
takes the same pinned allocator. Every step is synchronized, so a stall of the training thread
shows in its step's time. Reported: the median step, the slowest, and the steps' time beyond
the median, summed (the stall). The bench_gpu.py MLP (``Linear(4096, 4096)`` layers + AdamW).
Writes ``bench_gpu_stall.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from common import device_missing, library_version, med, write_results

VARIANTS = ("none", "ahead", "ahead-64m", "ahead-hostreg", "neighbour")
# the environment of a variant's process, beyond the caller's
ENV = {
    "ahead-hostreg": {
        "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    }
}


def worker(variant: str, pin_mb: int, mb: int, steps: int, device: str, width: int) -> dict:
    from resilient_callbacks import pinned

    cap = pinned.SLAB_MAX
    if variant == "ahead-64m":
        pinned.SLAB_MAX = 64 << 20
    try:
        return _loop(variant, pin_mb, mb, steps, device, width)
    finally:
        pinned.SLAB_MAX = cap  # (as it was, for a caller in the same process)


def specs_of(mb: int, width: int) -> list[tuple[torch.Size, torch.dtype]]:
    """The shapes and dtypes of what ``ahead`` pins for bench_gpu's model of ``mb`` MB: each
    layer's weight and its two AdamW moments."""
    from bench_gpu import layers_for

    return [(torch.Size([width, width]), torch.float32)] * (3 * layers_for(mb, width))


def neighbour(mb: int, width: int, device: str) -> None:
    """The other process of the ``neighbour`` variant: make its CUDA context, say ``ready``,
    wait for ``go`` on stdin, pin the buffers as ``ahead`` does, print the bytes and seconds."""
    from resilient_callbacks import pinned

    cuda = device == "cuda"
    if cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    bufs = pinned.pinned_group(specs_of(mb, width), pin=cuda)
    made = sum(b.numel() * b.element_size() for b in bufs)
    print(json.dumps({"bytes": made, "seconds": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()  # hold the buffers until the measured loop has ended


def _start_neighbour(mb: int, width: int, device: str) -> subprocess.Popen:
    args = ["--mb", str(mb), "--width", str(width), "--device", device, "--pin-neighbour"]
    nb = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert nb.stdout is not None
    line = nb.stdout.readline().strip()
    if line != "ready":
        nb.kill()
        raise RuntimeError(f"the neighbour process did not start: {line!r}")
    return nb


def _tell(nb: subprocess.Popen, word: str) -> None:
    assert nb.stdin is not None
    nb.stdin.write(word + "\n")
    nb.stdin.flush()


def _loop(variant: str, pin_mb: int, mb: int, steps: int, device: str, width: int) -> dict:
    from bench_gpu import build

    from resilient_callbacks import Checkpointer

    model, opt = build(mb, device=device, width=width)
    x = torch.randn(min(8192, max(64, width * 2)), width, device=device)
    host = torch.randn(pin_mb * 250_000) if pin_mb else None  # 4 bytes each
    state = {"model": model, "optimizer": opt}

    def step() -> None:
        if host is not None:  # the data path of a DataLoader with pin_memory=True
            batch = host.pin_memory() if device == "cuda" else host.clone()
            batch.to(device, non_blocking=True)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: kernels, the caching allocator
        step()
    times: list[float] = []
    nb = _start_neighbour(mb, width, device) if variant == "neighbour" else None
    extra: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        ck = (
            None
            if variant in ("none", "neighbour")
            else Checkpointer(d, every_n_steps=10**6, preemption=False)
        )
        for i in range(1, steps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            if nb is not None and i == 1:
                _tell(nb, "go")  # it pins while the steps run
            t0 = time.perf_counter()
            step()
            if ck is not None:
                ck.step(i, state)  # at step 1: the buffers' allocation starts in a thread
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if ck is not None:
            ck._saver.buffers.wait_allocated()  # (allocated within the run: asserted below)
            made = sum(b.numel() * b.element_size() for b in ck._saver.buffers._bufs.values())
            ck.close()
        elif nb is not None:
            assert nb.stdout is not None
            done = json.loads(nb.stdout.readline())  # (it has pinned them all)
            made, extra = done["bytes"], {"neighbour_pin_s": done["seconds"]}
            _tell(nb, "done")
            nb.wait(timeout=60)
        else:
            made = 0
    return {"variant": variant, "pin_mb": pin_mb, "steps_s": times, "buffer_bytes": made, **extra}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (variant, pin_mb): the medians over rounds of each run's median step, slowest step
    and excess (the steps' time beyond the run's median step, summed)."""
    rows = []
    keys = sorted(
        {(r["variant"], r["pin_mb"]) for r in runs}, key=lambda k: (k[1], VARIANTS.index(k[0]))
    )
    for variant, pin in keys:
        mine = [r for r in runs if r["variant"] == variant and r["pin_mb"] == pin]
        per = []
        for r in mine:
            m = med(r["steps_s"])
            per.append((m, max(r["steps_s"]), sum(max(0.0, t - m) for t in r["steps_s"])))
        rows.append(
            {
                "variant": variant,
                "pin_mb": pin,
                "median_step_s": med([p[0] for p in per]),
                "slowest_step_s": med([p[1] for p in per]),
                "excess_s": med([p[2] for p in per]),
                "buffer_bytes": mine[0]["buffer_bytes"],
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# bench_gpu_stall ({report['gpu']}, torch {report['torch']}, {report['date']}, "
        f"library {report['library']})",
        "",
        f"{report['mb']} MB of state, {report['steps']} steps, medians of {report['rounds']} "
        "fresh processes per variant.",
        "",
        "| variant | pinned data path MB/step | host buffers MB | median step s | slowest step s "
        "| excess s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['variant']} | {r['pin_mb']} | {r['buffer_bytes'] / 1e6:.0f} | "
            f"{r['median_step_s']:.3f} | {r['slowest_step_s']:.3f} | {r['excess_s']:.3f} |"
        )
    for f in report.get("failed", []):
        lines.append(f"\n{f['variant']} (pinned data path {f['pin_mb']} MB) failed: {f['error']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1600)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pin-mb", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu: only to try the script's plumbing")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # VARIANT PIN_MB
    ap.add_argument("--pin-neighbour", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if device_missing(args.device):
        return 2
    if args.pin_neighbour:
        neighbour(args.mb, args.width, args.device)
        return 0
    if args.worker:
        v, pin = args.worker[0], int(args.worker[1])
        print(json.dumps(worker(v, pin, args.mb, args.steps, args.device, args.width)))
        return 0
    runs: list[dict] = []
    failed: list[dict] = []
    common = ["--mb", str(args.mb), "--steps", str(args.steps), "--device", args.device]
    common += ["--width", str(args.width)]
    for rnd in range(args.rounds):
        for pin in (0, args.pin_mb):
            for v in VARIANTS:
                p = subprocess.run(
                    [sys.executable, __file__, *common, "--worker", v, str(pin)],
                    capture_output=True,
                    text=True,
                    env={**os.environ, **ENV.get(v, {})},
                )
                if p.returncode:
                    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
                    print(f"round {rnd} {v} pin {pin} MB: failed ({p.returncode}): {tail}")
                    failed.append({"variant": v, "pin_mb": pin, "error": tail})
                    continue
                r = json.loads(p.stdout.strip().splitlines()[-1])
                if v != "none":
                    assert r["buffer_bytes"] > 0, "no host buffers were allocated ahead"
                runs.append(r)
                print(f"round {rnd} {v} pin {pin} MB: slowest step {max(r['steps_s']):.3f} s")
    report = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "library": library_version(),
        "mb": args.mb,
        "steps": args.steps,
        "rounds": args.rounds,
        "runs": runs,
        "failed": failed,
        "rows": summarize(runs),
    }
    md = markdown(report)
    write_results(args.out, "bench_gpu_stall", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
