"""DeepSpeed example: a ZeRO-2 run on 2 ranks is killed with SIGKILL between two checkpoints,
re-run, and continues exactly where it stopped; then its last checkpoint is exported as
consolidated fp32 weights.

    DS_ACCELERATOR=cpu .venv/bin/python examples/deepspeed_resume.py     # CPU, about a minute

(after `bash scripts/setup.sh test`, which installs DeepSpeed; the demo's set-up has the core only).
The first run on a machine (or in a new .venv) first waits for DeepSpeed to compile its CPU
communication op, ``deepspeed_shm_comm``: a few minutes on 2 cores, then cached in
~/.cache/torch_extensions. It is compiled once, in the foreground, before the ranks start.

The training (``train()`` below) is an ordinary DeepSpeed script: a small MLP with dropout,
AdamW, a warm-up schedule, gradient accumulation, ZeRO stage 2 over 2 gloo ranks. Checkpointing
is one section of the DeepSpeed config plus ``rcds.initialize`` in place of
``deepspeed.initialize``::

    "resilient_checkpoint": {"dirpath": "...", "every_n_steps": 5, "keep_last": 2}

    engine, _, loader, _ = rcds.initialize(model=model, model_parameters=model.parameters(),
                                           training_data=dataset, config=config)

The script runs that training three times under ./demo_output/deepspeed/ (each run is 2
processes):

1. uninterrupted, for reference;
2. the same command, whose ranks SIGKILL themselves at step 13 (the last checkpoint is step 10);
3. the same command again: it resumes from step 10 by itself, mid-epoch.

It checks that every rank's per-micro-step losses and the final weights (exported with
``resilient-ckpt export``, no DeepSpeed needed) of the resumed run are bit-for-bit those of the
uninterrupted one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from importlib.util import find_spec

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SETUP = "`bash scripts/setup.sh test` (the demo's set-up installs the core only)"
OUT = os.path.join(os.getcwd(), "demo_output", "deepspeed")
STEPS, EVERY, DIE_AT, WORLD = 20, 5, 13, 2


def train(ckpt_dir: str, log_path: str, die_at: int | None) -> None:
    import deepspeed
    import torch
    from torch import nn

    import resilient_callbacks.deepspeed as rcds

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.GELU(), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g)
    )
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "resilient_checkpoint": {"dirpath": ckpt_dir, "every_n_steps": EVERY, "keep_last": 2},
    }
    torch.manual_seed(10 + rank)  # each rank's dropout stream (saved and restored per rank)
    engine, _, loader, _ = rcds.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=config
    )
    with open(f"{log_path}.rank{rank}", "a") as log:
        if engine.global_steps:
            print(f"[rank {rank}] resumed at step {engine.global_steps}", flush=True)
        while engine.global_steps < STEPS:
            for x, y in loader:  # continues mid-epoch after a resume
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                log.write(f"{engine.micro_steps} {float(loss.detach()).hex()}\n")
                log.flush()
                engine.step()  # saves when due
                if die_at is not None and engine.global_steps == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if engine.global_steps >= STEPS:
                    break
    engine.resilient_checkpoint.save()  # the final step, for the export below
    engine.resilient_checkpoint.close()


def build_deepspeed_op() -> None:
    """Compile DeepSpeed's CPU communication op before the ranks start (a no-op once cached).

    Each rank's ``deepspeed.init_distributed`` compiles it otherwise: silently, within the
    ranks' time limit below; a rank killed while compiling leaves torch's lock file
    (``.../deepspeed_shm_comm/lock``) behind, and every later run then waits on it forever."""
    import importlib
    import threading

    print("compiling DeepSpeed's CPU op deepspeed_shm_comm where not cached yet", flush=True)
    # a lock file left by a compile that was killed: said after a minute, where it is
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    pattern = os.path.join(root, "**", "deepspeed_shm_comm", "lock")

    def still_waiting() -> None:
        for lock in glob.glob(pattern, recursive=True):
            print(
                f"  still compiling after a minute; if no compiler (c++) runs, {lock} was left "
                "by a compile that was killed: remove it and run again",
                flush=True,
            )

    hint = threading.Timer(60, still_waiting)
    hint.daemon = True
    hint.start()
    try:
        # not ``import deepspeed.comm.torch``: deepspeed.comm's attribute ``torch`` is torch
        importlib.import_module("deepspeed.comm.torch").build_shm_op()
    finally:
        hint.cancel()


def launch(name: str, die_at: int | None) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        argv = [
            sys.executable,
            __file__,
            "--train",
            os.path.join(OUT, name),
            os.path.join(OUT, f"{name}.losses"),
        ]
        if die_at is not None:
            argv += ["--die-at", str(die_at)]
        log = open(os.path.join(OUT, f"{name}.rank{rank}.out"), "a")  # noqa: SIM115
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=300))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"the {name} run took over 300 s: see {os.path.join(OUT, name)}.rank*.out")
    return codes


def losses(name: str, rank: int) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(os.path.join(OUT, f"{name}.losses.rank{rank}")) as f:
        for line in f:
            k, v = line.split()
            out[k] = v  # a micro-step trained again after the resume overwrites the lost one
    return out


def export(name: str) -> dict[str, list[str]]:
    dest = os.path.join(OUT, f"{name}_fp32")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_callbacks",
            "export",
            os.path.join(OUT, name),
            dest,
            "--force",
        ],
        check=True,
    )
    from safetensors.torch import load_file

    return {
        k: [float(x).hex() for x in v.flatten()]
        for k, v in load_file(os.path.join(dest, "model.safetensors")).items()
    }


def needs(*modules: str) -> None:
    """Exit with a clear message, before anything is deleted, where a module is missing."""
    missing = [m for m in modules if sys.modules.get(m, 0) is None or not find_spec(m)]
    if missing:
        sys.exit(f"this example needs {', '.join(missing)}: set up with {SETUP}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs=2, metavar=("CKPT_DIR", "LOG"))
    ap.add_argument("--die-at", type=int)
    args = ap.parse_args()
    if args.train:
        train(args.train[0], args.train[1], args.die_at)
        return 0
    needs("deepspeed")
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    build_deepspeed_op()
    print(f"1/3 uninterrupted run ({WORLD} ranks, ZeRO-2, {STEPS} steps)...", flush=True)
    assert launch("reference", None) == [0] * WORLD
    print(
        f"2/3 the same run, SIGKILLed at step {DIE_AT} (last checkpoint: step {DIE_AT // EVERY * EVERY})...",
        flush=True,
    )
    codes = launch("resumed", DIE_AT)
    assert all(c == -signal.SIGKILL for c in codes), codes
    print("3/3 the same command again: it resumes by itself...", flush=True)
    assert launch("resumed", None) == [0] * WORLD
    with open(os.path.join(OUT, "resumed.rank0.out")) as f:
        print("   " + next(line for line in f if line.startswith("[rank 0] resumed")).strip())
    same_losses = all(losses("reference", r) == losses("resumed", r) for r in range(WORLD))
    same_weights = export("reference") == export("resumed")
    print(
        json.dumps(
            {"per-step losses identical": same_losses, "final fp32 weights identical": same_weights}
        )
    )
    return 0 if same_losses and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
