"""An evaluation loop between DeepSpeed training steps (``engine.eval()`` ... ``engine.train()``).

A checkpoint holds the random streams as they are inside the ``engine.step()`` that completed
its step. An evaluation right after that step that draws from them (each iteration of a
``DataLoader`` without its own generator takes a base seed from the global torch RNG) is not run
again by a run resumed from that step, whose dropout then differs from the uninterrupted run's:
killed and re-run, the losses differed from the step after the resume on, without a word. Now
the run says so at that evaluation (once), with what to do; an evaluation that keeps off the
training streams is silent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed import run_one_rank

SCRIPT = """
import torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2, "async_save": False}}
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
val = torch.utils.data.TensorDataset(torch.randn(4, 4))
kw = {"generator": torch.Generator()} if OWN_GENERATOR else {}

def evaluate():
    engine.eval()
    with torch.no_grad():
        for (x,) in torch.utils.data.DataLoader(val, batch_size=2, **kw):
            engine(x)
    engine.train()

if engine.global_steps:
    evaluate()  # a script that evaluates where it starts
while engine.global_steps < STEPS:
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step()
    evaluate()
engine.resilient_checkpoint.close()
print("TRAIN AND EVAL ARE DeepSpeed's:", "eval" not in vars(engine) and "train" not in vars(engine))
"""


def _run(tmp_path: Path, own_generator: bool, steps: int) -> str:
    code = (
        SCRIPT.replace("DIRPATH", repr(str(tmp_path / "ck")))
        .replace("OWN_GENERATOR", str(own_generator))
        .replace("STEPS", str(steps))
    )
    out = run_one_rank(tmp_path / "train.py", code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRAIN AND EVAL ARE DeepSpeed's: True" in out.stdout  # close() gave them back
    return out.stderr


def test_an_evaluation_that_draws_after_a_checkpointed_step_is_said(tmp_path: Path) -> None:
    err = _run(tmp_path, own_generator=False, steps=3)
    said = re.findall(r"UserWarning: (resilient_callbacks: the evaluation between .*)", err)
    assert len(said) == 1, err[-3000:]  # once, at step 2's (the first checkpointed one)
    assert "between step 2, which is checkpointed" in said[0]
    assert "generator=torch.Generator()" in said[0] and "fork_rng" in said[0]
    assert re.search(r"train\.py:\d+: UserWarning", err)  # at the user's engine.train()


@pytest.mark.slow  # suite time budget (two DeepSpeed runs)
def test_an_evaluation_that_draws_before_the_first_step_after_a_resume_is_said(
    tmp_path: Path,
) -> None:
    _run(tmp_path, own_generator=True, steps=2)  # saves step 2, silently
    err = _run(tmp_path, own_generator=False, steps=3)  # resumed at 2, evaluates first
    assert "the evaluation between the resume at step 2 and the first training step" in err


@pytest.mark.slow  # suite time budget
def test_an_evaluation_on_its_own_generator_is_silent(tmp_path: Path) -> None:
    err = _run(tmp_path, own_generator=True, steps=3)
    assert "the evaluation between" not in err, err[-3000:]


LR_SCRIPT = """
import torch, deepspeed
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 4,
                     "total_num_steps": 10, "warmup_max_lr": 1e-2}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 3}}
engine, _, _, sched = rcds.initialize(model=torch.nn.Linear(4, 1), config=cfg)
for _ in range(3):
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step()
print("TRAINED", sched.get_last_lr(), engine.get_lr())
engine.resilient_checkpoint.close()
engine, _, _, sched = rcds.initialize(model=torch.nn.Linear(4, 1), config=cfg)  # resumes at 3
print("RESUMED", engine.global_steps, sched.get_last_lr(), engine.get_lr())
engine.resilient_checkpoint.close()
"""


@pytest.mark.slow  # suite time budget (a DeepSpeed process, two engines)
def test_a_deepspeed_schedulers_last_lr_is_the_restored_one(tmp_path: Path) -> None:
    """DeepSpeed's schedulers save only their iteration: after a restore, ``get_last_lr()``
    answered the rate they were built with (0.0 for a warm-up) until the next step, while the
    optimizer trained with the restored one, so a loop that logs it logged a jump to 0."""
    out = run_one_rank(tmp_path / "lr.py", LR_SCRIPT.replace("DIRPATH", repr(str(tmp_path))))
    assert out.returncode == 0, out.stderr[-3000:]
    trained = re.search(r"TRAINED (\[.*\]) (\[.*\])", out.stdout)
    resumed = re.search(r"RESUMED 3 (\[.*\]) (\[.*\])", out.stdout)
    assert trained and resumed, out.stdout
    assert trained.group(1) == trained.group(2) != "[0.0]"
    assert (resumed.group(1), resumed.group(2)) == (trained.group(1), trained.group(2))
