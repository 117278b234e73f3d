"""A plain loop with one of the less common training parts, checkpointed with a Checkpointer
(helper for tests/test_features_killed.py; not a test module).

``--setup`` picks the part: ``lbfgs`` (``step(closure)``), ``sam`` (a two-pass optimizer holding
its base optimizer), ``amp`` (``GradScaler("cpu")`` with bf16 autocast and inf gradients at
steps 2 and 4, the second the step of the checkpoint resumed from), the schedulers ``plateau``
(``ReduceLROnPlateau``), ``sequential`` (``SequentialLR``),
``chained`` (``ChainedScheduler``), ``onecycle`` (``OneCycleLR``), ``swa`` (``AveragedModel`` +
``SWALR`` from step 3 on), ``ema`` (an EMA copy the loop keeps) and ``accumulate`` (3
micro-batches per optimizer step). Every object is in the state as docs/guide.md says.

``--hold-at S [--hold-micro M]``: after step S (its log line written and ``ckpt.step`` called),
or, with ``--hold-micro``, after micro-batch M of the step after S, append ``{"hold": ...}``
to the log and wait to be killed. At the end, ``--out`` gets a JSON of every value of the final
state: tensors as their dtype, shape and SHA-256, floats as ``float.hex``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from resilient_callbacks import Checkpointer, ResumableDataLoader

ACCUMULATE = 3
SWA_START = 3


class SAM(torch.optim.Optimizer):
    """A sharpness-aware two-pass optimizer as users copy it (``.base_optimizer``)."""

    def __init__(self, params: Any, base: Any, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad, alpha=group["rho"])

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups  # (its groups are new)


def digest(value: Any) -> Any:
    """``value`` as JSON that is equal exactly when the values are equal bit for bit."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8) if t.numel() and t.dtype != torch.bool else t.to(torch.uint8)
        return f"{t.dtype} {list(value.shape)} {hashlib.sha256(raw.numpy().tobytes()).hexdigest()}"
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    return repr(value)


def build(setup: str) -> tuple[dict[str, Any], Any]:
    """The state and one training step ``train(state, batches) -> loss`` for ``setup``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    state: dict[str, Any] = {"model": model}
    sched: Any = None
    if setup == "lbfgs":
        opt: Any = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=3)
    elif setup == "sam":
        opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state["opt"] = opt
    if setup == "sam":  # (after the wrapper, as docs/guide.md has it)
        state["base"] = opt.base_optimizer
    if setup == "plateau":
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    elif setup == "sequential":
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
    elif setup == "chained":
        sched = torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
                torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            ]
        )
    elif setup == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    elif setup in ("accumulate", "sam"):  # (SAM's: on the wrapper, as its README has it)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    if sched is not None:
        state["sched"] = sched
    if setup == "amp":
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    if setup == "swa":
        state["swa_model"] = torch.optim.swa_utils.AveragedModel(model)
        state["swa_sched"] = torch.optim.swa_utils.SWALR(opt, swa_lr=0.005, anneal_epochs=3)
        state["cosine"] = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    if setup == "ema":
        ema = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
        ema.load_state_dict(model.state_dict())
        ema.requires_grad_(False)
        state["ema"] = ema
    return state, opt


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train_step(setup: str, state: dict[str, Any], opt: Any, step: int, micro: Any) -> float:
    """One optimizer step (``step`` is its number, from 1) over the batches ``micro`` yields
    (one; ``ACCUMULATE`` for ``accumulate``)."""
    model = state["model"]
    if setup == "lbfgs":
        batch = next(micro)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            return loss

        return float(opt.step(closure).item())
    if setup == "sam":
        batch = next(micro)
        loss = loss_of(model, batch)
        loss.backward()
        opt.first_step()
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.second_step()
        opt.zero_grad()
        state["sched"].step()
        return float(loss.item())
    if setup == "amp":
        scaler = state["scaler"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, next(micro)).float()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in (2, 4):  # an overflow: the scaler skips the step and halves its scale
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        return float(loss.item())
    total = 0.0
    for _ in range(ACCUMULATE if setup == "accumulate" else 1):
        loss = loss_of(model, next(micro))
        (loss / ACCUMULATE if setup == "accumulate" else loss).backward()
        total += float(loss.item())
    opt.step()
    opt.zero_grad()
    sched = state.get("sched")
    if setup == "plateau":
        sched.step(round(total, 1))  # (rounded: plateaus happen)
    elif sched is not None:
        sched.step()
    if setup == "swa":
        if step >= SWA_START:
            state["swa_model"].update_parameters(model)
            state["swa_sched"].step()
        else:
            state["cosine"].step()
    if setup == "ema":
        with torch.no_grad():
            for e, p in zip(state["ema"].parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.1)
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--setup", required=True)
    p.add_argument("--total", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--hold-micro", type=int, default=None)
    p.add_argument("--log", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    state, opt = build(args.setup)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).tanh())
    loader = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=3)
    state["data"] = loader
    torch.manual_seed(1)  # the dropout stream: the restore sets it back to the saved one
    log = open(args.log, "a")  # noqa: SIM115 (open until the process ends or is killed)

    def write(record: dict[str, Any]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()
        os.fsync(log.fileno())

    def hold(where: str) -> None:
        write({"hold": where})
        time.sleep(300)  # killed meanwhile
        sys.exit(3)

    def batches() -> Any:
        while True:
            yield from loader

    with Checkpointer(args.ckpt_dir, every_n_steps=args.every) as ck:
        step = ck.restore(state)
        write({"restored": step})
        source = batches()

        def micro() -> Any:
            for m in range(ACCUMULATE if args.setup == "accumulate" else 1):
                if step == args.hold_at and m == args.hold_micro:
                    hold(f"step {step + 1}, after micro-batch {m}")
                yield next(source)

        while step < args.total:
            loss = train_step(args.setup, state, opt, step + 1, micro())
            step += 1
            write({"step": step, "loss": loss.hex()})
            ck.step(step, state, final=step == args.total)
            if step == args.hold_at and args.hold_micro is None:
                hold(f"after step {step}")
    final = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    final["lr"] = [group["lr"] for group in state["opt"].param_groups]
    final["rng"] = torch.get_rng_state()
    with open(args.out, "w") as f:
        json.dump(digest(final), f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
