"""Lightning example: a ``Trainer`` run is killed with SIGKILL mid-epoch, re-run, and continues
exactly where it stopped.

    .venv/bin/python examples/lightning_resume.py        # CPU, well under a minute

(after `bash scripts/setup.sh test`, which installs Lightning; the demo's set-up has the core only)

The training (``train()`` below) is an ordinary Lightning script: a LightningModule with dropout,
AdamW and an LR schedule, a plain shuffled ``DataLoader``, validation. The only addition is one
callback::

    L.Trainer(..., callbacks=[ResilientCheckpoint(dirpath, every_n_steps=10, keep_last=3)])

and no ``ckpt_path``: ``fit`` resumes from the newest valid checkpoint by itself. The script runs
that training three times, each in its own process, under ./demo_output/lightning/:

1. uninterrupted, for reference;
2. the same command, killed with SIGKILL at a step between two checkpoints, mid-epoch;
3. the same command again: it resumes by itself.

Then it checks that the per-step losses and the final weights of the interrupted-and-resumed run
are bit-for-bit those of the uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib.util import find_spec

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = "`bash scripts/setup.sh test` (the demo's set-up installs the core only)"
OUT = os.path.join(os.getcwd(), "demo_output", "lightning")
STEPS, EVERY = 60, 10
WAITING = "waiting_to_be_killed"  # the run killed says so, where it waits to be


def train(workdir: str, stop_at: int) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from resilient_callbacks.lightning import ResilientCheckpoint

    torch.set_num_threads(1)  # deterministic kernels for this tiny model on CPU
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(480, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    train_set, val_set = TensorDataset(x[:400], y[:400]), TensorDataset(x[400:], y[400:])
    log_path = os.path.join(workdir, "losses.jsonl")

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 3e-3, "hidden": 64})
            self.net = nn.Sequential(
                nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1)
            )

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.binary_cross_entropy_with_logits(self.net(xb), yb)
            with open(log_path, "a") as f:  # the loss of every step, for the comparison
                f.write(json.dumps({"step": self.global_step + 1, "loss": loss.item().hex()}))
                f.write("\n")
            if self.global_step + 1 == stop_at:  # the demo's: wait here to be killed (run())
                open(os.path.join(workdir, WAITING), "w").close()
                while True:
                    time.sleep(60)
            return loss

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            self.log("val_loss", nn.functional.binary_cross_entropy_with_logits(self.net(xb), yb))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = Classifier()
    callback = ResilientCheckpoint(os.path.join(workdir, "ckpts"), every_n_steps=EVERY, keep_last=3)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        val_check_interval=0.5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(
        model,
        DataLoader(train_set, batch_size=32, shuffle=True),  # made resumable by the callback
        DataLoader(val_set, batch_size=40),
    )
    torch.save(model.state_dict(), os.path.join(workdir, "weights.pt"))
    start = callback.restored_step
    print(
        f"  trained to step {STEPS}, " + (f"resumed at step {start}" if start else "from scratch")
    )


def losses(workdir: str) -> dict[int, str]:
    out: dict[int, str] = {}
    with open(os.path.join(workdir, "losses.jsonl")) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            out[rec["step"]] = rec["loss"]  # a step trained again after the resume: last wins
    return out


def run(workdir: str, kill_after: int = 0) -> None:
    """Train in a process of its own; with ``kill_after``, SIGKILL it during that step, where it
    waits (a file says so): at that step on any machine, where killing it at whichever step it
    had reached when this process looked was a step or more later on a loaded one (past the
    next checkpoint, perhaps)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--train", workdir]
    cmd += ["--stop-at", str(kill_after)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not kill_after:
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            sys.exit(f"training failed:\n{err.decode()}")
        print(out.decode().rstrip())
        return
    waiting = os.path.join(workdir, WAITING)
    while not os.path.exists(waiting):
        if proc.poll() is not None:
            sys.exit(f"training ended before step {kill_after}:\n{proc.stderr.read().decode()}")
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    os.remove(waiting)
    print(f"  killed with SIGKILL during step {max(losses(workdir))}")


def needs(*modules: str) -> None:
    """Exit with a clear message, before anything is deleted, where a module is missing."""
    missing = [m for m in modules if sys.modules.get(m, 0) is None or not find_spec(m)]
    if missing:
        sys.exit(f"this example needs {', '.join(missing)}: set up with {SETUP}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--train", metavar="WORKDIR", help=argparse.SUPPRESS)
    p.add_argument("--stop-at", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train:
        train(args.train, args.stop_at)
        return 0

    import torch

    needs("lightning")
    shutil.rmtree(OUT, ignore_errors=True)
    ref, run_dir = os.path.join(OUT, "uninterrupted"), os.path.join(OUT, "interrupted")
    os.makedirs(ref)
    os.makedirs(run_dir)
    print("[1/3] uninterrupted run")
    run(ref)
    print("[2/3] the same command, killed mid-epoch (13 batches per epoch)")
    run(run_dir, kill_after=27)
    print("[3/3] the same command again: it resumes from the newest valid checkpoint")
    run(run_dir)

    a, b = losses(ref), losses(run_dir)
    print("\n step  uninterrupted      interrupted+resumed")
    for s in range(15, 36):
        print(f" {s:4d}  {float.fromhex(a[s]):.15f}  {float.fromhex(b[s]):.15f}")
    wa = torch.load(os.path.join(ref, "weights.pt"), weights_only=True)
    wb = torch.load(os.path.join(run_dir, "weights.pt"), weights_only=True)
    same_losses = a == b and sorted(a) == list(range(1, STEPS + 1))
    same_weights = all(torch.equal(wa[k], wb[k]) for k in wa)
    print(f"\nall {STEPS} per-step losses identical: {same_losses}")
    print(f"final weights identical: {same_weights}")
    from cli_hint import cli_command  # (examples/: runs the code this example ran)

    ckpts = os.path.relpath(os.path.join(run_dir, "ckpts"))
    print(f"checkpoints: {ckpts}\n  try: {cli_command('ls', ckpts)}")
    return 0 if same_losses and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
