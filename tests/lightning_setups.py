"""Less common ``Trainer`` set-ups trained with and without ``ResilientCheckpoint`` (a helper
for tests/test_lightning_setups.py; not a test module).

One script, one set-up per ``--setup`` name (:data:`SETUPS`). It records, to ``--out`` (one
JSON line each, fsynced, so a SIGKILL loses at most a cut last line):

- ``train``: every training batch (micro-batch), in ``training_step``: the global step
  before it, epoch, batch index and the loss (``float.hex``); Python's, NumPy's and torch's
  RNG feed the loss, dropout the model;
- ``val``: every validation's end (not the sanity check's): the global step, the epoch and
  ``val_loss``;
- ``log``: every call of the loggers' ``log_metrics`` (our own ``resilient/*`` figures left
  out): the global step and the metrics;
- ``callbacks``: (set-up ``early_train``) this rank's ``EarlyStopping`` and ``ModelCheckpoint``
  states after each epoch's ``on_train_epoch_end`` callbacks;
- ``end``: at the end of each ``fit``: hashes of every RNG state, the learning rates, the
  ``EarlyStopping`` and ``ModelCheckpoint`` states, the final weights' hash.

stderr gets ``restored step N`` when training starts. ``--no-callback``: the same without ours.
``--die-after N``: the whole process group SIGKILLs itself once step N's checkpoint committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from resilient_callbacks.lightning import ResilientCheckpoint

IN_DIM, HIDDEN, OUT_DIM = 8, 16, 2


def _dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    y = x[:, :OUT_DIM] * 2 + 0.1 * torch.randn(n, OUT_DIM, generator=g)
    return TensorDataset(x, y)


class _Iterable(IterableDataset):
    """A new order each pass, drawn from the global torch RNG when its iterator is made."""

    def __init__(self, data: TensorDataset, with_len: bool) -> None:
        self.data = data
        if with_len:
            self.__len__ = lambda: len(data)  # type: ignore[method-assign]

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in torch.randperm(len(self.data)).tolist():
            yield self.data[i]


class Record:
    """The ``--out`` file."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "a")  # noqa: SIM115 - lives as long as the process
        if self.f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    self.f.write("\n")

    def __call__(self, **rec: Any) -> None:
        self.f.write(json.dumps(rec, sort_keys=True) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def _num(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item()
    return float(v).hex() if isinstance(v, float) else v


class RecordingLogger(Logger):
    def __init__(self, rec: Record, trainer_ref: list) -> None:
        super().__init__()
        self.rec, self.trainer_ref = rec, trainer_ref

    @property
    def name(self) -> str:
        return "rec"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        ours = {k: _num(v) for k, v in metrics.items() if not k.startswith("resilient/")}
        if ours:
            gs = self.trainer_ref[0].global_step
            self.rec(ev="log", gs=gs, step=step, metrics=ours)


class Net(L.LightningModule):
    def __init__(self, rec: Record, opts: argparse.Namespace) -> None:
        super().__init__()
        self.rec, self.opts = rec, opts
        self.lr = 0.05
        self.net = nn.Sequential(
            nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, OUT_DIM)
        )
        if opts.setup == "gan":
            self.automatic_optimization = False
            self.d = nn.Linear(OUT_DIM, 1)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        noise = np.random.normal() * 1e-3 + random.random() * 1e-3
        return nn.functional.mse_loss(self.net(x), y) + noise

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.opts.sleep:
            time.sleep(self.opts.sleep)
        if self.opts.setup == "gan":
            return self._gan_step(batch, batch_idx)
        loss = self._loss(batch)
        self.rec(
            ev="train",
            gs=self.global_step,
            epoch=self.current_epoch,
            batch=batch_idx,
            loss=float(loss.item()).hex(),
        )
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def _gan_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt_g, opt_d = self.optimizers()
        x, y = batch
        fake = self.net(x)
        loss_d = (self.d(y) - 1).pow(2).mean() + self.d(fake.detach()).pow(2).mean()
        loss_d = loss_d + torch.rand(()) * 1e-3
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = (self.d(self.net(x)) - 1).pow(2).mean() + self._loss(batch)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.rec(
            ev="train",
            gs=self.global_step - 2,
            epoch=self.current_epoch,
            batch=batch_idx,
            loss=float(loss_g.item()).hex() + "/" + float(loss_d.item()).hex(),
        )
        self.log_dict({"loss_g": loss_g, "loss_d": loss_d})
        for sch in [s for s in [self.lr_schedulers()] if s is not None]:
            sch.step()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        # (synced across DDP ranks; "early_train" monitors train_loss, which is not)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=self.opts.devices > 1)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        val = self.trainer.callback_metrics.get("val_loss")
        self.rec(
            ev="val",
            gs=self.global_step,
            epoch=self.current_epoch,
            val_loss=_num(val) if val is not None else None,
        )

    def on_train_epoch_end(self) -> None:
        if self.opts.setup == "early_train":  # (after the callbacks' hooks: their checks)
            self.rec(ev="callbacks", gs=self.global_step, **_callback_states(self.trainer))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        s = self.opts.setup
        if s == "gan":
            g = torch.optim.AdamW(self.net.parameters(), lr=0.01)
            d = torch.optim.SGD(self.d.parameters(), lr=0.05, momentum=0.9)
            return [g, d], [torch.optim.lr_scheduler.StepLR(g, step_size=5, gamma=0.9)]
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if s in ("sched", "lr_monitor"):
            step = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                opt, factor=0.7, patience=0, threshold=0.05
            )
            return [opt], [
                {"scheduler": step, "interval": "step"},
                {"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"},
            ]
        return opt


class Marked(ResilientCheckpoint):
    """Records each step boundary (where a checkpoint of that step is taken), so the records
    a killed run wrote after its last checkpoint can be told apart."""

    rec: Record
    die_after: int | None = None

    def _boundary(self, trainer: L.Trainer, epoch_end: bool) -> None:
        step = self._step_end.step if self._step_end is not None else None
        super()._boundary(trainer, epoch_end)
        self.rec(ev="boundary", gs=step)
        if step is not None and step == self.die_after:
            # killed right after this step's checkpoint committed (the same point every time)
            assert self.checkpointer is not None
            self.checkpointer.flush()
            trainer.strategy.barrier()
            if trainer.global_rank == 0:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            time.sleep(60)


class ReportRestore(L.Callback):
    def __init__(self, rc: ResilientCheckpoint | None) -> None:
        self.rc = rc

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        step = (self.rc.restored_step if self.rc else None) or 0
        if trainer.global_rank == 0:
            print(f"restored step {step} at global_step {trainer.global_step}", file=sys.stderr)
        else:
            print(
                f"rank {trainer.global_rank} restored {step} at {trainer.global_step}",
                file=sys.stderr,
            )
        sys.stderr.flush()


def _h(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return hashlib.sha256(obj.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def _callback_states(trainer: L.Trainer) -> dict[str, Any]:
    """The ``EarlyStopping`` and ``ModelCheckpoint`` states (this rank's)."""
    es = [c for c in trainer.callbacks if isinstance(c, L.pytorch.callbacks.EarlyStopping)]
    mc = [
        c
        for c in trainer.callbacks
        if type(c) is L.pytorch.callbacks.ModelCheckpoint  # not Lightning's default one
    ]
    return {
        "es": [{k: _num(v) for k, v in c.state_dict().items()} for c in es],
        "mc": [
            {
                "best": os.path.basename(c.best_model_path),
                "score": _num(c.best_model_score),
                "k": sorted(os.path.basename(p) for p in c.best_k_models),
                "scores": sorted(_num(v) for v in c.best_k_models.values()),
            }
            for c in mc
        ],
    }


def _end(rec: Record, trainer: L.Trainer, model: Net, fit: int) -> None:
    rec(
        ev="end",
        fit=fit,
        gs=trainer.global_step,
        epoch=trainer.current_epoch,
        rng=[
            _h(torch.get_rng_state()),
            _h(np.random.get_state()[1].tolist()),
            _h(random.getstate()),
        ],
        lrs=[[float(g["lr"]).hex() for g in o.param_groups] for o in trainer.optimizers],
        **_callback_states(trainer),
        weights={k: _h(v) for k, v in model.state_dict().items()},
        stopped=bool(trainer.should_stop),
    )


SETUPS = {
    # name: Trainer keyword arguments (max_epochs=4 unless given)
    "val_float": {"val_check_interval": 0.5},
    "val_int_across": {"val_check_interval": 20, "check_val_every_n_epoch": None},
    "val_every_2": {"check_val_every_n_epoch": 2, "max_epochs": 5},
    "accum3": {"accumulate_grad_batches": 3},
    "clip": {"gradient_clip_val": 0.05},
    "clip_value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "gan": {},
    "iterable": {},
    "iterable_len": {},
    "limit": {"limit_train_batches": 7},
    "limit_frac": {"limit_train_batches": 0.5, "max_epochs": 6},
    "refit": {"max_epochs": 2},
    "bf16": {"precision": "bf16-mixed"},
    "sched": {},
    "early": {"max_epochs": 30},
    "early_train": {"max_epochs": 30},
    "mc": {},
    "lr_monitor": {"val_check_interval": 0.5},
    "accum_val": {"accumulate_grad_batches": 3, "val_check_interval": 4},
    "early_mid": {"max_epochs": 30, "val_check_interval": 0.5},
    "ckpt_last": {},
    "refit_steps": {"max_steps": 20, "max_epochs": -1},
    "accum_sched": {},  # a GradientAccumulationScheduler: 1, then 3 from epoch 1
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--setup", required=True, choices=sorted(SETUPS))
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--no-callback", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per training batch")
    p.add_argument("--devices", type=int, default=1, help="2: DDP, launched as Lightning does")
    p.add_argument("--max-steps", type=int, default=None, help="overrides the set-up's max_steps")
    p.add_argument("--max-time", type=float, default=None, help="Timer(duration=...) in seconds")
    p.add_argument("--max-time-rank1", type=float, default=None, help="rank 1's, if another")
    p.add_argument("--die-after", type=int, default=None, help="SIGKILL after this step's save")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    rank = os.environ.get("LOCAL_RANK", "0")  # set in the processes Lightning launches
    rec = Record(
        os.path.join(opts.work, "out.jsonl" + (f".rank{rank}" if opts.devices > 1 else ""))
    )
    model = Net(rec, opts)
    trainer_ref: list = []
    rc = (
        None
        if opts.no_callback
        else Marked(os.path.join(opts.work, "ckpt"), every_n_steps=opts.every)
    )
    if rc is not None:
        rc.rec = rec
        rc.die_after = opts.die_after
    callbacks: list = [ReportRestore(rc)] + ([rc] if rc else [])
    if opts.setup == "lr_monitor":
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(log_momentum=True))
    if opts.setup == "early_mid":
        callbacks.append(
            L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.002)
        )
    if opts.setup == "accum_sched":
        callbacks.append(L.pytorch.callbacks.GradientAccumulationScheduler({0: 1, 1: 3}))
    if opts.setup == "ckpt_last":
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(opts.work, "mc"), every_n_train_steps=3, save_last=True
            )
        )
    if opts.setup == "early":
        callbacks.append(
            L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=0.002)
        )
    if opts.setup == "early_train":  # on each rank's own train_loss (not synced under DDP)
        callbacks.append(L.pytorch.callbacks.EarlyStopping(monitor="train_loss", patience=2))
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(opts.work, "mc"), monitor="train_loss", save_top_k=2
            )
        )
    if opts.setup == "mc":
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(opts.work, "mc"),
                monitor="val_loss",
                save_top_k=2,
                every_n_train_steps=5,
                save_last=True,
            )
        )
    if opts.max_time is not None:
        seconds = opts.max_time if rank != "1" else (opts.max_time_rank1 or opts.max_time)
        callbacks.append(L.pytorch.callbacks.Timer(duration={"seconds": seconds}))
    kwargs = dict(SETUPS[opts.setup])
    kwargs.setdefault("max_epochs", 4)
    if opts.max_steps is not None:
        kwargs["max_steps"] = opts.max_steps
    if opts.devices > 1:
        kwargs.update(devices=opts.devices, strategy="ddp")
    trainer = L.Trainer(
        accelerator="cpu",
        callbacks=callbacks,
        logger=RecordingLogger(rec, trainer_ref),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=not opts.no_callback
        or opts.setup in ("mc", "ckpt_last", "early_train"),
        default_root_dir=opts.work,
        num_sanity_val_steps=1,
        **kwargs,
    )
    trainer_ref.append(trainer)
    train = _dataset(100, 1)
    val = DataLoader(_dataset(16, 2), batch_size=8)
    if opts.setup.startswith("iterable"):
        loader = DataLoader(_Iterable(train, opts.setup == "iterable_len"), batch_size=8)
    else:
        loader = DataLoader(train, batch_size=8, shuffle=True)
    trainer.fit(model, loader, val, ckpt_path="last" if opts.setup == "ckpt_last" else None)
    _end(rec, trainer, model, 1)
    if opts.setup in ("refit", "refit_steps"):
        model.lr = 0.01
        if opts.setup == "refit":
            trainer.fit_loop.max_epochs = 4
        else:
            trainer.fit_loop.epoch_loop.max_steps = 45
        trainer.fit(model, loader, val)
        _end(rec, trainer, model, 2)
    if opts.devices > 1:
        import torch.distributed as dist

        dist.barrier()  # both ranks recorded their end
        dist.destroy_process_group()
        for proc in getattr(trainer.strategy.launcher, "procs", []):
            proc.wait()  # rank 0 (the process started) ends after the ranks it launched


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
