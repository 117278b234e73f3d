"""Demo: a training run is killed with SIGKILL partway, re-run, and continues exactly.

    python examples/demo_resume.py              # or: bash scripts/demo.sh

It trains a small MLP (dropout, AdamW, LR schedule, shuffled mini-batches) three times, all under
./demo_output/plain/:

1. uninterrupted, for reference;
2. the same command, killed with SIGKILL at a step between two checkpoints (``--kill-at``: at
   that step on any machine, fast or slow: the run waits there to be killed);
3. the same command again: it resumes from the newest valid checkpoint by itself.

Then it prints the loss of every step of both runs side by side and checks that the resumed run's
losses and final weights are bit-for-bit identical to the uninterrupted run's.

The training itself (``train()`` below) is what a user writes: the only additions to a plain loop
are the three Checkpointer lines.
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

HERE = os.path.dirname(os.path.abspath(__file__))


def train(
    ckpt_dir: str, log_path: str, steps: int, every: int, delay: float, stop_at: int = 0
) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from resilient_callbacks import Checkpointer, ResumableDataLoader

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    loader = ResumableDataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, seed=7)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}

    with Checkpointer(ckpt_dir, every_n_steps=every, keep_last=3) as ckpt:  # (1) create
        step = ckpt.restore(state)  # (2) resume from the newest valid checkpoint, 0 if none
        print(f"  starting at step {step}" + (" (resumed)" if step else " (fresh)"), flush=True)
        with open(log_path, "a") as log:
            while step < steps:
                for xb, yb in loader:
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    sched.step()
                    step += 1
                    log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                    log.flush()
                    # (3) saves every `every` steps, and the last step (final=True)
                    saved = ckpt.step(step, state, final=step == steps)
                    if saved:
                        log.write(json.dumps({"saved": step}) + "\n")
                        log.flush()
                    if step == stop_at:  # (the demo's, not a user's: wait here to be killed)
                        wait_to_be_killed(log_path)
                    time.sleep(delay)
                    if step >= steps:
                        break
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        os.path.join(os.path.dirname(log_path), "final_weights.safetensors"),
    )


def wait_to_be_killed(log_path: str) -> None:
    """Say so (a file beside the log) and wait: the demo's parent SIGKILLs this run at this step,
    where it waits, and not at whichever step it had reached when the parent looked (a step
    or several later on a loaded machine, past a checkpoint perhaps: another story)."""
    with open(stop_marker(log_path), "w") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(60)


def stop_marker(log_path: str) -> str:
    return os.path.join(os.path.dirname(log_path), "waiting_to_be_killed")


def read_log(path: str) -> tuple[dict[int, float], list[int]]:
    losses: dict[int, float] = {}
    saves: list[int] = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the line the kill cut short
            rec = json.loads(line)
            if "saved" in rec:
                saves.append(rec["saved"])
            else:
                losses[rec["step"]] = rec["loss"]  # a replayed step overwrites: last one counts
    return losses, saves


def run_child(args: argparse.Namespace, run_dir: str, stop_at: int = 0) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        run_dir,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--delay",
        str(args.delay),
        "--stop-at",
        str(stop_at),
    ]
    return subprocess.Popen(cmd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out",
        default=os.path.join(os.getcwd(), "demo_output", "plain"),
        help="where the three runs write (default: ./demo_output/plain; a new folder, or one of "
        "this demo's: emptied first)",
    )
    ap.add_argument("--steps", type=int, default=60, help="training steps of each run")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--kill-at", type=int, default=37, help="SIGKILL the second run at this step")
    ap.add_argument("--delay", type=float, default=0.02, help="seconds of 'work' per step")
    ap.add_argument("--child", metavar="RUN_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(
            os.path.join(args.child, "checkpoints"),
            os.path.join(args.child, "log.jsonl"),
            args.steps,
            args.every,
            args.delay,
            args.stop_at,
        )
        return 0

    if not 0 < args.kill_at < args.steps or args.every < 1:
        ap.error(f"--kill-at must be between 1 and --steps - 1 ({args.steps - 1}), --every >= 1")
    out = os.path.abspath(args.out)
    others = (
        sorted(set(os.listdir(out)) - {"uninterrupted", "interrupted"})
        if os.path.isdir(out)
        else []
    )
    if others:  # emptied first: only a folder of this demo's own runs
        ap.error(f"--out {out} holds other files ({', '.join(others[:3])}): give a new folder")
    shutil.rmtree(out, ignore_errors=True)
    ref, crash = os.path.join(out, "uninterrupted"), os.path.join(out, "interrupted")
    os.makedirs(ref)
    os.makedirs(crash)
    print(f"All output goes to {out}\n")

    print(f"[1/3] uninterrupted run, {args.steps} steps, checkpoint every {args.every}")
    if run_child(args, ref).wait() != 0:
        return 1

    print(f"[2/3] same command, killed with SIGKILL at step {args.kill_at}")
    proc = run_child(args, crash, stop_at=args.kill_at)
    log = os.path.join(crash, "log.jsonl")
    marker = stop_marker(log)
    while not os.path.exists(marker):  # it waits at step --kill-at: killed there, however slow
        if proc.poll() is not None:
            print(f"  the run ended (exit {proc.returncode}) before step {args.kill_at}")
            return 1
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    os.remove(marker)
    killed_losses, killed_saves = read_log(log)
    taken = (
        f"last checkpoint taken: step {max(killed_saves)}"
        if killed_saves
        else f"no checkpoint taken yet (the first was due at step {min(args.every, args.steps)})"
    )
    print(f"  killed (exit {proc.returncode}) after step {max(killed_losses, default=0)}; {taken}")

    print("[3/3] same command again")
    offset = os.path.getsize(log)
    if run_child(args, crash).wait() != 0:
        return 1

    a, _ = read_log(os.path.join(ref, "log.jsonl"))
    b, _ = read_log(log)
    with open(log) as f:
        f.seek(offset)
        resumed_from = json.loads(f.readline())["step"] - 1  # the re-run's first step, less one
    print(
        f"\n{'step':>5}  {'uninterrupted':>14}  {'killed run':>14}  {'re-run':>14}"
        "   (losses compared bit for bit; 8 decimals shown)"
    )
    for s in sorted(a):
        first = f"{killed_losses[s]:>14.8f}" if s in killed_losses else " " * 14
        again = f"{b[s]:>14.8f}" if s > resumed_from and s in b else " " * 14
        mark = "" if a[s] == b.get(s) and killed_losses.get(s, a[s]) == a[s] else "  DIFFERENT"
        if s == resumed_from + 1 and resumed_from:
            mark += f"  <- re-run resumes here, from the checkpoint of step {resumed_from}"
        elif s == resumed_from + 1:  # killed before its first checkpoint
            mark += "  <- re-run starts here, from the beginning: no checkpoint was taken"
        if s == max(killed_losses, default=0):
            mark += "  <- SIGKILL"
        print(f"{s:>5}  {a[s]:>14.8f}  {first}  {again}{mark}")
    from safetensors.torch import load_file

    wa = load_file(os.path.join(ref, "final_weights.safetensors"))
    wb = load_file(os.path.join(crash, "final_weights.safetensors"))
    same_losses = a == b
    same_weights = wa.keys() == wb.keys() and all(
        wa[k].dtype == wb[k].dtype and wa[k].numpy().tobytes() == wb[k].numpy().tobytes()
        for k in wa
    )
    last = max(a)
    print(f"\nfinal loss: uninterrupted {a[last]!r}, killed + resumed {b.get(last)!r}")
    print(
        f"per-step losses identical: {same_losses}; final weights bit-for-bit identical: {same_weights}"
    )
    from cli_hint import cli_command  # (examples/: runs the code this demo ran)

    ckpts = os.path.relpath(os.path.join(crash, "checkpoints"))
    print(f"checkpoints: {ckpts}\n  try: {cli_command('ls', ckpts)}")
    return 0 if same_losses and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
