"""Lightning and Transformers training on CUDA with our callback (helper for tests/test_gpu.py).

Not a test module. ``python tests/gpu_frameworks.py {lightning,transformers} CKPT_DIR --out-jsonl
F --out-params P [--overlap] [--sleep S] [--fsdp {1,2}] [--deepspeed {2,3}]`` trains a small
model with dropout on one GPU (``--fsdp``: under FSDP1 or FSDP2, a world of one;
``--deepspeed``: Lightning's DeepSpeedStrategy) with deterministic algorithms, writes one
fsynced line per optimizer step ({"step", "loss" as float.hex}) and at the end the final
parameters (safetensors). Re-running it after a SIGKILL resumes from the newest checkpoint;
stderr says ``restored step N``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from safetensors.torch import save_file


def _append(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _save_params(model: torch.nn.Module, path: str, zero_stage: int = 0) -> None:
    import torch.distributed as dist

    if zero_stage == 3:  # DeepSpeed ZeRO 3: each parameter gathered in turn
        import deepspeed

        sd = {}
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                sd[name] = p.detach().cpu().clone()
    elif dist.is_initialized() and not zero_stage:  # FSDP: the full tensors, gathered
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        sd = model.state_dict()
    params = {k: v.detach().cpu().clone().contiguous() for k, v in sd.items()}
    save_file(params, path + ".tmp")
    os.replace(path + ".tmp", path)


def run_lightning(args: argparse.Namespace) -> None:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from resilient_callbacks.lightning import ResilientCheckpoint

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(400, 64, generator=g)
    y = x[:, :8].sum(1, keepdim=True)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 1)
            )

        def training_step(self, batch, _idx):
            xb, yb = batch
            return nn.functional.mse_loss(self.net(xb), yb)

        def configure_model(self):
            if args.fsdp == 2:  # ModelParallelStrategy: the module shards itself
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[3]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    log = open(args.out_jsonl, "a")  # noqa: SIM115 (closed at exit)

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            print(f"restored step {trainer.global_step}", file=sys.stderr, flush=True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _append(log, {"step": trainer.global_step, "loss": float(outputs["loss"]).hex()})
            if args.sleep:
                time.sleep(args.sleep)

    model = Net()
    strategy: object = "auto"
    if args.fsdp == 1:
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    elif args.fsdp == 2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy()
    elif args.deepspeed:  # torch's AdamW from configure_optimizers, as Lightning users write it
        from lightning.pytorch.strategies import DeepSpeedStrategy

        config = {
            "train_micro_batch_size_per_gpu": 16,
            "zero_optimization": {"stage": args.deepspeed},
            "zero_allow_untested_optimizer": True,
        }
        strategy = DeepSpeedStrategy(config=config)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ResilientCheckpoint(
                args.ckpt_dir, every_n_steps=5, keep_last=2, overlap_snapshot=args.overlap
            ),
            Record(),
        ],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    _save_params(model, args.out_params, zero_stage=args.deepspeed)


def run_transformers(args: argparse.Namespace) -> None:
    import transformers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from resilient_callbacks.transformers import ResilientCheckpoint

    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x = torch.randint(0, 128, (96, 32), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    log = open(args.out_jsonl, "a")  # noqa: SIM115 (closed at exit)

    class Record(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            print(f"restored step {state.global_step}", file=sys.stderr, flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                _append(log, {"step": state.global_step, "loss": float(logs["loss"]).hex()})
                if args.sleep:
                    time.sleep(args.sleep)

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    )
    targs = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.ckpt_dir), "hf_out"),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        full_determinism=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **fsdp_arguments(args.fsdp),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
    trainer.add_callback(
        ResilientCheckpoint(
            args.ckpt_dir, every_n_steps=5, keep_last=2, overlap_snapshot=args.overlap
        )
    )
    trainer.add_callback(Record())
    trainer.train()
    _save_params(trainer.model, args.out_params)


def fsdp_arguments(version: int) -> dict:
    """The Trainer's FSDP (``version`` 1 or 2; 0: none) on this one GPU: accelerate enables FSDP
    in a distributed run only, so this process is one of a world of one."""
    if not version:
        return {}
    from spawn_ranks import world_of_one

    world_of_one()
    layer = {"transformer_layer_cls_to_wrap": ["GPT2Block"]}
    return {"fsdp": True, "fsdp_config": {"version": version, **layer}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["lightning", "transformers"])
    p.add_argument("ckpt_dir")
    p.add_argument("--out-jsonl", required=True)
    p.add_argument("--out-params", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--overlap", action="store_true", help="overlap_snapshot=True")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument(
        "--fsdp",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="FSDP1 or FSDP2: Lightning's FSDPStrategy / ModelParallelStrategy, the Trainer's fsdp",
    )
    p.add_argument(
        "--deepspeed",
        type=int,
        default=0,
        choices=[0, 2, 3],
        help="Lightning's DeepSpeedStrategy with this ZeRO stage (DeepSpeed needed)",
    )
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    (run_lightning if args.framework == "lightning" else run_transformers)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
