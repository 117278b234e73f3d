"""Background (async) saving against the incumbents, in one run: blocking time, persist
throughput, restore, a training loop, and memory across many saves.

    .venv/bin/python benchmarks/bench_async.py [--sizes 256,1536] [--reps 5] \
        [--out benchmarks/results] [--dir DIR] [--plot] [--quick] [--device cuda]

``--device cuda`` runs ``bench_gpu.py`` (these measurements with the state on the GPU, against
the pinned device-to-host floor) with the same sizes, repetitions and directories.

State: an MLP of square ``Linear`` layers plus its AdamW state after one step (parameters +
``exp_avg`` + ``exp_avg_sq``, fp32), about ``--sizes`` MB each (default ~256 MB and ~1.5 GB).
Every figure is the median of ``--reps`` repetitions after one discarded warm-up round; methods
run round-robin within each repetition, so slow drift of a shared machine hits them alike; every
ratio is against a baseline measured right beside it, in the same run, on the same disk (see
"Performance method" in DESIGN.md: absolute times on a shared 2-core machine are noise, ratios
are not). Baselines' files are deleted right after each measurement (at most ~4x the largest
state is on disk at once; the benchmark refuses to start with less free).

Save, per size (blocking = time until the call returns to the training thread; total = until
the checkpoint is durable):

- ``raw write+fsync``: the state's bytes written to one file and fsynced (the disk's limit);
- ``copy_ floor``: ``copy_`` of every state tensor into preallocated host buffers (the
  snapshot's limit);
- ``torch.save+fsync``, ``safetensors.save_file+fsync``;
- ``DCP save``: ``torch.distributed.checkpoint.save`` (single process: torch 2.13 saves without
  a process group, it only warns), of ``get_state_dict(model, optimizer)``;
- ``DCP async_save``: the default stager (a fresh CPU copy per save; the cached stager,
  ``FileSystemWriter(cache_staged_state_dict=True)``, pins memory and fails without a GPU);
  blocking = until ``async_save`` returns, total = until its future completes;
- ours: ``Checkpointer(async_save=False).save`` (sync), ``Checkpointer.save`` in the default
  background mode (blocking and total = ``save`` + ``flush``), and ``overlap_snapshot=True``
  (blocking and total, no training step in between). Each keeps ``keep_last=1``, so retention
  deletes the previous checkpoint inside every save, as in steady state.

Blocking against its floor, per size: ``--pairs`` (10) back-to-back pairs of our background
save and a ``copy_`` of the same tensors into the very host buffers that save uses, alternating
which goes first (see ``bench_blocking_pairs`` for why this sits beside the round-robin).

Restore, per size, each repetition in a fresh process (a freshly built model and an optimizer
with empty state as targets; timed: load, then write every element of every model and
optimizer tensor once, as the first optimizer step does, so lazily mapped data is really loaded
and a mapping's copy-on-write pages are copied, for every method):
``Checkpointer.restore`` (verifies every checksum), ``torch.load(mmap=True, weights_only=True)``
+ ``load_state_dict``, and DCP ``load`` (with ``get_state_dict``/``set_state_dict``, DCP's recipe
for an optimizer with empty state). Twice: with the files in the page cache (after a discarded
warm-up), and cold, every file dropped from the page cache (``posix_fadvise(DONTNEED)``) before
each restore, as on a fresh node after a failure.

Training loop, at the smallest size (``--loop-mb``; at ~1.5 GB one AdamW step alone takes 2-3 s
on a 2-core machine, far from the 0.3-1 s wanted): forward/backward + AdamW step of the same MLP
on a batch calibrated so one step takes ~``--step-target`` (0.5 s), ``--loop-steps`` steps (22)
with a checkpoint every ``--every`` steps (5: saves at 5, 10, 15, 20; the tail steps let the last
background save overlap training, as in a long run); total time including waiting for the last
checkpoint to be durable; for no checkpointing, ``torch.save``+fsync, DCP ``async_save``
(waiting for the previous future before the next save, as its docs recommend), ours (background)
and ours (overlapped); ``--loop-rounds`` (2) runs of each, interleaved, median. Blocking per save
= the whole call on a save step (``ck.step``, or the save code of a baseline), including any wait
for the previous save to finish; stall per save = the save step's time plus the next step's
(where the overlapped copy is waited for, in the optimizer pre-step hook) minus two plain steps.

Memory: in a fresh process per method, RSS (psutil) after each of ``--rss-saves`` (30)
consecutive saves of the smallest state without flushing in between (ours: the bounded queue
waits for the previous save; DCP: ``.result()`` of the previous future first); growth after the
first save as a % of the state size.

Goals (from the issue, at the largest size, as ratios in this run) are checked at the end and
printed with met/missed.

Writes ``bench_async.json`` and ``bench_async.md`` (and with ``--plot``, ``bench_async.png``)
into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from common import apply_quick, fsync_path, library_version, med, write_results
from safetensors.torch import save_file

from resilient_callbacks import Checkpointer

warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")

PAGE = 4096


# --------------------------------------------------------------------------- the state


def width_for(mb: int) -> int:
    return 2048 if mb >= 128 else 512


def build_model(mb: int) -> torch.nn.Module:
    """Square Linear layers holding about ``mb`` MB of state once AdamW has stepped (12 bytes
    per parameter: the parameter, exp_avg and exp_avg_sq, fp32)."""
    width = width_for(mb)
    layers = max(1, mb * 1_000_000 // 12 // (width * width + width))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def build_state(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width_for(mb))).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for s in opt.state.values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def nbytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- helpers


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def evict(path: str) -> None:
    """Drop every file under ``path`` from the page cache (``posix_fadvise(DONTNEED)``; no root
    needed), so the next read comes from the disk, as after a reboot or on a fresh node."""
    for root, _, files in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class Method:
    """One measured method: ``fn`` returns named seconds; ``setup``/``cleanup`` are untimed."""

    def __init__(
        self,
        fn: Callable[[], dict[str, float]],
        setup: Callable[[], Any] | None = None,
        cleanup: Callable[[], Any] | None = None,
    ) -> None:
        self.fn, self.setup, self.cleanup = fn, setup, cleanup


def round_robin(methods: list[Method], reps: int) -> dict[str, list[float]]:
    """``reps + 1`` rounds; each round runs every method once, in order (so slow drift of a
    shared machine hits every method alike); the first round is a discarded warm-up."""
    out: dict[str, list[float]] = {}
    for i in range(reps + 1):
        for m in methods:
            if m.setup:
                m.setup()
            r = m.fn()
            if m.cleanup:
                m.cleanup()
            if i:
                for k, v in r.items():
                    out.setdefault(k, []).append(v)
    return out


# --------------------------------------------------------------------------- save section


def bench_saves(
    model: torch.nn.Module, opt: torch.optim.Optimizer, work: str, reps: int
) -> dict[str, list[float]]:
    """Every save method, round-robin. Files of the baselines are deleted right after each
    measurement; each of our three Checkpointers keeps its newest checkpoint (``keep_last=1``:
    retention deletes the previous one after each commit, as in steady state), so at most
    ~4x the state is on disk at once. Leaves ``ours/`` (background mode) for the restores."""
    import torch.distributed.checkpoint as dcp

    tensors = state_tensors(model, opt)
    state = {"model": model, "optimizer": opt}
    methods: list[Method] = []

    raw_p = os.path.join(work, "raw.bin")

    def raw() -> dict[str, float]:
        t0 = time.perf_counter()
        with open(raw_p, "wb", buffering=0) as f:
            for t in tensors:
                if not t.numel():
                    continue
                mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(mv), 16 << 20):
                    f.write(mv[i : i + (16 << 20)])
            os.fsync(f.fileno())
        return {"raw write+fsync": time.perf_counter() - t0}

    methods.append(Method(raw, cleanup=lambda: rm(raw_p)))

    bufs = [torch.empty_like(t) for t in tensors]

    def copy_floor() -> dict[str, float]:
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t)
        return {"copy_ floor": time.perf_counter() - t0}

    pt = os.path.join(work, "torch_bench.pt")

    def tsave() -> dict[str, float]:
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
        fsync_path(pt)
        return {"torch.save+fsync": time.perf_counter() - t0}

    methods.append(Method(tsave, cleanup=lambda: rm(pt)))

    st = os.path.join(work, "st.safetensors")
    flat = {f"m.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                flat[f"o.{i}.{k}"] = v if v.dim() else v.reshape(1)

    def stsave() -> dict[str, float]:
        t0 = time.perf_counter()
        save_file(flat, st)
        fsync_path(st)
        return {"safetensors.save_file+fsync": time.perf_counter() - t0}

    methods.append(Method(stsave, cleanup=lambda: rm(st)))

    dcp_dir = os.path.join(work, "dcp_bench")

    def dsave() -> dict[str, float]:
        t0 = time.perf_counter()
        dcp.save(dcp_state(model, opt), checkpoint_id=dcp_dir)
        return {"DCP save": time.perf_counter() - t0}

    methods.append(Method(dsave, cleanup=lambda: rm(dcp_dir)))

    dcp_async_dir = os.path.join(work, "dcp_async")

    def dasync() -> dict[str, float]:
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=dcp_async_dir)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        return {"DCP async_save (blocking)": t1 - t0, "DCP async_save (total)": t2 - t0}

    methods.append(Method(dasync, cleanup=lambda: (rm(dcp_async_dir), gc.collect())))

    counter = iter(range(1, 1_000_000))
    ck_sync = Checkpointer(
        os.path.join(work, "ours_sync"), keep_last=1, async_save=False, preemption=False
    )

    def sync_save() -> dict[str, float]:
        t0 = time.perf_counter()
        ck_sync.save(next(counter), state)
        return {"ours sync save": time.perf_counter() - t0}

    methods.append(Method(sync_save))

    cks = {
        "async": Checkpointer(os.path.join(work, "ours"), keep_last=1, preemption=False),
        "overlapped": Checkpointer(
            os.path.join(work, "ours_overlap"), keep_last=1, preemption=False, overlap_snapshot=True
        ),
    }

    def bg_save(mode: str) -> dict[str, float]:
        ck = cks[mode]
        t0 = time.perf_counter()
        ck.save(next(counter), state)
        t1 = time.perf_counter()
        ck.flush()
        t2 = time.perf_counter()
        return {f"ours {mode} save (blocking)": t1 - t0, f"ours {mode} save (total)": t2 - t0}

    # copy_ floor right before our background save: the pair the first goal compares runs
    # back to back in every round
    methods.append(Method(lambda: bg_save("overlapped")))
    methods.append(Method(copy_floor))
    methods.append(Method(lambda: bg_save("async")))

    results = round_robin(methods, reps)
    for mode, ck in cks.items():
        results[f"ours {mode} save (blocking_seconds attr)"] = list(ck.blocking_seconds)[-reps:]
        ck.close()
    ck_sync.close()
    rm(os.path.join(work, "ours_sync"))
    rm(os.path.join(work, "ours_overlap"))
    for k, v in results.items():
        print(f"    {k:46} median {med(v):8.3f} s", flush=True)
    return results


def bench_blocking_pairs(
    model: torch.nn.Module, opt: torch.optim.Optimizer, work: str, pairs: int
) -> dict[str, list[float]]:
    """Our background save's blocking time against the ``copy_`` floor into the *same* host
    buffers, back to back, ``pairs`` times, alternating which goes first.

    Why beside the round-robin: on the shared VMs this was developed on, host memory that sat
    untouched while other work ran (our snapshot buffers are touched once per round there) is
    several times slower to write the next time (0.3-1.1 s instead of 0.12 s for 1.5 GB, for our
    buffers and for the floor's alike; see docs/performance.md). Copying into the very buffers
    the save then uses, right beside it, compares the save with its physical limit under the
    same conditions; the alternation keeps the order from favouring either."""
    from resilient_callbacks import structure

    state = {"model": model, "optimizer": opt}
    ck = Checkpointer(os.path.join(work, "ours_pairs"), keep_last=1, preemption=False)
    counter = iter(range(1, 1_000_000))
    ck.save(next(counter), state)  # allocates the buffers (the first save's cost, not measured)
    ck.flush()
    shared, local = structure.encode(state, split_per_rank=False)
    named = {**local.tensors, **shared.tensors}
    out: dict[str, list[float]] = {"pairs: copy_ floor": [], "pairs: ours async save": []}

    def floor() -> None:
        t0 = time.perf_counter()
        for name, t in named.items():
            ck._buffers.get(name, t).copy_(t)  # the buffers the snapshot copies into
        out["pairs: copy_ floor"].append(time.perf_counter() - t0)

    def ours() -> None:
        t0 = time.perf_counter()
        ck.save(next(counter), state)
        out["pairs: ours async save"].append(time.perf_counter() - t0)
        ck.flush()

    for i in range(pairs):
        for fn in (floor, ours) if i % 2 == 0 else (ours, floor):
            fn()
    ck.close()
    rm(os.path.join(work, "ours_pairs"))
    for k, v in out.items():
        print(f"    {k:46} median {med(v):8.3f} s", flush=True)
    return out


def write_restore_sources(model: torch.nn.Module, opt: torch.optim.Optimizer, work: str) -> None:
    """The torch.save file and the DCP checkpoint the restores read (ours/ is already there)."""
    import torch.distributed.checkpoint as dcp

    p = os.path.join(work, "torch.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, p)
    fsync_path(p)
    dcp.save(dcp_state(model, opt), checkpoint_id=os.path.join(work, "dcp"))


# --------------------------------------------------------------------------- restore section


def restore_worker(method: str, work: str, mb: int) -> None:
    import torch.distributed.checkpoint as dcp

    model = build_model(mb)  # same shapes; values are overwritten by the restore
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # empty state, as at a real resume
    gc.collect()
    parts: dict[str, float] = {}
    if method == "ours_1thread":  # the control: checksums verified by one thread, as before
        import resilient_callbacks.checksum

        resilient_callbacks.checksum.MAX_THREADS = 1
    t0 = time.perf_counter()
    if method in ("ours", "ours_1thread"):
        ck = Checkpointer(os.path.join(work, "ours"), preemption=False)
        t1 = time.perf_counter()
        step = ck.restore({"model": model, "optimizer": opt})
        t2 = time.perf_counter()
        ck.close()
        parts = {"open": t1 - t0, "restore": t2 - t1, "close": time.perf_counter() - t2}
        assert step > 0, "nothing restored"
    elif method == "torch_mmap":
        sd = torch.load(os.path.join(work, "torch.pt"), mmap=True, weights_only=True)
        t1 = time.perf_counter()
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        parts = {"torch.load": t1 - t0, "load_state_dict": time.perf_counter() - t1}
    elif method == "dcp":
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = dcp_state(model, opt)  # allocates the optimizer state (a zero-lr optimizer step)
        t1 = time.perf_counter()
        dcp.load(sd, checkpoint_id=os.path.join(work, "dcp"))
        t2 = time.perf_counter()
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        parts = {
            "get_state_dict (optimizer-state init)": t1 - t0,
            "dcp.load": t2 - t1,
            "set_state_dict": time.perf_counter() - t2,
        }
    else:
        raise SystemExit(f"unknown restore method {method}")
    tensors = state_tensors(model, opt)
    t3 = time.perf_counter()
    with torch.no_grad():
        for t in tensors:  # as the first optimizer step writes them: pages copied, if mapped
            t.mul_(1)
    end = time.perf_counter()
    parts["write every element (as the first step does)"] = end - t3
    if len(opt.state) != len(list(model.parameters())):
        raise SystemExit(f"{method}: optimizer state not restored")
    print(json.dumps({"seconds": end - t0, "parts": parts, "bytes": nbytes_of(tensors)}))


COLD = " [cold]"
RESTORE_METHODS = [
    ("ours restore (verified)", "ours"),
    ("torch.load(mmap)+load_state_dict", "torch_mmap"),
    ("DCP load (+get/set_state_dict)", "dcp"),
]


def bench_restores(
    work: str,
    mb: int,
    reps: int,
    cold: bool = False,
    methods: list[tuple[str, str]] = RESTORE_METHODS,
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Each repetition in a fresh process; methods round-robin, the order rotated each round;
    the first round (which also warms the page cache) is discarded. ``cold``: every file is dropped from the page cache
    before each restore. Returns seconds and the median of each part."""
    results: dict[str, list[float]] = {}
    parts: dict[str, dict[str, list[float]]] = {}
    suffix = COLD if cold else ""
    for i in range(reps + 1):
        k = i % len(methods)  # each method goes first in turn: no method always follows another
        for label, method in methods[k:] + methods[:k]:
            name = label + suffix
            if cold:
                evict(work)
            out = subprocess.run(
                [sys.executable, __file__, "--worker", "restore", method, work, "--mb", str(mb)],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise RuntimeError(f"restore worker {method} failed:\n{out.stdout}\n{out.stderr}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if i:
                results.setdefault(name, []).append(r["seconds"])
                for k, v in r["parts"].items():
                    parts.setdefault(name, {}).setdefault(k, []).append(v)
    for label, _ in methods:
        print(f"    {label + suffix:46} median {med(results[label + suffix]):8.3f} s", flush=True)
    return results, {n: {k: med(v) for k, v in p.items()} for n, p in parts.items()}


# --------------------------------------------------------------------------- training loop


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def calibrate_batch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, width: int, target: float
) -> tuple[int, float]:
    def step_time(b: int) -> float:
        x = torch.randn(b, width)
        train_step(model, opt, x)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            train_step(model, opt, x)
            ts.append(time.perf_counter() - t0)
        return med(ts)

    lo, hi = 4, 64
    t_lo, t_hi = step_time(lo), step_time(hi)
    per = max((t_hi - t_lo) / (hi - lo), 1e-6)
    fixed = max(t_lo - per * lo, 0.0)
    b = round((target - fixed) / per) if target > fixed else 1
    b = min(max(b, 1), 1024)
    return b, step_time(b)


def run_loop(
    kind: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    n_steps: int,
    every: int,
    work: str,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    d = os.path.join(work, "loop_" + kind.replace(" ", "_").replace(".", "_"))
    os.makedirs(d, exist_ok=True)
    state = {"model": model, "optimizer": opt}
    ck = None
    if kind.startswith("ours"):
        ck = Checkpointer(
            os.path.join(d, "ck"),
            every_n_steps=every,
            keep_last=2,
            preemption=False,
            overlap_snapshot=kind == "ours overlapped",
            # metrics on: every metric kept current and handed to a sink (a callable: what
            # every sink costs the training thread; the sink itself runs in its own thread)
            telemetry=(lambda values: None) if kind == "ours async +metrics" else None,
        )
    fut = None
    blocking: list[float] = []
    times: list[float] = []
    saved_at: list[int] = []
    t_start = time.perf_counter()
    for step in range(1, n_steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, x)
        due = step % every == 0
        if due and kind == "torch.save":
            tb = time.perf_counter()
            p = os.path.join(d, f"step{step}.pt")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, p)
            fsync_path(p)
            rm(os.path.join(d, f"step{step - every}.pt"))
            blocking.append(time.perf_counter() - tb)
        elif due and kind == "DCP async_save":
            tb = time.perf_counter()
            if fut is not None:
                fut.result()  # at most one in flight, as DCP's docs recommend
            rm(os.path.join(d, f"step{step - 2 * every}"))
            fut = dcp.async_save(
                dcp_state(model, opt), checkpoint_id=os.path.join(d, f"step{step}")
            )
            blocking.append(time.perf_counter() - tb)
        elif ck is not None:
            tb = time.perf_counter()
            if ck.step(step, state):
                # the training thread's whole wait, including any wait for the previous save
                # to finish (ck.blocking_seconds counts only the snapshot after that wait)
                blocking.append(time.perf_counter() - tb)
        if due and kind != "none":
            saved_at.append(step)
        times.append(time.perf_counter() - t0)
    t_end_steps = time.perf_counter()
    if fut is not None:
        fut.result()
    if ck is not None:
        ck.flush()
    t_done = time.perf_counter()
    out: dict[str, Any] = {
        "total_s": t_done - t_start,
        "final_wait_s": t_done - t_end_steps,
        "step_s": times,
        "saved_at": saved_at,
    }
    out["blocking_s"] = blocking
    if ck is not None:
        out["blocking_seconds_attr"] = list(ck.blocking_seconds)
        out["waits_for_previous"] = ck.waits_for_previous
        out["committed_saves"] = ck.committed_saves
        ck.close()
        del ck
    gc.collect()
    rm(d)
    return out


LOOP_KINDS = [
    "none",
    "torch.save",
    "DCP async_save",
    "ours async",
    "ours async +metrics",
    "ours overlapped",
]


def bench_loop(
    model: torch.nn.Module, opt: torch.optim.Optimizer, mb: int, work: str, args: Any
) -> dict[str, Any]:
    """``--loop-rounds`` rounds of every kind (order reversed every other round, so drift of a
    shared machine hits every kind alike); per kind the median total over rounds."""
    width = width_for(mb)
    batch, step_s = calibrate_batch(model, opt, width, args.step_target)
    print(f"    batch {batch}: one training step ~{step_s:.3f} s", flush=True)
    torch.manual_seed(1)
    x = torch.randn(batch, width)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in LOOP_KINDS}
    for rnd in range(args.loop_rounds):
        for kind in LOOP_KINDS if rnd % 2 == 0 else LOOP_KINDS[::-1]:
            r = run_loop(kind, model, opt, x, args.loop_steps, args.every, work)
            runs[kind].append(r)
            print(
                f"    round {rnd + 1} {kind:16} total {r['total_s']:7.2f} s  "
                f"(final wait {r['final_wait_s']:.2f} s)",
                flush=True,
            )
    base_total = med([r["total_s"] for r in runs["none"]])
    plain = med([t for r in runs["none"] for t in r["step_s"]])
    summary: dict[str, Any] = {}
    for kind in LOOP_KINDS[1:]:
        rs = runs[kind]
        total = med([r["total_s"] for r in rs])
        stalls = [
            r["step_s"][s - 1] + r["step_s"][s] - 2 * plain
            for r in rs
            for s in r["saved_at"]
            if s < len(r["step_s"])
        ]
        summary[kind] = {
            "total_s": total,
            "totals_s": [r["total_s"] for r in rs],
            "overhead_s": total - base_total,
            "overhead_pct": 100 * (total - base_total) / base_total,
            "saves_per_run": len(rs[0]["saved_at"]),
            "median_blocking_s": med([b for r in rs for b in r["blocking_s"]]),
            "median_stall_per_save_s": med(stalls),
            "median_final_wait_s": med([r["final_wait_s"] for r in rs]),
            "waits_for_previous": sum(r.get("waits_for_previous", 0) for r in rs),
        }
    on = [r["total_s"] for r in runs["ours async +metrics"]]
    off = [r["total_s"] for r in runs["ours async"]]
    metrics = {  # metrics on vs off: the same loop, every metric kept current and sent to a sink
        "total_ratio": med(on) / med(off),
        "per_round_ratios": [a / b for a, b in zip(on, off, strict=True)],
    }
    return {
        "metrics_on_off": metrics,
        "mb": mb,
        "batch": batch,
        "calibrated_step_s": step_s,
        "plain_step_median_s": plain,
        "steps": args.loop_steps,
        "every": args.every,
        "rounds": args.loop_rounds,
        "no_checkpoint_totals_s": [r["total_s"] for r in runs["none"]],
        "no_checkpoint_total_s": base_total,
        "summary": summary,
        "runs": runs,
    }


# --------------------------------------------------------------------------- memory


def rss_worker(method: str, work: str, mb: int, n: int) -> None:
    import torch.distributed.checkpoint as dcp

    model, opt = build_state(mb)
    state_b = nbytes_of(state_tensors(model, opt))
    gc.collect()
    base = rss_bytes()
    series: list[int] = []
    d = os.path.join(work, f"rss_{method}")
    t0 = time.perf_counter()
    if method == "ours":
        ck = Checkpointer(d, keep_last=2, preemption=False)
        for i in range(1, n + 1):
            ck.save(i, {"model": model, "optimizer": opt})  # the bounded queue waits
            series.append(rss_bytes())
        ck.flush()
        final = rss_bytes()
        ck.close()
    else:
        fut = None
        for i in range(1, n + 1):
            if fut is not None:
                fut.result()
            rm(os.path.join(d, f"step{i - 2}"))
            fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=os.path.join(d, f"step{i}"))
            series.append(rss_bytes())
        assert fut is not None
        fut.result()
        final = rss_bytes()
    elapsed = time.perf_counter() - t0
    rm(d)
    print(
        json.dumps(
            {
                "state_bytes": state_b,
                "baseline_rss": base,
                "rss_after_each_save": series,
                "rss_after_flush": final,
                "seconds": elapsed,
            }
        )
    )


def bench_rss(work: str, mb: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"saves": n, "mb": mb}
    for name, method in (("ours async", "ours"), ("DCP async_save", "dcp")):
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                "rss",
                method,
                work,
                "--mb",
                str(mb),
                "--rss-saves",
                str(n),
            ],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise RuntimeError(f"rss worker {method} failed:\n{p.stdout}\n{p.stderr}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        s = r["rss_after_each_save"]
        r["growth_bytes"] = s[-1] - s[0]
        r["growth_pct_of_state"] = 100 * (s[-1] - s[0]) / r["state_bytes"]
        r["first_save_extra_pct_of_state"] = 100 * (s[0] - r["baseline_rss"]) / r["state_bytes"]
        r["peak_growth_pct_of_state"] = 100 * (max(s) - s[0]) / r["state_bytes"]
        out[name] = r
        print(
            f"    {name:18} RSS after save 1: {s[0] / 1e6:8.0f} MB, after save {n}: "
            f"{s[-1] / 1e6:8.0f} MB ({r['growth_pct_of_state']:+.1f}% of state; "
            f"save 1 added {r['first_save_extra_pct_of_state']:.0f}% of state)",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------- report


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    big = report["sizes"][str(max(int(k) for k in report["sizes"]))]
    m = big["median_s"]
    nb = big["state_bytes"]
    blocking = m["ours async save (blocking)"]
    total = m["ours async save (total)"]
    persist = total - blocking
    raw = m["raw write+fsync"]
    rows = []

    def row(name: str, value: float, target: str, met: bool, detail: str) -> None:
        rows.append(
            {"goal": name, "value": value, "target": target, "met": bool(met), "detail": detail}
        )

    a = big["all_s"]
    pb, pf = m["pairs: ours async save"], m["pairs: copy_ floor"]
    r = pb / pf
    rr = med(
        [b / c for b, c in zip(a["ours async save (blocking)"], a["copy_ floor"], strict=True)]
    )
    pr = med(
        [b / c for b, c in zip(a["pairs: ours async save"], a["pairs: copy_ floor"], strict=True)]
    )
    row(
        "blocking / copy_ floor",
        r,
        "<= 1.5",
        r <= 1.5,
        f"back to back into the same buffers, {len(a['pairs: copy_ floor'])} pairs: save() "
        f"blocks {pb:.3f} s, copy_ {pf:.3f} s (median per-pair ratio {pr:.2f}); "
        f"in the round-robin (separate buffers, each touched once a round) {blocking:.3f} s vs "
        f"{m['copy_ floor']:.3f} s, median per-round ratio {rr:.2f}",
    )
    r = blocking / m["torch.save+fsync"]
    row(
        "blocking / torch.save+fsync",
        r,
        "<= 0.15",
        r <= 0.15,
        f"{blocking:.3f} s vs {m['torch.save+fsync']:.3f} s",
    )
    r = blocking / m["DCP async_save (blocking)"]
    row(
        "blocking / DCP async_save blocking",
        r,
        "<= 0.5",
        r <= 0.5,
        f"{blocking:.3f} s vs {m['DCP async_save (blocking)']:.3f} s",
    )
    r = raw / persist if persist > 0 else float("inf")
    row(
        "persist throughput / raw write+fsync",
        r,
        ">= 0.8",
        r >= 0.8,
        f"background persist {nb / persist / 1e9:.2f} GB/s ({persist:.3f} s = total - blocking) "
        f"vs raw {nb / raw / 1e9:.2f} GB/s ({raw:.3f} s)",
    )
    for suffix, where in (("", "page cache warm"), (COLD, "cold: files evicted first")):
        key = "ours restore (verified)" + suffix
        if key not in m:
            continue
        ro, rt = m[key], m["torch.load(mmap)+load_state_dict" + suffix]
        r = ro / rt
        row(
            f"restore / torch.load(mmap)+load_state_dict ({where})",
            r,
            "<= 1.2",
            r <= 1.2,
            f"{ro:.3f} s vs {rt:.3f} s (every element written once; ours verifies every checksum); "
            f"DCP load {m['DCP load (+get/set_state_dict)' + suffix]:.3f} s",
        )
    rss = report["rss"]["ours async"]
    g = rss["growth_pct_of_state"]
    row(
        f"RSS growth save 1 -> {report['rss']['saves']} (% of state, {report['rss']['mb']} MB)",
        g,
        "<= 5%",
        g <= 5,
        f"ours {rss['growth_bytes'] / 1e6:+.0f} MB; DCP async_save "
        f"{report['rss']['DCP async_save']['growth_pct_of_state']:+.1f}%",
    )
    lp = report["loop"]
    loop = lp["summary"]
    dcp_ov = loop["DCP async_save"]["overhead_pct"]
    for kind in ("ours async", "ours overlapped"):
        ov = loop[kind]["overhead_pct"]
        row(
            f"training-loop overhead, {kind} (%, {lp['state_bytes'] / 1e9:.2f} GB state)",
            ov,
            f"<= DCP async_save ({dcp_ov:.1f}%)",
            ov <= dcp_ov,
            f"{loop[kind]['overhead_s']:.2f} s vs {loop['DCP async_save']['overhead_s']:.2f} s "
            f"per run of {lp['steps']} steps ({loop[kind]['saves_per_run']} saves); stall/save "
            f"{loop[kind]['median_stall_per_save_s']:.3f} s vs "
            f"{loop['DCP async_save']['median_stall_per_save_s']:.3f} s",
        )
    return rows


SAVE_ROWS = [
    ("raw write+fsync", "raw write+fsync of the same bytes (disk limit)"),
    ("copy_ floor", "copy_ into preallocated host buffers (snapshot floor)"),
    ("torch.save+fsync", "torch.save + fsync"),
    ("safetensors.save_file+fsync", "safetensors.save_file + fsync"),
    ("DCP save", "DCP save"),
    ("DCP async_save (blocking)", "DCP async_save: blocking"),
    ("DCP async_save (total)", "DCP async_save: total"),
    ("ours sync save", "**ours** sync save (async_save=False)"),
    ("ours async save (blocking)", "**ours** async save: blocking"),
    ("ours async save (total)", "**ours** async save: total (save + flush)"),
    ("ours overlapped save (blocking)", "**ours** overlapped: blocking"),
    ("ours overlapped save (total)", "**ours** overlapped: total"),
]


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# bench_async: {meta['cpus']} CPUs, torch {meta['torch']}, medians of {meta['reps']} "
        f"(load average at start {meta['loadavg_start']}, end {meta.get('loadavg_end')}), "
        f"library {meta.get('library')}, runtime {meta.get('runtime_s', 0):.0f} s",
        "",
    ]
    for mb, s in report["sizes"].items():
        m, nb = s["median_s"], s["state_bytes"]
        ts = m["torch.save+fsync"]
        lines += [
            f"## Save, state {nb / 1e9:.2f} GB (--sizes {mb})",
            "",
            "| method | median s | min-max s | GB/s | vs torch.save+fsync | vs raw write+fsync "
            "| vs copy_ floor |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, label in SAVE_ROWS:
            v = m[key]
            xs = s["all_s"][key]
            lines.append(
                f"| {label} | {v:.3f} | {min(xs):.3f}-{max(xs):.3f} | {nb / v / 1e9:.2f} | "
                f"{v / ts:.2f}x | "
                f"{v / m['raw write+fsync']:.2f}x | {v / m['copy_ floor']:.2f}x |"
            )
        rt = m["torch.load(mmap)+load_state_dict"]
        lines += [
            "",
            f"## Restore, state {nb / 1e9:.2f} GB (fresh process, every element written once)",
            "",
            "| method | median s | GB/s | vs torch.load(mmap)+load_state_dict | median parts, s |",
            "|---|---|---|---|---|",
        ]
        keys = [k for k, _ in RESTORE_METHODS]
        keys += [k + COLD for k in keys if k + COLD in m]
        for key in keys:
            v = m[key]
            rt = m["torch.load(mmap)+load_state_dict" + (COLD if key.endswith(COLD) else "")]
            parts = ", ".join(
                f"{k} {x:.3f}" for k, x in s.get("restore_parts_median_s", {}).get(key, {}).items()
            )
            lines.append(f"| {key} | {v:.3f} | {nb / v / 1e9:.2f} | {v / rt:.2f}x | {parts} |")
        lines += [
            "",
            f"Blocking vs its floor, back to back into the same host buffers "
            f"({len(s['all_s']['pairs: copy_ floor'])} pairs, alternating order): save() "
            f"{m['pairs: ours async save']:.3f} s, copy_ {m['pairs: copy_ floor']:.3f} s "
            f"({m['pairs: ours async save'] / m['pairs: copy_ floor']:.2f}x).",
            "",
        ]
    lp = report["loop"]
    lines += [
        f"## Training loop, state {lp['state_bytes'] / 1e9:.2f} GB: {lp['steps']} steps, "
        f"checkpoint every {lp['every']}, batch {lp['batch']}, plain step "
        f"{lp['plain_step_median_s']:.3f} s, median of {lp['rounds']} runs each; no "
        f"checkpointing: {lp['no_checkpoint_total_s']:.2f} s ("
        + " / ".join(f"{t:.2f}" for t in lp["no_checkpoint_totals_s"])
        + ")",
        "",
        "| checkpointing | total s (runs) | overhead s | overhead % | vs DCP async_save overhead "
        "| saves/run | median blocking s | median stall/save s | final wait s "
        "| saves that waited for the previous |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    dcp_ov = lp["summary"]["DCP async_save"]["overhead_s"]
    for kind, r in lp["summary"].items():
        rel = r["overhead_s"] / dcp_ov if dcp_ov > 0 else float("nan")
        runs = " / ".join(f"{t:.2f}" for t in r["totals_s"])
        lines.append(
            f"| {kind} | {r['total_s']:.2f} ({runs}) | {r['overhead_s']:.2f} | "
            f"{r['overhead_pct']:.1f} | {rel:.2f}x | {r['saves_per_run']} | "
            f"{r['median_blocking_s']:.3f} | {r['median_stall_per_save_s']:.3f} | "
            f"{r['median_final_wait_s']:.2f} | "
            + (
                f"{r['waits_for_previous']} of {r['saves_per_run'] * lp['rounds']}"
                if kind.startswith("ours")
                else ""
            )
            + " |"
        )
    mo = lp.get("metrics_on_off")
    if mo:
        lines += [
            "",
            f"Metrics on/off (`telemetry=` a sink vs none, same loop): total time ratio "
            f"{mo['total_ratio']:.3f} (per round: "
            + ", ".join(f"{x:.3f}" for x in mo["per_round_ratios"])
            + ")",
        ]
    rs = report["rss"]
    lines += [
        "",
        f"## RSS across {rs['saves']} consecutive background saves, state "
        f"{rs['ours async']['state_bytes'] / 1e9:.2f} GB",
        "",
        "| method | RSS before MB | after save 1 MB | after save "
        f"{rs['saves']} MB | growth % of state | peak growth % | save 1 added % of state |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("ours async", "DCP async_save"):
        r = rs[name]
        s = r["rss_after_each_save"]
        lines.append(
            f"| {name} | {r['baseline_rss'] / 1e6:.0f} | {s[0] / 1e6:.0f} | {s[-1] / 1e6:.0f} | "
            f"{r['growth_pct_of_state']:+.1f} | {r['peak_growth_pct_of_state']:+.1f} | "
            f"{r['first_save_extra_pct_of_state']:.0f} |"
        )
    lines += [
        "",
        f"## Goals (state {report['goals_state_bytes'] / 1e9:.2f} GB unless noted)",
        "",
        "| goal | figure | target | | detail |",
        "|---|---|---|---|---|",
    ]
    for g in report["goals"]:
        lines.append(
            f"| {g['goal']} | {g['value']:.3g} | {g['target']} | "
            f"{'met' if g['met'] else '**missed**'} | {g['detail']} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    ax = axes[0]
    keys = [k for k, _ in SAVE_ROWS]
    sizes = list(report["sizes"])
    h = 0.8 / len(sizes)
    for j, mb in enumerate(sizes):
        m = report["sizes"][mb]["median_s"]
        vals = [m[k] / m["torch.save+fsync"] for k in keys]
        ax.barh(
            [i + j * h for i in range(len(keys))],
            vals,
            height=h,
            label=f"{report['sizes'][mb]['state_bytes'] / 1e9:.2f} GB",
        )
    ax.set_yticks([i + h * (len(sizes) - 1) / 2 for i in range(len(keys))])
    ax.set_yticklabels(keys, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("median time / torch.save+fsync")
    ax.set_title("save")
    ax.legend()

    ax = axes[1]
    lp = report["loop"]["summary"]
    ax.bar(list(lp), [r["overhead_pct"] for r in lp.values()], color="tab:orange")
    ax.set_ylabel("training-loop overhead vs no checkpointing (%)")
    ax.set_title(f"training loop, checkpoint every {report['loop']['every']} steps")
    ax.tick_params(axis="x", labelrotation=20)

    ax = axes[2]
    rs = report["rss"]
    for name in ("ours async", "DCP async_save"):
        s = rs[name]["rss_after_each_save"]
        ax.plot(range(1, len(s) + 1), [v / 1e6 for v in s], marker=".", label=name)
    ax.set_xlabel("save #")
    ax.set_ylabel("RSS after save() returns (MB)")
    ax.set_title(f"memory, {rs['ours async']['state_bytes'] / 1e9:.2f} GB state")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "METHOD", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="256,1536", help="state sizes in MB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    ap.add_argument("--plot", action="store_true", help="also write bench_async.png")
    ap.add_argument(
        "--quick", action="store_true", help="small sizes, 2 reps: a smoke test (options given win)"
    )
    ap.add_argument("--loop-steps", type=int, default=22, help="steps per training-loop run")
    ap.add_argument("--loop-rounds", type=int, default=2, help="runs of each loop kind")
    ap.add_argument(
        "--loop-mb",
        type=int,
        default=None,
        help="state size of the training loop (default: the smallest of --sizes; at ~1.5 GB one "
        "AdamW step alone takes seconds on a 2-core machine)",
    )
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-target", type=float, default=0.5, help="seconds per training step")
    ap.add_argument("--rss-saves", type=int, default=30)
    ap.add_argument(
        "--pairs", type=int, default=10, help="back-to-back blocking vs copy_ floor pairs"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: state on the GPU; runs benchmarks/bench_gpu.py, these measurements on CUDA "
        "(the pinned device-to-host floor, ours in both modes, torch.save, DCP async_save with "
        "its default and its pinned asynchronous staging, a training loop, warm restore) with "
        "--sizes, --reps, --out and --dir",
    )
    args = ap.parse_args()
    if args.quick:
        apply_quick(ap, args, sizes="16,48", reps=2, loop_steps=6, every=2, step_target=0.05)
        apply_quick(ap, args, rss_saves=5, pairs=2)
    if args.device == "cuda":
        gpu = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_gpu.py")
        forwarded = ["--sizes", args.sizes, "--reps", str(args.reps), "--out", args.out]
        forwarded += ["--dir", args.dir] if args.dir else []
        return subprocess.call([sys.executable, gpu, *forwarded])
    torch.set_flush_denormal(True)
    if args.worker:
        kind, method, work = args.worker
        if kind == "restore":
            restore_worker(method, work, args.mb)
        else:
            rss_worker(method, work, args.mb, args.rss_saves)
        return 0
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("bench_async needs psutil: .venv/bin/pip install -e '.[dev]'", file=sys.stderr)
        return 2
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    loop_mb = args.loop_mb if args.loop_mb is not None else sizes[0]
    if loop_mb not in sizes:
        sizes = sorted({*sizes, loop_mb})
    work = tempfile.mkdtemp(prefix="rc-bench-async-", dir=args.dir)
    need = 4 * max(sizes) * 1_000_000
    free = shutil.disk_usage(work).free
    if free < need:
        shutil.rmtree(work, ignore_errors=True)
        print(
            f"refusing to run: {free / 1e9:.1f} GB free under {work}, the benchmark needs at "
            f"least {need / 1e9:.1f} GB (4x the largest state). Pass --dir on a larger disk or "
            "smaller --sizes.",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "meta": {
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "reps": args.reps,
            "sizes_mb": sizes,
            "quick": args.quick,
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "workdir": work,
            "library": library_version(),
        },
        "sizes": {},
    }
    print(f"bench_async: sizes {sizes} MB, {args.reps} reps, writing under {work}", flush=True)
    try:
        for mb in sizes:
            gc.collect()
            t_size = time.perf_counter()
            model, opt = build_state(mb)
            nb = nbytes_of(state_tensors(model, opt))
            print(f"  state {nb / 1e9:.2f} GB (--sizes {mb}): save, round-robin", flush=True)
            times = bench_saves(model, opt, work, args.reps)
            gc.collect()  # the snapshot and copy buffers of the save section
            print(f"  blocking vs copy_ into the same buffers ({args.pairs} pairs)", flush=True)
            times.update(bench_blocking_pairs(model, opt, work, args.pairs))
            gc.collect()
            write_restore_sources(model, opt, work)
            print("  restore (fresh process each, round-robin)", flush=True)
            rtimes, rparts = bench_restores(work, mb, args.reps)
            times.update(rtimes)
            if hasattr(os, "posix_fadvise"):
                print("  restore from a cold page cache (files evicted before each)", flush=True)
                rtimes, cparts = bench_restores(work, mb, args.reps, cold=True)
                times.update(rtimes)
                rparts.update(cparts)
            for p in ("torch.pt", "dcp", "ours"):
                rm(os.path.join(work, p))
            report["sizes"][str(mb)] = {
                "state_bytes": nb,
                "median_s": {k: med(v) for k, v in times.items()},
                "all_s": times,
                "restore_parts_median_s": rparts,
                "section_s": time.perf_counter() - t_size,
            }
            if mb == loop_mb:
                t_loop = time.perf_counter()
                print(f"  training loop ({mb} MB state, {args.loop_rounds} rounds)", flush=True)
                loop = bench_loop(model, opt, mb, work, args)
                loop["state_bytes"] = nb
                loop["section_s"] = time.perf_counter() - t_loop
                report["loop"] = loop
            model = opt = None
        gc.collect()
        t_rss = time.perf_counter()
        print(
            f"  RSS across {args.rss_saves} saves ({sizes[0]} MB, fresh process each)", flush=True
        )
        report["rss"] = bench_rss(work, sizes[0], args.rss_saves)
        report["rss"]["section_s"] = time.perf_counter() - t_rss
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["goals_state_bytes"] = report["sizes"][str(sizes[-1])]["state_bytes"]
    report["goals"] = goals(report)
    report["meta"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["meta"]["runtime_s"] = time.perf_counter() - t_start
    md = markdown(report)
    write_results(args.out, "bench_async", report, md)
    if args.plot:
        plot(report, os.path.join(args.out, "bench_async.png"))
    print()
    print(md)
    missed = [g for g in report["goals"] if not g["met"]]
    for g in missed:
        print(f"MISSED: {g['goal']}: {g['value']:.3g} (goal {g['target']}): {g['detail']}")
    print(f"runtime {report['meta']['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
