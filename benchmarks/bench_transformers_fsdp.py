"""Training-time overhead of checkpointing a Hugging Face Trainer run under the Trainer's FSDP2
(``fsdp=True``, accelerate's ``fully_shard``) on 2 processes: the Trainer's own ``save_steps=K``
against ``ResilientCheckpoint(every_n_steps=K)``, in the same run.

    .venv/bin/python benchmarks/bench_transformers_fsdp.py [--steps 24] [--every 6] [--reps 3] \
        [--out benchmarks/results] [--dir DIR] [--quick]

Each (mode, repetition) is a fresh ``torchrun --nproc_per_node 2`` of this script with
``--worker MODE`` (gloo on CPU; on a machine with 2 GPUs, NCCL): the same GPT-2 built from a
config (``--n-embd 768 --n-layer 4``: 67 M parameters, 268 MB in fp32, ~0.8 GB with AdamW's
moments, half of it on each rank), the same synthetic tokens, each GPT-2 block and the model
FSDP units. Modes run round-robin within each repetition, medians over ``--reps``:

- ``no checkpointing``: ``save_strategy="no"``, the baseline;
- ``Trainer save_steps=K``: the Trainer's own checkpoints (``save_total_limit=2``) through
  accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``, with
  ``fsdp_config["state_dict_type"] = "SHARDED_STATE_DICT"`` (DCP's format, each rank its shards,
  synchronously). Its default, ``FULL_STATE_DICT``, failed on these gloo processes (a collective
  mismatch inside ``save_pretrained``), so the sharded form is the one measured;
- ``ResilientCheckpoint every_n_steps=K``: defaults (background saving, ``keep_last=2``);
- control, ``hold``: no checkpointing, but at step K each rank allocates, fills and keeps as
  many bytes as its shards of the model and optimizer state take: the host memory our reused
  buffers hold, without anything else a save does. On a VM, memory a process touches for the
  first time can be slow to fault in; this shows what holding it costs the training steps.

Time of a mode = wall time of rank 0's ``trainer.train()`` (ours includes waiting at the end
until the last checkpoint is durable). Overhead = time - the time without checkpointing in the
same repetition; *in the loop* = the steps' extra time over the run's median step (robust to a
shared machine's drift), as in ``bench_transformers.py``. Blocking per save: the Trainer's
``_save_checkpoint``; ours as logged in ``resilient/save_blocking_s``.

On CPU, accelerate enables FSDP only where it finds an accelerator; the workers make that one
decision for CPU processes (``tests/accelerate_fsdp_cpu.py``), the rest is accelerate's and the
Trainer's own code.

Writes ``bench_transformers_fsdp.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench_transformers import add_run_arguments, in_run_overhead
from common import apply_quick, med, round_robin

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("none", "hold", "trainer", "ours")
LABELS = {
    "none": "no checkpointing",
    "hold": "no checkpointing, host memory of one save held (control)",
    "trainer": "Trainer save_steps=K (FSDP SHARDED_STATE_DICT)",
    "ours": "ResilientCheckpoint every_n_steps=K",
}
GOAL = {"cpu": 0.5, "cuda": 0.1}  # ours / the Trainer's, in the loop (as bench_transformers.py)


def worker(a: argparse.Namespace) -> int:
    """One rank of one run; rank 0 writes the run's figures to ``a.result``."""
    import torch
    import torch.distributed as dist
    import transformers
    from bench_transformers import SaveTimes, StepClock, TimedTrainer, Tokens, build_model
    from transformers import TrainingArguments

    from resilient_callbacks.transformers import ResilientCheckpoint

    Hold = _hold_callback()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        import accelerate_fsdp_cpu

        accelerate_fsdp_cpu.allow()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    mode = a.worker
    out = os.path.join(a.dir, mode)
    rank = int(os.environ.get("RANK", "0"))
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=1e-4,
        logging_steps=a.every,
        save_strategy="steps" if mode == "trainer" else "no",
        save_steps=a.every,
        save_total_limit=2,
        report_to="none",
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu else None,
        disable_tqdm=True,
        seed=0,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )
    model = build_model(a)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = TimedTrainer(
        model=model, args=args, train_dataset=Tokens(a.steps * 4 * a.batch, a.seq, a.vocab)
    )
    trainer.save_seconds = []
    clock = StepClock()
    trainer.callback_handler.callbacks.insert(0, clock)
    times = SaveTimes()
    if mode == "hold":
        trainer.add_callback(Hold(a.every))
    if mode == "ours":
        cb = ResilientCheckpoint(
            os.path.join(out, "ckpt"), every_n_steps=a.every, keep_last=2, preemption=False
        )
        trainer.add_callback(cb)
        trainer.add_callback(times)
    t0 = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    marks = [clock.begin, *clock.ends]
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump(
                {
                    "seconds": end - t0,
                    "steps_s": [b - x for x, b in itertools.pairwise(marks)],
                    "tail_s": end - clock.ends[-1],
                    "blocking": trainer.save_seconds if mode == "trainer" else times.blocking,
                    "params": n_params,
                },
                f,
            )
    dist.barrier()
    # Leave without tearing the process groups down: at exit, gloo sometimes aborts ("terminate
    # called without an active exception") in every mode, the no-checkpoint ones included; the
    # figures are written by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local_state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of this rank's shards of the model and optimizer state (what a save copies)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, optimizer)

    def local(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return int(t.numel() * t.element_size())

    n = sum(local(v) for v in msd.values())
    for st in osd["state"].values():
        n += sum(local(v) for v in st.values() if hasattr(v, "numel"))
    return n


def _hold_callback() -> Any:
    from transformers import TrainerCallback

    class Hold(TrainerCallback):
        """At step ``at``: allocate, fill and keep this rank's state bytes of host memory."""

        def __init__(self, at: int) -> None:
            self.at = at
            self.kept: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == self.at and self.kept is None:
                import torch

                opt = getattr(kw["optimizer"], "optimizer", kw["optimizer"])
                n = local_state_bytes(kw["model"], opt)
                self.kept = torch.empty(n, dtype=torch.uint8)
                self.kept.fill_(1)

    return Hold


def run(mode: str, a: argparse.Namespace, rep: int) -> dict[str, Any]:
    result = os.path.join(a.dir, f"{mode}.{rep}.json")
    port = 29600 + (os.getpid() + rep * 7 + MODES.index(mode)) % 2000
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--result",
        result,
        *a.passed,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    with open(result) as f:
        res: dict[str, Any] = json.load(f)
    shutil.rmtree(os.path.join(a.dir, mode), ignore_errors=True)
    return res


def markdown(r: dict[str, Any]) -> str:
    m, s = r["meta"], r["summary"]
    lines = [
        "# Trainer under FSDP2: checkpointing overhead",
        "",
        f"{m['params'] / 1e6:.0f} M parameters, 2 ranks ({m['device']}), {m['steps']} steps, "
        f"a save every {m['every']}, medians of {m['reps']}; torch {m['torch']}, "
        f"transformers {m['transformers']}, library {m['library']}, load "
        f"{m['load_start']} -> {m['load_end']}.",
        "",
        "| mode | train() s | overhead s | in the loop s | blocking per save s | vs Trainer (loop) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        x = s[mode]
        lines.append(
            f"| {LABELS[mode]} | {x['seconds']:.2f} | {x['overhead_s']:.2f} | "
            f"{x['in_loop_s']:.2f} | {x['blocking_per_save_s']:.3f} | "
            f"{x['in_loop_vs_trainer']:.2f}x |"
        )
    beyond = r["beyond_hold"]
    lines.append(
        f"\nOurs in the loop less the control's (holding the host memory alone): "
        f"{beyond['in_loop_s']:.2f} s, {beyond['vs_trainer']:.2f}x the Trainer's."
    )
    for g in r["goals"]:
        lines.append(
            f"\n{g['name']}: {g['value']:.2f} (goal {g['target']}: "
            f"{'met' if g['met'] else 'missed'})"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_run_arguments(ap, steps=24)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small model, 1 repetition (smoke test; options given win)",
    )
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        apply_quick(ap, a, steps=8, every=4, reps=1, vocab=8000, n_embd=256, n_layer=2)
    if a.worker:
        return worker(a)
    import torch
    import transformers
    from common import library_version, write_results

    t_start = time.time()
    load_start = [round(x, 2) for x in os.getloadavg()]
    base = tempfile.mkdtemp(prefix="bench_transformers_fsdp-", dir=a.dir)
    a.dir = base
    a.passed = [
        "--steps", str(a.steps), "--every", str(a.every), "--seq", str(a.seq),
        "--batch", str(a.batch), "--vocab", str(a.vocab), "--n-embd", str(a.n_embd),
        "--n-layer", str(a.n_layer), "--dir", base,
    ]  # fmt: skip
    try:
        run("none", a, -1)  # warm-up (page cache of the imports), discarded
        runs = round_robin(MODES, a.reps, lambda mode, rep: run(mode, a, rep), width=8)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary: dict[str, dict[str, float]] = {}
    # in the loop: the steps' and the tail's time beyond the run's median step, less the same
    # excess of the run without checkpoints in that repetition (its step-time noise)
    noise = [in_run_overhead(runs["none"][i], runs["none"][i]["tail_s"]) for i in range(a.reps)]
    loop = {
        m: [
            in_run_overhead(runs[m][i], runs["none"][i]["tail_s"]) - noise[i] for i in range(a.reps)
        ]
        for m in MODES
    }
    diff = {
        m: [runs[m][i]["seconds"] - runs["none"][i]["seconds"] for i in range(a.reps)]
        for m in MODES
    }
    for mode in MODES:
        blocking = [b for r in runs[mode] for b in r["blocking"]]
        summary[mode] = {
            "seconds": med([r["seconds"] for r in runs[mode]]),
            "overhead_s": med(diff[mode]),
            "overhead_vs_trainer": med(diff[mode]) / med(diff["trainer"]),
            "in_loop_s": med(loop[mode]),
            "in_loop_vs_trainer": med(loop[mode]) / med(loop["trainer"]),
            "blocking_per_save_s": med(blocking) if blocking else 0.0,
            "saves_per_run": len(blocking) / max(1, len(runs[mode])),
        }
    ratio = summary["ours"]["in_loop_vs_trainer"]
    goal = GOAL["cuda" if torch.cuda.is_available() else "cpu"]
    report: dict[str, Any] = {
        "meta": {
            "cpus": os.cpu_count(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "reps": a.reps,
            "steps": a.steps,
            "every": a.every,
            "params": runs["none"][0]["params"],
            "quick": a.quick,
            "load_start": load_start,
            "load_end": [round(x, 2) for x in os.getloadavg()],
            "library": library_version(),
            "runtime_s": time.time() - t_start,
        },
        "runs": runs,
        "summary": summary,
        "beyond_hold": {
            "in_loop_s": med([x - h for x, h in zip(loop["ours"], loop["hold"], strict=True)]),
            "vs_trainer": med([x - h for x, h in zip(loop["ours"], loop["hold"], strict=True)])
            / med(loop["trainer"]),
        },
        "goals": [
            {
                "name": "overhead in the loop, ResilientCheckpoint / Trainer save_steps",
                "value": ratio,
                "target": f"<= {goal}",
                "met": ratio <= goal,
            }
        ],
    }
    md = markdown(report)
    write_results(a.out, "bench_transformers_fsdp", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
