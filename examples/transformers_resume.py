"""Hugging Face Trainer example: a run is killed with SIGKILL mid-epoch, re-run, and continues
exactly where it stopped; then its newest checkpoint is exported for ``from_pretrained``.

    .venv/bin/python examples/transformers_resume.py        # CPU, under a minute

(after `bash scripts/setup.sh test`, which installs Transformers; the demo's set-up has the core
only)

The training (``train()`` below) is an ordinary Trainer script: a small GPT-2 built from a
config (dropout on), synthetic tokens, AdamW with warmup and a linear schedule, gradient
accumulation. The only addition is one callback::

    trainer.add_callback(ResilientCheckpoint(dirpath, every_n_steps=5, keep_last=3))
    trainer.train()      # no resume_from_checkpoint: it resumes by itself

The script runs that training three times, each in its own process, under
./demo_output/transformers/:

1. uninterrupted, for reference;
2. the same command, killed with SIGKILL at a step between two checkpoints, mid-epoch;
3. the same command again: it resumes from the newest valid checkpoint by itself.

It checks that the per-step losses and final weights of the interrupted-and-resumed run are
bit-for-bit those of the uninterrupted one, then exports the newest checkpoint with
``export_pretrained`` and loads it with ``AutoModelForCausalLM.from_pretrained``.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SETUP = "`bash scripts/setup.sh test` (the demo's set-up installs the core only)"
OUT = os.path.join(os.getcwd(), "demo_output", "transformers")
STEPS, EVERY = 30, 5  # an epoch is 8 optimizer steps: 256 samples, batch 8, accumulation 4
WAITING = "waiting_to_be_killed"  # the run killed says so, where it waits to be


def train(workdir: str, stop_at: int) -> None:
    import torch
    import transformers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from resilient_callbacks.transformers import ResilientCheckpoint

    torch.set_num_threads(1)  # deterministic kernels for this tiny model on CPU
    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1234)
            base = torch.randint(0, 96, (256, 24), generator=g)
            self.x = (base % 32) * 3 % 96  # a little structure to learn

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class LogLosses(TrainerCallback):  # only for this demo's comparison (and its kill)
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                with open(os.path.join(workdir, "losses.jsonl"), "a") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")
                if state.global_step == stop_at:  # wait here to be killed (run() below)
                    open(os.path.join(workdir, WAITING), "w").close()
                    while True:
                        time.sleep(60)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96,
        n_positions=24,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "trainer_output"),
        max_steps=STEPS,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        learning_rate=3e-3,
        warmup_steps=3,
        logging_steps=1,
        save_strategy="no",  # ResilientCheckpoint saves
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    ckpt = ResilientCheckpoint(os.path.join(workdir, "ckpts"), every_n_steps=EVERY, keep_last=3)
    trainer.add_callback(ckpt)
    trainer.add_callback(LogLosses())
    trainer.train()
    print(
        f"  resumed from step {ckpt.restored_step}" if ckpt.restored_step else "  fresh start",
        file=sys.stderr,  # stdout (the Trainer's log lines) goes to trainer.log
        flush=True,
    )
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        os.path.join(workdir, "final.safetensors"),
    )


def losses(workdir: str) -> dict[int, float]:
    out: dict[int, float] = {}
    path = os.path.join(workdir, "losses.jsonl")
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by SIGKILL
                continue
            out[rec["step"]] = rec["loss"]  # the resumed run's record wins
    return out


def run(workdir: str, kill_after: int = 0) -> None:
    """Train in a process of its own; with ``kill_after``, SIGKILL it after that step, where it
    waits (a file says so): at that step on any machine, where killing it at whichever step it
    had reached when this process looked was a step or more later on a loaded one (past the
    next checkpoint, or after the run's end)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--train", workdir]
    cmd += ["--stop-at", str(kill_after)]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "trainer.log"), "a") as log:
        proc = subprocess.Popen(cmd, stdout=log)
    if not kill_after:
        if proc.wait() != 0:
            sys.exit(f"training failed (exit code {proc.returncode})")
        return
    waiting = os.path.join(workdir, WAITING)
    while not os.path.exists(waiting):
        if proc.poll() is not None:
            sys.exit(f"the run ended (exit code {proc.returncode}) before step {kill_after}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    os.remove(waiting)
    print(f"  killed with SIGKILL after step {max(losses(workdir))}", flush=True)


def needs(*modules: str) -> None:
    """Exit with a clear message, before anything is deleted, where a module is missing."""
    missing = [m for m in modules if sys.modules.get(m, 0) is None or not find_spec(m)]
    if missing:
        sys.exit(f"this example needs {', '.join(missing)}: set up with {SETUP}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.train:
        train(a.train, a.stop_at)
        return 0
    needs("transformers", "accelerate")

    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from resilient_callbacks.transformers import export_pretrained

    transformers.logging.disable_progress_bar()
    shutil.rmtree(OUT, ignore_errors=True)
    ref, resumed = os.path.join(OUT, "reference"), os.path.join(OUT, "interrupted")
    print("[1/3] uninterrupted run", flush=True)
    run(ref)
    print("[2/3] the same run, killed mid-epoch (between the checkpoints of steps 10 and 15)")
    run(resumed, kill_after=12)
    print("[3/3] the same command again")
    run(resumed)

    a_loss, b_loss = losses(ref), losses(resumed)
    print("\n step  uninterrupted  interrupted+resumed")
    for s in sorted(a_loss):
        print(f" {s:4d}  {a_loss[s]:.10f}  {b_loss.get(s, float('nan')):.10f}")
    wa = load_file(os.path.join(ref, "final.safetensors"))
    wb = load_file(os.path.join(resumed, "final.safetensors"))
    same = a_loss == b_loss and all(torch.equal(wa[k], wb[k]) for k in wa)
    print(f"\nper-step losses and final weights bit-identical: {same}")

    exported = export_pretrained(os.path.join(resumed, "ckpts"), os.path.join(OUT, "exported"))
    model = AutoModelForCausalLM.from_pretrained(exported)
    loaded_same = all(torch.equal(v, wb[k]) for k, v in model.state_dict().items())
    print(f"exported to {exported}; from_pretrained gives the final weights: {loaded_same}")
    from cli_hint import cli_command  # (examples/: runs the code this example ran)

    print(f"  try: {cli_command('ls', os.path.relpath(os.path.join(resumed, 'ckpts')))}")
    return 0 if same and loaded_same else 1


if __name__ == "__main__":
    sys.exit(main())
