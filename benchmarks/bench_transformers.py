"""Training-time overhead of checkpointing a Hugging Face Trainer run: the Trainer's own
``save_steps=K`` against ``ResilientCheckpoint(every_n_steps=K)``, in the same run.

    .venv/bin/python benchmarks/bench_transformers.py [--steps 24] [--every 6] [--reps 3] \
        [--out benchmarks/results] [--dir DIR] [--quick] [--device cuda --batch 16 --seq 512]

Model: a GPT-2 built from a config (no download) whose parameters alone are >= 256 MB in fp32
(``--n-embd 768 --n-layer 4 --vocab 50257``: 67 M parameters, 268 MB; with AdamW's two moments
the saved training state is ~0.8 GB), trained on synthetic tokens (batch 1 x 16 tokens, so one
step is well under a second on a 2-core machine) for ``--steps`` optimizer steps (36: six saves at the default ``--every 6``).

Modes, each a fresh Trainer on the same model/seed, run round-robin within each repetition (so
slow drift of a shared machine hits them alike) and reported as medians over ``--reps``:

- ``no checkpointing``: ``save_strategy="no"``, the baseline;
- ``Trainer save_steps=K``: the Trainer's own checkpoints (``save_total_limit=2``): model
  safetensors, ``optimizer.pt`` (torch.save), scheduler, RNG and trainer state, synchronously;
- ``ResilientCheckpoint every_n_steps=K``: defaults (background saving, ``keep_last=2``);
- ``ResilientCheckpoint overlap_snapshot=True``: the snapshot copy overlaps the next
  forward/backward.

Time of a mode = wall time of ``trainer.train()``; for ResilientCheckpoint that includes waiting,
at the end, until the last checkpoint is durable (``on_train_end`` closes the Checkpointer).
Overhead = time - time without checkpointing, in the same repetition. Per save: the blocking time
of the training loop (the Trainer's ``_save_checkpoint``; ours as logged in
``resilient/save_blocking_s``). Context, measured beside them on the same state: a raw
write+fsync of the state's bytes (the disk's limit) and a ``copy_`` into preallocated buffers
(the snapshot's limit), and how much a plain background write+fsync of the same bytes (buffered,
and with O_DIRECT) slows a training step. Absolute times on a shared machine are noise; the
ratios are the result.

On a GPU (issue 13), ``--device cuda --n-layer 12 --seq 512 --batch 16``: GPT-2 124M, 1.49 GB of
model + AdamW state; the step runs on the GPU, the snapshot's limit is the device-to-host copy
into pinned buffers, and the goal is ours <= 0.1x the Trainer's overhead.

Writes ``bench_transformers.json`` and ``bench_transformers.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import itertools

import torch
import transformers
from common import (
    add_device_option,
    apply_quick,
    device_missing,
    host_copies,
    library_version,
    med,
    round_robin,
    write_results,
)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from resilient_callbacks.transformers import ResilientCheckpoint

GOAL = {"cpu": 0.5, "cuda": 0.1}  # ours / Trainer's, training-time overhead (issues 7, 13)

MODES = ("none", "trainer", "ours", "ours_overlap")
LABELS = {
    "none": "no checkpointing",
    "trainer": "Trainer save_steps=K",
    "ours": "ResilientCheckpoint every_n_steps=K",
    "ours_overlap": "ResilientCheckpoint every_n_steps=K, overlap_snapshot=True",
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class TimedTrainer(Trainer):
    """Records how long each of the Trainer's own checkpoint saves blocks training."""

    save_seconds: list[float]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t0 = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.save_seconds.append(time.perf_counter() - t0)


class SaveTimes(TrainerCallback):
    def __init__(self) -> None:
        self.blocking: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "resilient/save_blocking_s" in logs:
            self.blocking.append(float(logs["resilient/save_blocking_s"]))


class StepClock(TrainerCallback):
    """Wall-clock time at the start of training and at the end of every optimizer step (first in
    the callback list, so a step's end is taken before any checkpoint work of that step)."""

    def __init__(self) -> None:
        self.begin = 0.0
        self.ends: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.ends.append(time.perf_counter())


def add_run_arguments(ap: argparse.ArgumentParser, steps: int) -> None:
    """The run's and the model's options (shared with bench_transformers_fsdp.py)."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-layer", type=int, default=4)


def build_model(a: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=a.vocab,
        n_positions=max(64, a.seq),
        n_embd=a.n_embd,
        n_layer=a.n_layer,
        n_head=12 if a.n_embd % 12 == 0 else 8,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def run_mode(mode: str, a: argparse.Namespace, work: str) -> dict[str, Any]:
    out = os.path.join(work, mode)
    shutil.rmtree(out, ignore_errors=True)
    trainer_saves = mode == "trainer"
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=1e-4,
        logging_steps=a.every,
        save_strategy="steps" if trainer_saves else "no",
        save_steps=a.every,
        save_total_limit=2,
        report_to="none",
        use_cpu=a.device == "cpu",
        disable_tqdm=True,
        seed=0,
    )
    model = build_model(a)
    trainer = TimedTrainer(
        model=model, args=args, train_dataset=Tokens(a.steps * 2 * a.batch, a.seq, a.vocab)
    )
    trainer.save_seconds = []
    clock = StepClock()
    trainer.callback_handler.callbacks.insert(0, clock)
    times = SaveTimes()
    if mode.startswith("ours"):
        trainer.add_callback(
            ResilientCheckpoint(
                os.path.join(out, "ckpt"),
                every_n_steps=a.every,
                keep_last=2,
                overlap_snapshot=mode == "ours_overlap",
                preemption=False,
            )
        )
        trainer.add_callback(times)
    t0 = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    blocking = trainer.save_seconds if trainer_saves else times.blocking
    n_params = sum(p.numel() for p in model.parameters())
    del trainer, model
    shutil.rmtree(out, ignore_errors=True)
    marks = [clock.begin, *clock.ends]
    steps = [b - a for a, b in itertools.pairwise(marks)]
    return {
        "seconds": end - t0,
        "setup_s": clock.begin - t0,  # train() up to the first event
        "steps_s": steps,  # one per optimizer step, including the checkpoint work after it
        "tail_s": end - clock.ends[-1],  # after the last step: finalize (+ waiting for saves)
        "blocking": blocking,
        "params": n_params,
    }


def in_run_overhead(run: dict[str, Any], none_tail: float) -> float:
    """Checkpointing time in one run, measured against that run's own step time: the time of
    all steps plus the tail, minus (number of steps x the run's median step) and the tail of
    the run without checkpoints. Robust to the machine's speed drifting between runs (other
    jobs on a shared machine); steps slowed by background writes count as overhead as far as
    they exceed the median step. It cannot tell a slowdown of most steps from drift: where a
    background write slows more than half the steps, the median absorbs that slowdown, which
    favours a background saver over one that blocks a few steps (the Trainer's). The direct
    measure (train() minus the run without checkpoints) is reported beside it for that reason."""
    steps = run["steps_s"]
    return sum(steps) + run["tail_s"] - len(steps) * med(steps) - none_tail


def state_bytes(a: argparse.Namespace) -> tuple[int, int, float, float]:
    """(model bytes, training-state bytes, raw write+fsync s, copy_ s) of the same state; on
    CUDA, copy_ is the device-to-host copy into preallocated pinned buffers (the snapshot's
    floor)."""
    model = build_model(a).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, a.vocab, (1, a.seq), device=a.device)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    # tied weights (wte / lm_head) are one storage, saved once by both methods
    tensors = list({t.data_ptr(): t for t in model.state_dict().values()}.values())
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    for s in opt.state.values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    del model
    total = sum(t.numel() * t.element_size() for t in tensors)
    tensors, copy_s = host_copies(tensors)
    fd, path = tempfile.mkstemp(dir=a.dir)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for t in tensors:
                f.write(memoryview(t.detach().contiguous().view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        raw_s = time.perf_counter() - t0
    finally:
        os.remove(path)
    return model_bytes, total, raw_s, copy_s


def interference(a: argparse.Namespace, nbytes: int) -> dict[str, float]:
    """Mean training step time alone, and while another thread writes ``nbytes`` to a file and
    fsyncs it (what any background saver does), buffered and with O_DIRECT: the part of a
    background save's cost that lands on the training loop of a machine without idle cores."""
    import mmap
    import threading

    model = build_model(a).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device)

    def step() -> float:
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if a.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    src = torch.ones(nbytes, dtype=torch.uint8).numpy()
    path = os.path.join(a.dir, "interference.bin")
    chunk = 64 << 20

    def buffered() -> None:
        with open(path, "wb", buffering=0) as f:
            for i in range(0, nbytes, chunk):
                f.write(memoryview(src[i : i + chunk]))
            os.fsync(f.fileno())

    def direct() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0))
        aligned = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        try:
            for i in range(0, nbytes, chunk):
                piece = src[i : i + chunk]
                n = len(piece) - len(piece) % 4096
                aligned[:n] = memoryview(piece[:n])
                os.write(fd, memoryview(aligned)[:n])
            os.fsync(fd)
        finally:
            os.close(fd)

    def during(fn: Any) -> tuple[float, float]:
        th = threading.Thread(target=fn)
        t0 = time.perf_counter()
        th.start()
        steps = []
        while th.is_alive():
            steps.append(step())
        th.join()
        return statistics.mean(steps), time.perf_counter() - t0

    for _ in range(2):
        step()
    out: dict[str, list[float]] = {
        k: [] for k in ("alone", "buffered", "buffered_s", "direct", "direct_s")
    }
    try:
        for _ in range(2):
            out["alone"].append(statistics.mean(step() for _ in range(3)))
            mean, secs = during(buffered)
            out["buffered"].append(mean)
            out["buffered_s"].append(secs)
            mean, secs = during(direct)
            out["direct"].append(mean)
            out["direct_s"].append(secs)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {k: med(v) for k, v in out.items()}


def markdown(r: dict[str, Any]) -> str:
    m = r["meta"]
    lines = [
        f"# bench_transformers: {m['device_name']}, {m['cpus']} CPUs, torch {m['torch']}, "
        "transformers "
        f"{m['transformers']}, {m['threads']} training thread(s), medians of {m['reps']} (load average at start {m['load_start']}, "
        f"end {m['load_end']}), library {m['library']}, runtime {m['runtime_s']:.0f} s",
        "",
        f"GPT-2 from a config: {m['params'] / 1e6:.1f} M parameters, model state "
        f"{m['model_bytes'] / 1e6:.0f} MB (fp32), training state with AdamW "
        f"{m['state_bytes'] / 1e6:.0f} MB; batch {m.get('batch', 1)} x {m.get('seq', 16)} "
        f"tokens; {m['steps']} optimizer steps, a checkpoint every "
        f"{m['every']} steps ({m['steps'] // m['every']} saves per run).",
        "",
        "| mode | train() s | median step s | overhead s (in-run) | vs Trainer | "
        "overhead s (run - no-ckpt run) | vs Trainer | blocking per save s (first save) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        s = r["summary"][mode]
        if mode == "none":
            cells = ["-"] * 5
        else:
            cells = [
                f"{s['overhead_s']:.2f}",
                f"**{s['overhead_vs_trainer']:.2f}x**"
                if mode == "ours"
                else f"{s['overhead_vs_trainer']:.2f}x",
                f"{s['overhead_diff_s']:.2f}",
                f"{s['overhead_diff_vs_trainer']:.2f}x",
                f"{s['blocking_per_save_s']:.3f} ({s['first_save_blocking_s']:.3f})",
            ]
        lines.append(
            f"| {LABELS[mode]} | {s['seconds']:.2f} | {s['median_step_s']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    c = r["context"]
    lines += [
        "",
        f"Same state, same disk: raw write+fsync {c['raw_write_fsync_s']:.3f} s "
        f"({c['state_gb'] / c['raw_write_fsync_s']:.2f} GB/s, the disk's limit); copy_ into "
        f"preallocated buffers {c['copy_s']:.3f} s (the snapshot's limit).",
        "",
        "A training step alone: {:.3f} s; while another thread writes the same bytes and fsyncs "
        "(what any background saver does): {:.3f} s (+{:.0f}%) for the {:.2f} s the buffered "
        "write takes; with O_DIRECT: {:.3f} s (+{:.0f}%) for {:.2f} s.".format(
            c["step_alone_s"],
            c["step_during_buffered_write_s"],
            100 * (c["step_during_buffered_write_s"] / c["step_alone_s"] - 1),
            c["buffered_write_fsync_s"],
            c["step_during_direct_write_s"],
            100 * (c["step_during_direct_write_s"] / c["step_alone_s"] - 1),
            c["direct_write_fsync_s"],
        ),
        "",
        "Overhead (in-run) = the run's step times plus its tail (after the last step; for "
        "ResilientCheckpoint that includes waiting until the last checkpoint is durable) minus "
        "steps x the run's own median step time and the tail of the run without checkpoints: "
        "robust to the machine's speed drifting between runs; steps slowed by background "
        "writes count as overhead only as far as they exceed the median step (a slowdown of "
        "most steps reads as drift, which favours a background saver; compare the direct "
        "measure). Overhead (run - no-ckpt run) = train() time minus the "
        "no-checkpointing run of the same repetition: the direct measure, but on a shared machine "
        "the runs' speeds drift by tens of percent. The first save of ours also allocates its "
        "reused host buffers (a one-time cost). The Trainer's own save does not fsync (its "
        "checkpoints may still be in the page cache when training continues); ours are fsynced, "
        "checksummed and committed by a manifest.",
        "",
        "| goal | value | target | met |",
        "|---|---|---|---|",
    ]
    for g in r["goals"]:
        lines.append(
            f"| {g['name']} | {g['value']:.2f} | {g['target']} | {'yes' if g['met'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_run_arguments(ap, steps=36)
    add_device_option(ap)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for training (default 1: the other core stays free for "
        "background work, as the CPU of a GPU machine does; 2 threads on 2 shared cores make "
        "step times swing 5x)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temp dir)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small model, 1 repetition (smoke test; options given win)",
    )
    a = ap.parse_args()
    if device_missing(a.device):
        return 2
    if a.quick:
        apply_quick(ap, a, steps=8, every=4, reps=1, vocab=8000, n_embd=256, n_layer=2)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    t_start = time.time()
    load_start = [round(x, 2) for x in os.getloadavg()]
    base = tempfile.mkdtemp(prefix="bench_transformers-", dir=a.dir)
    a.dir = base
    try:
        model_bytes, total_bytes, raw_s, copy_s = state_bytes(a)
        bg = interference(a, total_bytes)
        run_mode("none", a, base)  # warm-up (imports, allocator), discarded
        runs = round_robin(MODES, a.reps, lambda mode, _rep: run_mode(mode, a, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    summary: dict[str, dict[str, float]] = {}
    diff: dict[str, list[float]] = {m: [] for m in MODES}
    inrun: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(a.reps):
        none = runs["none"][rep]
        for mode in MODES:
            diff[mode].append(runs[mode][rep]["seconds"] - none["seconds"])
            inrun[mode].append(in_run_overhead(runs[mode][rep], none["tail_s"]))
    for mode in MODES:
        blocking = [b for r in runs[mode] for b in r["blocking"]]
        summary[mode] = {
            "seconds": med([r["seconds"] for r in runs[mode]]),
            "median_step_s": med([med(r["steps_s"]) for r in runs[mode]]),
            "overhead_s": med(inrun[mode]),
            "overhead_vs_trainer": med(inrun[mode]) / med(inrun["trainer"]),
            "overhead_diff_s": med(diff[mode]),
            "overhead_diff_vs_trainer": med(diff[mode]) / med(diff["trainer"]),
            "blocking_per_save_s": med(blocking),
            "first_save_blocking_s": med([r["blocking"][0] for r in runs[mode] if r["blocking"]]),
            "saves_per_run": len(blocking) / max(1, len(runs[mode])),
        }
    ratio = summary["ours"]["overhead_vs_trainer"]
    report: dict[str, Any] = {
        "meta": {
            "cpus": os.cpu_count(),
            "device": a.device,
            "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "CPU",
            "batch": a.batch,
            "seq": a.seq,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "threads": a.threads,
            "reps": a.reps,
            "steps": a.steps,
            "every": a.every,
            "params": runs["none"][0]["params"],
            "model_bytes": model_bytes,
            "state_bytes": total_bytes,
            "quick": a.quick,
            "load_start": load_start,
            "load_end": [round(x, 2) for x in os.getloadavg()],
            "library": library_version(),
            "runtime_s": time.time() - t_start,
        },
        "context": {
            "state_gb": total_bytes / 1e9,
            "raw_write_fsync_s": raw_s,
            "copy_s": copy_s,
            "step_alone_s": bg["alone"],
            "step_during_buffered_write_s": bg["buffered"],
            "buffered_write_fsync_s": bg["buffered_s"],
            "step_during_direct_write_s": bg["direct"],
            "direct_write_fsync_s": bg["direct_s"],
        },
        "runs": runs,
        "summary": summary,
        "goals": [
            {
                "name": "training-time overhead, ResilientCheckpoint / Trainer save_steps",
                "value": ratio,
                "target": f"<= {GOAL[a.device]}",
                "met": ratio <= GOAL[a.device],
            },
            {
                "name": "model state (MB)",
                "value": model_bytes / 1e6,
                "target": ">= 256",
                "met": model_bytes >= 256e6,
            },
        ],
    }
    md = markdown(report)
    write_results(a.out, "bench_transformers", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
