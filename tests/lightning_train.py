"""A Lightning training script checkpointed with ResilientCheckpoint (helper for the tests).

Not a test module. tests/test_lightning.py runs it as a real subprocess (killed with SIGKILL,
sent SIGTERM/SIGUSR1, re-run), with ``--devices 2`` as DDP on two CPU processes (Lightning's own
launcher re-runs this script for rank 1), and in-process through :func:`main`.

What makes resuming it exactly non-trivial:

- dropout (the torch RNG), plus Python's and NumPy's global RNGs feed the loss;
- a shuffled train ``DataLoader`` (plain: ``DataLoader(shuffle=True)``, which the callback turns
  into a ResumableDataLoader; or torchdata's ``StatefulDataLoader``), 100 samples in batches of
  8: 13 batches per epoch, the last one of 4, so steps cross epoch boundaries mid-schedule;
- validation every ``--val-every`` batches through a plain val ``DataLoader`` (creating its
  iterator draws from the global torch RNG) and a sanity check at start;
- AdamW with a per-step StepLR schedule;
- with ``--plateau``, two ``ReduceLROnPlateau`` schedulers on ``val_loss`` as well: one every
  3 steps (``strict=False``: it skips steps before the first validation; later it reads the
  newest validation's loss), one at each epoch's end;
- with ``--epoch-hooks``, ``on_train_start``, ``on_train_epoch_start`` and
  ``on_train_epoch_end`` each draw from the torch RNG (any work there: the draw shifts every
  later dropout mask).

Outputs: ``--out-jsonl``: one line per trained step, written in ``training_step`` before the
optimizer step, ``{"step", "loss" (float.hex), "epoch", "batch", "rank"}``, fsynced; ``--out-
params``: the final weights (safetensors). With two devices each rank appends ``.rank<r>``.
stderr gets ``[rank r] restored step N`` when training starts. ``--no-callback`` runs the same
script without ResilientCheckpoint (the baseline it must not change).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resilient_callbacks.lightning import ResilientCheckpoint

NUM_SAMPLES, NUM_VAL = 100, 16
IN_DIM, HIDDEN, OUT_DIM = 16, 32, 4


def make_dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    w = torch.randn(IN_DIM, OUT_DIM, generator=torch.Generator().manual_seed(99))
    y = x @ w + 0.1 * torch.randn(n, OUT_DIM, generator=g)
    return TensorDataset(x, y)


class Shuffled(torch.utils.data.IterableDataset):
    """The samples of a dataset in a new order each pass (``torch.randperm`` when its iterator
    is made), without a length: Lightning knows an epoch's end only when it runs out."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        for i in torch.randperm(len(self.data)).tolist():
            yield self.data[i]


class Data(L.LightningDataModule):
    def __init__(self, loader: str, val_persistent: bool = False) -> None:
        super().__init__()
        self.loader = loader
        self.val_persistent = val_persistent
        self.train_set = make_dataset(NUM_SAMPLES, 1234)
        self.val_set = make_dataset(NUM_VAL, 4321)

    def train_dataloader(self):
        if self.loader == "iterable":  # no __len__: reshuffles from the global RNG per pass
            return DataLoader(Shuffled(self.train_set), batch_size=8)
        if self.loader == "stateful-dist":  # its own DistributedSampler: Lightning keeps it
            from torch.utils.data import DistributedSampler
            from torchdata.stateful_dataloader import StatefulDataLoader

            sampler = DistributedSampler(self.train_set, shuffle=True, seed=0)
            return StatefulDataLoader(self.train_set, batch_size=8, sampler=sampler)
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(self.train_set, batch_size=8, shuffle=True)
        return DataLoader(self.train_set, batch_size=8, shuffle=True)

    def val_dataloader(self):
        if self.val_persistent:  # one iterator for the whole fit, made by its first validation
            return DataLoader(self.val_set, batch_size=8, num_workers=2, persistent_workers=True)
        return DataLoader(self.val_set, batch_size=8)


class Net(L.LightningModule):
    def __init__(
        self,
        out_jsonl: str,
        fail_at: int = 0,
        sleep: float = 0.0,
        plateau: bool = False,
        epoch_hooks: bool = False,
    ) -> None:
        super().__init__()
        self.plateau = plateau
        self.epoch_hooks = epoch_hooks
        self.save_hyperparameters({"lr": 1e-2, "hidden": HIDDEN})
        self.net = nn.Sequential(
            nn.Linear(IN_DIM, HIDDEN),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(HIDDEN, OUT_DIM),
        )
        self.out_jsonl = out_jsonl
        self.fail_at = fail_at
        self.sleep = sleep
        self.hold_at: int | None = None
        self._log = None
        self.fsdp2 = False
        self.fsdp1 = False
        self._sharded = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        step = self.global_step + 1
        if self.fail_at and step == self.fail_at:
            raise RuntimeError(f"simulated failure in step {step}")
        noise = np.random.normal(size=(1,)).item() * 1e-3 + random.random() * 1e-3
        loss = nn.functional.mse_loss(self.net(x), y) + noise
        if self._log is None:
            self._log = open(self.out_jsonl, "a")  # noqa: SIM115 - closed in on_fit_end
            if self._log.tell() > 0:
                with open(self.out_jsonl, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a previous run was killed mid-line
                        self._log.write("\n")
        rec = {
            "step": step,
            "loss": float(loss.item()).hex(),
            "epoch": self.current_epoch,
            "batch": batch_idx,
            "rank": self.global_rank,
        }
        self._log.write(json.dumps(rec) + "\n")
        self._log.flush()
        os.fsync(self._log.fileno())
        self.log("train_loss", loss)
        if step == self.hold_at:
            self._hold(step)
        if self.sleep:
            time.sleep(self.sleep)
        return loss

    def _hold(self, step: int) -> None:
        """``--hold-at``: step N's record is written; wait here until a preemption signal
        arrives (a SIGKILL ends the wait too), so a test's signal lands in this step however
        slow the machine; no signal in 300 s: exit 3."""
        from train_script import hold

        rc = next((c for c in self.trainer.callbacks if isinstance(c, ResilientCheckpoint)), None)
        hold(None if rc is None else rc.checkpointer, step)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_model(self):
        if self.fsdp2 and not self._sharded:  # ModelParallelStrategy: FSDP2 over the DP ranks
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
            self._sharded = True
        if self.fsdp1 and not self._sharded:  # FSDPStrategy on CPU: see cpu_fsdp1_strategy
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            self.net = FSDP(
                self.net,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
            self._sharded = True

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
        if not self.plateau:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def plateau():  # never "better" by a factor of 10: reduces at every call
            return torch.optim.lr_scheduler.ReduceLROnPlateau(
                opt, factor=0.9, patience=0, threshold=10.0
            )

        return [opt], [
            {"scheduler": sched, "interval": "step"},
            {
                "scheduler": plateau(),
                "interval": "step",
                "frequency": 3,
                "monitor": "val_loss",
                "strict": False,
            },
            {"scheduler": plateau(), "interval": "epoch", "monitor": "val_loss"},
        ]

    def on_train_start(self):
        if self.epoch_hooks:
            torch.rand(5)

    def on_train_epoch_start(self):
        if self.epoch_hooks:
            torch.rand(1)

    def on_train_epoch_end(self):
        if self.epoch_hooks:
            torch.rand(1)

    def on_fit_end(self):
        if self._log is not None:
            self._log.close()
            self._log = None


class ReportRestore(L.Callback):
    def __init__(self, rc: ResilientCheckpoint) -> None:
        self.rc = rc

    def on_train_start(self, trainer, pl_module):
        step = self.rc.restored_step or 0
        env = type(trainer._accelerator_connector.cluster_environment).__name__
        print(
            f"[rank {trainer.global_rank}] restored step {step} ({env})",
            file=sys.stderr,
            flush=True,
        )


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor is gathered: every rank calls this; told by its method, as
    ``torch.distributed.tensor`` has no DTensor before torch 2.5)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cpu_fsdp1_strategy() -> Any:
    """Lightning's ``FSDPStrategy`` on CPU ranks (gloo). Lightning refuses it without a GPU by
    checking its exact type (a subclass passes), and wraps the model without a ``device_id``,
    which FSDP1 refuses on a CPU; so the model wraps itself in ``configure_model`` (with
    ``device_id=cpu``), and Lightning leaves a model that holds FSDP modules as it is. Everything
    else -- setup, precision plugin, the strategy's checkpoint hooks -- is FSDPStrategy's own."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy()


def cpu_deepspeed_strategy(stage: int, ckpt_dir: str) -> Any:
    """Lightning's DeepSpeedStrategy on the CPU, with a DeepSpeed config that holds our section.

    Lightning refuses DeepSpeed on anything but a CUDA accelerator, in ``setup_environment``,
    and takes each rank's device index for the rank's GPU (a CPU device has none). DeepSpeed
    itself runs on the CPU (``DS_ACCELERATOR=cpu``, gloo). The subclass numbers the CPU devices
    by local rank (``cpu:0``, ``cpu:1``: still the CPU) and skips the CUDA check: every other
    step of the strategy (engine creation from the config, ZeRO partitioning, its
    restore-after-setup, its do-nothing weight loading) is Lightning's own."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    from ds_noshm import skip_shm_op

    skip_shm_op()

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            assert self.parallel_devices is not None
            self.parallel_devices = [
                torch.device("cpu", i) for i in range(len(self.parallel_devices))
            ]
            DDPStrategy.setup_environment(self)  # without the CUDA check

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "resilient_checkpoint": {"dirpath": ckpt_dir, "keep_last": 3},
    }
    return CPUDeepSpeedStrategy(config=config, process_group_backend="gloo")


def fit_warned(tmp_path, model, max_steps: int, about: str, accumulate: int = 1) -> list[str]:
    """Fit ``model`` with the callback in ``tmp_path/ck`` (a save every 2 steps); the warnings
    whose text holds ``about``."""
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        callbacks=[ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=4))
    return [str(w.message) for w in caught if about in str(w.message)]


def fit_deepspeed_one_rank(
    make: Any, ckpt_dir: str, max_steps: int, stage: int
) -> tuple[Any, list[warnings.WarningMessage]]:
    """One rank of :func:`cpu_deepspeed_strategy` at ``stage``: fits ``make()`` (called after
    the seed and the data) on 256 random samples of 8 features (seed 0, batches of 8) to
    ``max_steps``, with ResilientCheckpoint saving every 2 steps; returns the trainer and every
    warning the fit gave."""
    from spawn_ranks import world_of_one

    world_of_one()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 8)), batch_size=8)
    trainer = L.Trainer(
        strategy=cpu_deepspeed_strategy(stage, ckpt_dir),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[ResilientCheckpoint(every_n_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make(), data)
    return trainer, caught


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--every-n-steps", type=int, default=4)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument(
        "--loader", choices=["plain", "stateful", "stateful-dist", "iterable"], default="plain"
    )
    p.add_argument("--limit-train", type=int, default=None, help="limit_train_batches")
    p.add_argument("--reload", action="store_true", help="reload_dataloaders_every_n_epochs=1")
    p.add_argument("--min-epochs", type=int, default=None, help="Trainer(min_epochs=)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument(
        "--fsdp2", action="store_true", help="ModelParallelStrategy with fully_shard (FSDP2)"
    )
    p.add_argument("--fsdp1", action="store_true", help="FSDPStrategy (see cpu_fsdp1_strategy)")
    p.add_argument(
        "--deepspeed",
        type=int,
        default=None,
        help="DeepSpeedStrategy with this ZeRO stage (CPU: see cpu_deepspeed_strategy)",
    )
    p.add_argument("--val-every", type=int, default=6, help="0: at the end of each epoch")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--hold-at", type=int, default=None, help="wait in step N for a signal")
    p.add_argument("--fail-at", type=int, default=0)
    p.add_argument("--save-on-exception", action="store_true")
    p.add_argument(
        "--no-resumable-loaders", action="store_true", help="make_dataloaders_resumable=False"
    )
    p.add_argument("--sync", action="store_true", help="async_save=False")
    p.add_argument("--remote", default=None)
    p.add_argument("--remote-options", default=None, help="JSON")
    p.add_argument("--root", default=None, help="Trainer default_root_dir")
    p.add_argument("--ckpt-path", default=None, help="fit(ckpt_path=...)")
    p.add_argument("--model-checkpoint", action="store_true", help="add a ModelCheckpoint too")
    p.add_argument(
        "--early-stop", action="store_true", help="EarlyStopping: stops at the 2nd validation"
    )
    p.add_argument("--val-persistent", action="store_true", help="val loader: 2 kept workers")
    p.add_argument("--no-sanity", action="store_true", help="num_sanity_val_steps=0")
    p.add_argument("--csv-logs", default=None, help="a CSVLogger directory")
    p.add_argument(
        "--no-callback",
        action="store_true",
        help="the same run without ours, and without Lightning's default ModelCheckpoint",
    )
    p.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau schedulers too")
    p.add_argument("--epoch-hooks", action="store_true", help="epoch start/end hooks draw")
    p.add_argument("--data-seed", type=int, default=None, help="ResilientCheckpoint(data_seed=)")
    p.add_argument("--out-jsonl", required=True)
    p.add_argument("--out-params", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> ResilientCheckpoint | None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    # One intra-op thread: the ops of this tiny model are then deterministic on CPU.
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank ...
    model = Net(
        args.out_jsonl + (f".rank{rank}" if args.devices > 1 else ""),
        fail_at=args.fail_at,
        sleep=args.sleep,
        plateau=args.plateau,
        epoch_hooks=args.epoch_hooks,
    )
    model.hold_at = args.hold_at
    model.fsdp2 = args.fsdp2
    model.fsdp1 = args.fsdp1
    # ... then rank-specific random streams
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    kwargs: dict = {}
    if args.remote:
        kwargs["remote"] = args.remote
        kwargs["remote_options"] = json.loads(args.remote_options or "{}")
    rc = ResilientCheckpoint(
        args.ckpt_dir,
        every_n_steps=args.every_n_steps,
        keep_last=args.keep_last,
        save_on_exception=args.save_on_exception,
        make_dataloaders_resumable=not args.no_resumable_loaders,
        async_save=not args.sync,
        data_seed=args.data_seed,
        **kwargs,
    )
    callbacks: list = [] if args.no_callback else [rc, ReportRestore(rc)]
    if args.model_checkpoint:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(args.root or ".", "mc"), monitor="val_loss", save_top_k=1
            )
        )
    if args.early_stop:  # val_loss never improves by 10: stops at the second validation
        stop = L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)
        callbacks.append(stop)
    logger = False
    if args.csv_logs:
        logger = L.pytorch.loggers.CSVLogger(args.csv_logs, name="", version="")
    strategy: Any = "ddp" if args.devices > 1 else "auto"
    if args.fsdp2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    if args.fsdp1:
        strategy = cpu_fsdp1_strategy()
    if args.deepspeed is not None:
        strategy = cpu_deepspeed_strategy(args.deepspeed, args.ckpt_dir)
        if os.environ.get("RC_HOLD_DEFERRED"):  # tests/ds_train.py says what this does
            from ds_train import hold_deferred_copies

            hold_deferred_copies(f"{os.environ['RC_HOLD_DEFERRED']}.rank{rank}")
    trainer = L.Trainer(
        max_steps=args.max_steps,
        limit_train_batches=args.limit_train,
        min_epochs=args.min_epochs,
        accumulate_grad_batches=args.accumulate,
        reload_dataloaders_every_n_epochs=1 if args.reload else 0,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        val_check_interval=args.val_every or 1.0,
        num_sanity_val_steps=0 if args.no_sanity else 2,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        # Without ours, no checkpointing at all: the run to compare with. (Lightning's default
        # ModelCheckpoint under FSDPStrategy on CPU segfaults in FSDP1's full state dict hook,
        # torch 2.13: a path Lightning supports only on GPUs.)
        enable_checkpointing=not args.no_callback or args.model_checkpoint,
    )
    data = Data(args.loader, val_persistent=args.val_persistent)
    trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)

    suffix = f".rank{trainer.global_rank}" if args.devices > 1 else ""
    params = {k: _full(v).detach().clone().contiguous() for k, v in model.state_dict().items()}
    tmp = args.out_params + suffix + ".tmp"
    save_file(params, tmp)
    os.replace(tmp, args.out_params + suffix)
    return None if args.no_callback else rc


def exit_now() -> None:
    """End a rank's process without interpreter teardown: there torch's gloo threads at times
    abort the process ("terminate called without an active exception", SIGABRT) after all its
    work was done -- seen with 2 DDP ranks without our callback as with it, as in plain FSDP2
    scripts (see ``spawn_ranks.leave_group``). What an ordinary exit runs first still runs:
    the ``atexit`` handlers (a Checkpointer left open flushes), while the process group is up."""
    import atexit

    import torch.distributed as dist

    atexit._run_exitfuncs()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while a peer is still in the last collective
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
