"""A plain Hugging Face Accelerate training loop with a Checkpointer, as docs/accelerate.md
shows it (helper for tests/test_accelerate.py; run as one process or under spawn_ranks).

``python accelerate_loop.py CKDIR OUT KILL_AT [MIXED_PRECISION]``: trains 3 epochs of a
shuffled loader with dropout and ``gradient_accumulation_steps=2``, appending each micro-step's
loss to ``OUT.rank{r}.losses``, and SIGKILLs itself after micro-step ``KILL_AT`` (0: never),
once a checkpoint is durable; at the end rank 0 writes the final parameters to ``OUT.params``.

Variants, by environment: ``LOOP_SIGNAL=SIGTERM`` sends that signal instead (a preemption: no
flush first); ``LOOP_GAS=3`` another ``gradient_accumulation_steps``; ``LOOP_EVERY_MICRO=1``
calls ``ckpt.step`` at every micro-batch, counting micro-batches (as with save_on_exception);
``LOOP_PREPARED=1`` is the reference without us: the loader passed to ``accelerator.prepare``
(a shuffled ``DataLoader``), no Checkpointer.
"""

import os
import signal
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from resilient_callbacks import Checkpointer, PerRank, ResumableDataLoader
from resilient_callbacks.accelerate import Accumulation

ckdir, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
mixed = sys.argv[4] if len(sys.argv) > 4 else "no"
sig = getattr(signal, os.environ.get("LOOP_SIGNAL", "SIGKILL"))
gas = int(os.environ.get("LOOP_GAS", "2"))
every_micro = os.environ.get("LOOP_EVERY_MICRO") == "1"
prepared = os.environ.get("LOOP_PREPARED") == "1"

# --- the loop as docs/accelerate.md shows it ---
accelerator = Accelerator(gradient_accumulation_steps=gas, mixed_precision=mixed, cpu=True)
set_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(44, 8), torch.randn(44, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
model, opt, sched = accelerator.prepare(model, opt, sched)  # not the loader
ranks = accelerator.num_processes
if prepared:  # the reference: accelerate's own loader (one process: the same batches)
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True))
elif ranks > 1:
    loader = ResumableDataLoader(
        dataset, batch_size=4, num_replicas=ranks, rank=accelerator.process_index
    )
else:
    loader = ResumableDataLoader(dataset, batch_size=4, shuffle=True)
accumulation = Accumulation(accelerator)
state = {
    "model": model,
    "optimizer": opt,
    "scheduler": sched,
    "data": PerRank(loader) if ranks > 1 else loader,
    "accumulation": accumulation,
    "extra": {"micro": 0},
}
if prepared:
    del state["data"]
if accelerator.scaler is not None:  # fp16 on a GPU
    state["scaler"] = accelerator.scaler
epochs = 3
with Checkpointer(ckdir, every_n_steps=2) as ckpt:
    step = ckpt.restore(state) if not prepared else 0  # optimizer steps done
    losses = open(f"{out}.rank{accelerator.process_index}.losses", "a")  # noqa: SIM115
    for _epoch in range(0 if prepared else loader.epoch, epochs):
        # an epoch's last batch ends a window, as with a prepared loader
        for x, y in loader if prepared else accumulation.epoch(loader):
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            # --- test instrumentation ---
            state["extra"]["micro"] += 1
            print(state["extra"]["micro"], loss.item().hex(), file=losses, flush=True)
            # ---
            if prepared:
                continue
            if every_micro:  # a step() at every micro-batch, counting them
                step = state["extra"]["micro"]
                ckpt.step(step, state)
            elif accelerator.sync_gradients:  # an optimizer step ended: a consistent state
                step += 1
                ckpt.step(step, state)
            if state["extra"]["micro"] == kill_at:  # test instrumentation
                if sig == signal.SIGKILL:
                    ckpt.flush()
                os.kill(os.getpid(), sig)
    if not prepared:
        ckpt.save(step, state, final=True)
if accelerator.is_main_process:
    torch.save(dict(accelerator.unwrap_model(model).state_dict()), f"{out}.params")
