"""Less common Trainer set-ups with ``ResilientCheckpoint``: the run with the callback is the run
without it, and a resumed run ends where the run without it ends (per-step logs, evaluations,
weights, ``train()``'s metrics, bit for bit).

The core scenarios are in tests/test_transformers.py and tests/test_transparent_transformers.py;
these are the set-ups a user probe checked on 2026-12-05 (all passed, no change of the adapter):
a SIGKILL between the micro-batches of one optimizer step, length-grouped and rebalanced
sampling of variable-length data, ``reduce_lr_on_plateau``, ``bf16`` on CPU, and a
``Seq2SeqTrainer`` of a T5 built from a config. The resumed runs here restore a checkpoint of
a run saved at every step (``resume=<step>``), in this process, as a re-run after a kill does.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint

SCRIPT = Path(__file__).with_name("hf_train.py")
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]


@pytest.mark.slow  # three runs of the script
def test_a_sigkill_between_the_micro_batches_of_a_step_then_rerun_is_exact(tmp_path):
    """Accumulation 3: killed after the first micro-batch of step 4 (no checkpoint can hold
    half-accumulated gradients), re-run: resumed from step 2, it ends as the run not killed."""
    import test_transformers as tt

    def cmd(d: Path, *extra: str) -> list[str]:
        return [
            sys.executable, str(SCRIPT), str(d / "out"), "--max-steps", str(tt.TOTAL),
            "--every-n-steps", "2", "--out-jsonl", str(d / "steps.jsonl"),
            "--out-final", str(d / "final.safetensors"), *extra,
        ]  # fmt: skip

    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    tt._run(cmd(ref))
    p = tt.subprocess.run(
        cmd(got, "--kill-between-micro-batches", "4"), capture_output=True, text=True,
        timeout=tt.RUN_TIMEOUT, env=tt._env(),
    )  # fmt: skip
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert max(tt._per_step(got / "steps.jsonl")) == 3
    assert tt._restored(tt._run(cmd(got))) == 2
    tt._assert_same_run(ref, got)


class _Varying(torch.utils.data.Dataset):
    """Token sequences of 4 to 16 tokens (padded by :func:`_pad`)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, hf_train.SEQ + 1, (n,), generator=g).tolist()
        self.x = [torch.randint(1, hf_train.VOCAB, (k,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    n, longest = len(features), max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(n, longest, dtype=torch.long)
    labels = torch.full((n, longest), -100, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        ids[i, :k], labels[i, :k], mask[i, :k] = f["input_ids"], f["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _varying_lengths(out: str, max_steps: int, **overrides: Any) -> Any:
    return hf_train.NoisyTrainer(
        model=hf_train.build_model(),
        args=hf_train.training_args(out, max_steps, **overrides),
        train_dataset=_Varying(hf_train.NUM_SAMPLES, 1),
        eval_dataset=_Varying(8, 2),
        data_collator=_pad,
    )


def _t5(out: str, max_steps: int, **overrides: Any) -> Any:
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        T5Config,
        T5ForConditionalGeneration,
    )

    class Pairs(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randint(2, 64, (n, 10), generator=g)
            self.y = torch.randint(2, 64, (n, 6), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.y[i]}

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    plain = hf_train.training_args(out, max_steps).to_dict()
    kept = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
            "warmup_steps", "logging_steps", "eval_strategy", "eval_steps", "save_strategy",
            "report_to", "use_cpu", "disable_tqdm", "seed")  # fmt: skip
    args = Seq2SeqTrainingArguments(
        output_dir=out, max_steps=max_steps, **{k: plain[k] for k in kept}, **overrides
    )
    return Seq2SeqTrainer(
        model=T5ForConditionalGeneration(config),
        args=args,
        train_dataset=Pairs(hf_train.NUM_SAMPLES, 1),
        eval_dataset=Pairs(8, 2),
    )


def _train(build: Any, out: Path, cb: ResilientCheckpoint | None, **overrides: Any) -> tuple:
    trainer = build(str(out), 10, **overrides)
    if cb is not None:
        trainer.add_callback(cb)
    result = trainer.train()
    history = hf_train.clean_history(trainer.state.log_history)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return history, weights, hf_train.without_timings(result.metrics)


SETUPS = {
    "group_by_length": (_varying_lengths, {"train_sampling_strategy": "group_by_length"}),
    "batch_rebalance": (_varying_lengths, {"train_sampling_strategy": "batch_rebalance"}),
    "reduce_lr_on_plateau": (
        hf_train.build_trainer,
        {
            "lr_scheduler_type": "reduce_lr_on_plateau",
            "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5},
            "eval_steps": 2,
        },
    ),
    "bf16": (hf_train.build_trainer, {"bf16": True}),
    "seq2seq_t5": (_t5, {"predict_with_generate": True, "generation_max_length": 6}),
}


@pytest.mark.slow  # four Trainer runs per set-up
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_less_common_setup_is_unchanged_and_resumes_exactly(tmp_path, setup):
    """10 steps (2 epochs of 5, or 4 with rebalancing), a checkpoint at every step; resumed
    inside an epoch (3) and at an epoch's end (5 or 4)."""
    build, overrides = SETUPS[setup]
    ck = tmp_path / "ck"
    without = _train(build, tmp_path / "a", None, **overrides)
    with_cb = _train(build, tmp_path / "b", ResilientCheckpoint(ck, every_n_steps=1), **overrides)
    assert with_cb[0] == without[0] and with_cb[2] == without[2]
    assert [k for k in without[1] if not torch.equal(without[1][k], with_cb[1][k])] == []
    end = 4 if setup == "batch_rebalance" else 5
    for step in (3, end):
        cb = ResilientCheckpoint(ck, every_n_steps=100, resume=step, save_on_train_end=False)
        got = _train(build, tmp_path / f"r{step}", cb, **overrides)
        assert cb.restored_step == step
        assert got[0] == without[0] and got[2] == without[2], step
        assert [k for k in without[1] if not torch.equal(without[1][k], got[1][k])] == [], step


class _EndEpochAt(TrainerCallback):
    """Ends the epoch after optimizer step ``step`` (``should_epoch_stop``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            control.should_epoch_stop = True


def test_a_max_steps_run_with_an_epoch_ended_early_resumes_to_where_it_ended(tmp_path):
    """max_steps=10, epochs of 5 steps: the Trainer's loop runs ceil(10 / 5) = 2 epochs, and
    with the first ended after step 2 the run ends at step 7, short of max_steps. Resumed
    at step 2 (the first epoch's end), 3 (in the second) or 7 (the end), it used to train on
    into a third epoch, to step 10 (the run finished at 7 too)."""

    def run(out: str, cb: ResilientCheckpoint | None) -> tuple:
        trainer = hf_train.build_trainer(out, 10, callbacks=[_EndEpochAt(2)])
        if cb is not None:
            trainer.add_callback(cb)
        result = trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        history = hf_train.clean_history(trainer.state.log_history)
        return history, weights, hf_train.without_timings(result.metrics)

    ck = tmp_path / "ck"
    without = run(str(tmp_path / "a"), None)
    assert without[0][-1]["step"] == 7
    assert run(str(tmp_path / "b"), ResilientCheckpoint(ck, every_n_steps=1))[0] == without[0]
    for step in (2, 3, 7):
        cb = ResilientCheckpoint(ck, every_n_steps=100, resume=step, save_on_train_end=False)
        got = run(str(tmp_path / f"r{step}"), cb)
        assert cb.restored_step == step
        assert got[0] == without[0] and got[2] == without[2], step
        assert [k for k in without[1] if not torch.equal(without[1][k], got[1][k])] == [], step
