"""A Hugging Face Trainer script with ResilientCheckpoint added (helper for the tests).

Not a test module. Run as a real subprocess by test_transformers.py (killed with SIGKILL or
SIGTERM and re-run) and, under torchrun (``--ddp``: 2 CPU processes, gloo), by
test_transformers_ddp.py.

The script is written the way a user writes one: build a model and a Trainer, add the callback,
call ``trainer.train()``; re-running it continues from the newest valid checkpoint. The model is a
2-layer GPT-2 built from a config (dropout on, so the torch RNG matters), trained on synthetic
tokens with AdamW, a warmup + linear schedule, weight decay, gradient accumulation 3 (an epoch of
13 batches: 5 optimizer steps, the last one over a single batch), an evaluation every 4 steps and
the best eval_loss tracked. The loss gets a tiny term from Python's and NumPy's global RNGs, so
their restore matters too.

Outputs (with ``--ddp`` each rank appends ``.rank<r>``):
  --out-jsonl   one line per logged training step: {"step", "loss", "grad_norm",
                "learning_rate", "epoch"} (floats as float.hex), flushed and fsynced;
  --out-final   at the end: final parameters (safetensors) at PATH and, at PATH + ".json", the
                log history and train()'s metrics (both without timings) and the best metric.
stderr gets ``restored step N`` when training begins. ``--default-logging`` leaves the logging
of transformers as a script that does not configure it gets it (otherwise: errors only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from resilient_callbacks.transformers import ResilientCheckpoint

NUM_SAMPLES = 50  # 13 batches of 4 per epoch (the last one of 2)
SEQ = 16
VOCAB = 64
TIMING_KEYS = ("runtime", "per_second")


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic synthetic tokens; remembers which indices were read."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads.append(int(i))
        return {"input_ids": self.x[i], "labels": self.x[i]}


class NoisyTrainer(Trainer):
    """The loss gets a tiny term from Python's and NumPy's global RNGs. ``RC_OWN_SAMPLER``
    (weighted, subset, random): the training data is drawn by a sampler with its own
    generator, as a class-balancing subclass returns from ``_get_train_sampler``."""

    def _get_train_sampler(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kind = os.environ.get("RC_OWN_SAMPLER")
        if not kind:
            return super()._get_train_sampler(*args, **kwargs)
        g = torch.Generator().manual_seed(11)
        n = len(self.train_dataset)
        if kind == "weighted":
            return torch.utils.data.WeightedRandomSampler(torch.linspace(1, 3, n), n, generator=g)
        if kind == "subset":
            return torch.utils.data.SubsetRandomSampler(range(n), generator=g)
        return torch.utils.data.RandomSampler(self.train_dataset, generator=g)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        noise = 1e-4 * (float(np.random.rand()) + random.random())
        if return_outputs:
            return loss[0] + noise, loss[1]
        return loss + noise


def build_model(frozen_base: bool = False) -> GPT2LMHeadModel:
    """The tiny GPT-2 of these tests. ``frozen_base``: wider (each block's weights 64-256 KiB,
    sharded pieces above the 16 KiB of a blob), and only the last block's MLP trained, as an
    adapter fine-tune leaves a base model."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=128 if frozen_base else 32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    if frozen_base:
        model.requires_grad_(False)
        model.transformer.h[-1].mlp.requires_grad_(True)
    return model


def training_args(outdir: str, max_steps: int, ddp: bool = False, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=outdir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=3,
        max_steps=max_steps,
        learning_rate=5e-3,
        warmup_steps=2,
        weight_decay=0.01,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=4,
        metric_for_best_model="eval_loss",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
        ddp_backend="gloo" if ddp else None,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


class SeededMasking:
    """A data collator that masks 15% of the input tokens (token 0), drawn from a generator of
    its own created at its first call from ``seed``, as ``DataCollatorForLanguageModeling(...,
    seed=...)`` does (``--collator-seed``)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.generator = seed, None

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        batch = torch.utils.data.default_collate(features)
        mask = torch.rand(batch["input_ids"].shape, generator=self.generator) < 0.15
        batch["input_ids"] = batch["input_ids"].masked_fill(mask, 0)
        return batch


def build_trainer(
    outdir: str,
    max_steps: int = 14,
    *,
    ddp: bool = False,
    callbacks: list | None = None,
    train_dataset: torch.utils.data.Dataset | None = None,
    frozen_base: bool = False,
    collator_seed: int | None = None,
    **overrides,
) -> NoisyTrainer:
    """The Trainer of this script (a fresh model, same seeds), for in-process tests too."""
    return NoisyTrainer(
        data_collator=SeededMasking(collator_seed) if collator_seed is not None else None,
        model=build_model(frozen_base),
        args=training_args(outdir, max_steps, ddp, **overrides),
        train_dataset=train_dataset if train_dataset is not None else TokenDataset(NUM_SAMPLES, 1),
        eval_dataset=TokenDataset(8, seed=2),
        callbacks=callbacks,
    )


class Recorder(TrainerCallback):
    """Writes each logged training step, fsynced; reports the restored step; sleeps per step.
    ``hold_at``: once step N is written, waits until a preemption signal arrives (a SIGKILL
    ends the wait too), so a test's signal lands at that step however slow the machine; no
    signal in 300 s: exit 3."""

    def __init__(
        self, ckpt: ResilientCheckpoint, path: str, rank: int, sleep: float, hold_at: int | None
    ) -> None:
        self.ckpt, self.path, self.rank, self.sleep = ckpt, path, rank, sleep
        self.hold_at = hold_at
        self.f = open(path, "a")  # noqa: SIM115 - kept open for the whole run
        if self.f.tell() > 0:
            with open(path, "rb") as g:
                g.seek(-1, os.SEEK_END)
                if g.read(1) != b"\n":  # a previous run was killed mid-line
                    self.f.write("\n")

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"[rank {self.rank}] restored step {self.ckpt.restored_step or 0}", file=sys.stderr)
        sys.stderr.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            rec = {"step": state.global_step}
            for k in ("loss", "grad_norm", "learning_rate", "epoch"):
                rec[k] = float(logs[k]).hex()
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            os.fsync(self.f.fileno())
            if state.global_step == self.hold_at:
                self._hold(state.global_step)

    def _hold(self, step: int) -> None:
        from train_script import hold

        hold(self.ckpt.checkpointer, step)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.sleep:
            time.sleep(self.sleep)


class ReadsRecorder(TrainerCallback):
    """Writes the training samples each optimizer step read (on this process), fsynced."""

    def __init__(self, dataset: TokenDataset, path: str) -> None:
        self.dataset, self.seen = dataset, len(dataset.reads)
        self.f = open(path, "a")  # noqa: SIM115 - kept open for the whole run

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        reads = self.dataset.reads[self.seen :]
        self.seen = len(self.dataset.reads)
        self.f.write(json.dumps({"step": state.global_step, "reads": reads}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


class KillBetweenMicroBatches(TrainerCallback):
    """SIGKILLs this process after the first micro-batch of optimizer step ``step`` (its
    gradients half accumulated): a crash at a point no checkpoint can be taken at. The
    background saves of the steps before are committed first (``flush()``), so the checkpoint
    a re-run resumes from is the last one taken however loaded the machine (an async save
    still staging when killed would leave an older one)."""

    def __init__(self, step: int, ckpt: ResilientCheckpoint) -> None:
        self.step, self.ckpt = step, ckpt

    def on_substep_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step + 1 == self.step:
            if self.ckpt.checkpointer is not None:
                self.ckpt.checkpointer.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def without_timings(values: dict) -> dict:
    return {k: v for k, v in values.items() if not any(t in k for t in TIMING_KEYS)}


def clean_history(history: list[dict]) -> list[dict]:
    """The log history without wall-clock values (timings differ between runs)."""
    out = []
    for entry in history:
        if any(k.startswith("resilient/") for k in entry):
            continue  # save timings
        out.append(without_timings(entry))  # the end-of-train() summary keeps train_loss
    return out


def deepspeed_config(args: argparse.Namespace) -> dict:
    """A ZeRO config of "auto" values (the Trainer fills them in) with our section."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_noshm import skip_shm_op

    skip_shm_op()
    from spawn_ranks import world_of_one

    world_of_one()
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.deepspeed},
        "resilient_checkpoint": {
            "dirpath": os.path.join(args.outdir, "ckpt"),
            "every_n_steps": args.every_n_steps,
            "keep_last": args.keep_last,
            **({"overlap_snapshot": True} if args.overlap else {}),
        },
    }


def fsdp_options() -> dict:
    """The Trainer's FSDP2, every GPT-2 block a unit of its own (on CPU: see
    accelerate_fsdp_cpu)."""
    if not torch.cuda.is_available():
        import accelerate_fsdp_cpu

        accelerate_fsdp_cpu.allow()
    return {
        "fsdp": True,
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
    }


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor (a DTensor's gathered), detached and contiguous."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().clone().contiguous()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--every-n-steps", type=int, default=2, help="0: no save trigger")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument(
        "--hold-at", type=int, default=None, help="wait at step N for a signal (Recorder)"
    )
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--default-logging", action="store_true")
    p.add_argument(
        "--deepspeed",
        type=int,
        default=None,
        metavar="STAGE",
        help="train under DeepSpeed ZeRO STAGE (CPU), the callback's options in the config's "
        "resilient_checkpoint section",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="train under the Trainer's FSDP2 (fully_shard through accelerate; with --ddp)",
    )
    p.add_argument("--overlap", action="store_true", help="overlap_snapshot=True")
    p.add_argument(
        "--persistent-workers",
        action="store_true",
        help="dataloader_num_workers=2, dataloader_persistent_workers=True",
    )
    p.add_argument(
        "--frozen-base",
        action="store_true",
        help="a wider model with only the last block's MLP trained, saved with incremental=True",
    )
    p.add_argument(
        "--accumulation", type=int, default=3, help="gradient_accumulation_steps (default 3)"
    )
    p.add_argument(
        "--record-reads",
        action="store_true",
        help="also write the training samples each optimizer step read to OUT_JSONL.reads",
    )
    p.add_argument(
        "--kill-between-micro-batches",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL this process after the first micro-batch of optimizer step STEP",
    )
    p.add_argument(
        "--collator-seed",
        type=int,
        default=None,
        help="collate with SeededMasking(SEED) (a collator with a generator of its own)",
    )
    p.add_argument(
        "--args-json", default="{}", help="more TrainingArguments overrides, as a JSON object"
    )
    p.add_argument("--trainer-checkpoints", action="store_true", help="trainer_checkpoints=True")
    p.add_argument(
        "--early-stopping", type=int, default=None, metavar="PATIENCE",
        help="add EarlyStoppingCallback(PATIENCE) before the callback",
    )  # fmt: skip
    p.add_argument("--out-state", default=None, help="hf_final_state.write() at the end")
    p.add_argument("--out-jsonl", required=True)
    p.add_argument("--out-final", required=True)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if not args.default_logging:
        transformers.logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", "0")) if args.ddp else 0
    suffix = f".rank{rank}" if args.ddp else ""

    overrides = json.loads(args.args_json)
    if args.accumulation != 3:
        overrides["gradient_accumulation_steps"] = args.accumulation
    if args.deepspeed is not None:
        overrides["deepspeed"] = deepspeed_config(args)
        if os.environ.get("RC_HOLD_DEFERRED"):  # tests/ds_train.py says what this does
            from ds_train import hold_deferred_copies

            hold_deferred_copies(f"{os.environ['RC_HOLD_DEFERRED']}.rank{rank}")
    if args.fsdp:
        overrides.update(fsdp_options())
    if os.environ.get("RC_OWN_SAMPLER") == "random":  # kept: accelerate would replace it
        overrides["accelerator_config"] = {"use_seedable_sampler": False}
    if args.persistent_workers:
        overrides.update(dataloader_num_workers=2, dataloader_persistent_workers=True)
    trainer = build_trainer(
        args.outdir,
        args.max_steps,
        ddp=args.ddp,
        frozen_base=args.frozen_base,
        collator_seed=args.collator_seed,
        callbacks=(
            [transformers.EarlyStoppingCallback(args.early_stopping)]
            if args.early_stopping is not None
            else None
        ),
        **overrides,
    )
    model = trainer.model
    if args.deepspeed is not None:
        ckpt = ResilientCheckpoint()  # its options come from the DeepSpeed config
    else:
        ckpt = ResilientCheckpoint(
            os.path.join(args.outdir, "ckpt"),
            every_n_steps=args.every_n_steps or None,  # 0: no save trigger
            keep_last=args.keep_last,
            overlap_snapshot=args.overlap,
            incremental=args.frozen_base,
            trainer_checkpoints=args.trainer_checkpoints,
        )
    trainer.add_callback(ckpt)
    trainer.add_callback(Recorder(ckpt, args.out_jsonl + suffix, rank, args.sleep, args.hold_at))
    if args.kill_between_micro_batches is not None:
        trainer.add_callback(KillBetweenMicroBatches(args.kill_between_micro_batches, ckpt))
    if args.record_reads:
        trainer.add_callback(
            ReadsRecorder(trainer.train_dataset, args.out_jsonl + ".reads" + suffix)
        )
    result = trainer.train()

    if args.deepspeed is not None:
        engine = trainer.model_wrapped
        assert "resilient_checkpoint" not in engine.config, "the section reached DeepSpeed"
        from deepspeed.utils import safe_get_full_fp32_param

        params = {
            k: safe_get_full_fp32_param(p).detach().clone().contiguous()
            for k, p in engine.module.named_parameters()
        }
    else:
        params = {k: full(v) for k, v in model.state_dict().items()}
    final = args.out_final + suffix
    save_file(params, final + ".tmp")
    os.replace(final + ".tmp", final)
    with open(final + ".json", "w") as f:
        json.dump(
            {
                "log_history": clean_history(trainer.state.log_history),
                "best_metric": trainer.state.best_metric,
                "metrics": without_timings(result.metrics),
                "global_step": trainer.state.global_step,
            },
            f,
        )
    if args.out_state is not None:
        import hf_final_state

        hf_final_state.write(trainer, args.out_state + suffix)
    if args.ddp:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
