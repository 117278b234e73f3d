"""Trainer settings beyond the defaults, each killed with a real SIGKILL between the
micro-batches of an optimizer step (gradient accumulation 3: half a window accumulated) and run
again with the same command: the re-run continues exactly like a run never killed. Every later
step runs once, with the uninterrupted run's loss, gradient norm, learning rate and epoch; the
final weights, the optimizer's and scheduler's states, every global RNG, the ``TrainerState``
counters (``num_input_tokens_seen``, ``best_metric``, ``best_global_step``, the best
checkpoint's name), the exportable callbacks' states, the Trainer's ``checkpoint-N``
directories left and the log history are the uninterrupted run's, bit for bit.

The script is tests/hf_train.py, run by the crash helpers of tests/test_transformers.py."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file

import test_transformers as tt

SCRIPT = Path(__file__).with_name("hf_train.py")
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]

# name: (TrainingArguments overrides, more script options, every_n_steps, step killed in)
SETTINGS: dict[str, tuple[dict, list[str], int, int]] = {
    # the tokens seen counted per micro-batch, the loss normalised by the window's tokens
    "tokens_seen": (
        {"include_num_input_tokens_seen": True, "average_tokens_across_devices": True},
        [], 2, 8,
    ),
    # the Trainer's own checkpoints kept (its best protected by save_total_limit=1) and saved
    # every 2 steps, ours every 3: the killed run left a checkpoint-8 newer than the step
    # resumed (6), and its best changed after that step
    "load_best_model_at_end": (
        {"load_best_model_at_end": True, "save_strategy": "steps", "save_steps": 2,
         "eval_steps": 2, "save_total_limit": 1},
        ["--trainer-checkpoints"], 3, 9,
    ),
    "early_stopping": ({"eval_steps": 1}, ["--early-stopping", "100"], 2, 8),
    "cosine_with_restarts_adafactor": (
        {"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 3},
         "optim": "adafactor"},
        [], 2, 8,
    ),
    "reduce_lr_on_plateau_sgd": (
        {"lr_scheduler_type": "reduce_lr_on_plateau",
         "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5}, "eval_steps": 2,
         "optim": "sgd", "optim_args": "momentum=0.9"},
        [], 2, 8,
    ),
    "warmup_stable_decay_no_clipping": (
        {"lr_scheduler_type": "warmup_stable_decay",
         "lr_scheduler_kwargs": {"num_stable_steps": 6, "num_decay_steps": 5},
         "optim": "adamw_torch", "max_grad_norm": 0},
        [], 2, 8,
    ),
}  # fmt: skip


def _cmd(d: Path, name: str) -> list[str]:
    overrides, extra, every, _ = SETTINGS[name]
    return [
        sys.executable, str(SCRIPT), str(d / "out"), "--max-steps", str(tt.TOTAL),
        "--every-n-steps", str(every), "--args-json", json.dumps(overrides),
        "--out-jsonl", str(d / "steps.jsonl"), "--out-final", str(d / "final.safetensors"),
        "--out-state", str(d / "state.safetensors"), *extra,
    ]  # fmt: skip


def _assert_same_state(ref: Path, got: Path) -> dict:
    a, b = load_file(str(ref / "state.safetensors")), load_file(str(got / "state.safetensors"))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    ref_doc = json.loads((ref / "state.safetensors.json").read_text())
    got_doc = json.loads((got / "state.safetensors.json").read_text())
    for key in ref_doc:
        assert got_doc[key] == ref_doc[key], key
    return ref_doc


def _killed_and_rerun(tmp_path: Path, name: str) -> dict:
    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    tt._run(_cmd(ref, name))
    kill_in, every = SETTINGS[name][3], SETTINGS[name][2]
    p = tt.subprocess.run(
        [*_cmd(got, name), "--kill-between-micro-batches", str(kill_in)],
        capture_output=True, text=True, timeout=tt.RUN_TIMEOUT, env=tt._env(),
    )  # fmt: skip
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert max(tt._per_step(got / "steps.jsonl")) == kill_in - 1
    offset = (got / "steps.jsonl").stat().st_size
    restored = tt._restored(tt._run(_cmd(got, name)))
    assert restored == (kill_in - 1) // every * every
    # each later step ran once, in order
    assert [r["step"] for r in tt._records_from(got / "steps.jsonl", offset)] == list(
        range(restored + 1, tt.TOTAL + 1)
    )
    tt._assert_same_run(ref, got)
    return _assert_same_state(ref, got)


@pytest.mark.slow  # three runs of the script each (about 18 s for the cheapest)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_setting_killed_mid_window_then_rerun_is_exact(tmp_path, name):
    doc = _killed_and_rerun(tmp_path, name)
    if name == "tokens_seen":
        assert int(doc["state"]["num_input_tokens_seen"]) > 0
    if name == "load_best_model_at_end":
        assert doc["best_model_checkpoint"] is not None
        assert doc["best_model_checkpoint"] in doc["trainer_checkpoints"]
        assert doc["state"]["best_global_step"] > 6  # the best changed after the resume
    if name == "early_stopping":
        (counter,) = [s["attributes"] for n, s in doc["callbacks"] if n == "EarlyStoppingCallback"]
        assert counter["early_stopping_patience_counter"] > 0
