"""A DeepSpeed run resumed with its config changed (real DeepSpeed on the CPU, one rank;
``ds_changes.py`` is the run, ``test_deepspeed_changes.run`` runs it):

- optimizer hyper-parameters changed (the lr in the config): the saved ones are restored, as
  DeepSpeed's ``load_checkpoint`` restores them, and a warning names each change (the new lr
  was dropped without a word); an lr the script sets while training is no change;
- the ZeRO stage changed (1 -> 2, 2 -> 3, 3 -> 2): the run goes on exactly as a run at the new
  stage from the start would have;
- the micro-batch size changed: the data goes on at the next sample;
- the type or params of DeepSpeed's scheduler changed: the new one schedules on from the
  restored iteration; a torch scheduler's settings changed (``T_max``): the checkpoint's are
  loaded, as DeepSpeed's ``load_checkpoint`` loads them, and a warning names each; a scheduler of another kind (DeepSpeed's <-> torch's) is refused before anything
  loads, whatever key of the state comes first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed_changes import run

CHANGED = "the optimizer's hyper-parameters were configured otherwise"


@pytest.mark.slow  # three DeepSpeed runs
@pytest.mark.parametrize("stage", [2, 0])
def test_a_changed_lr_is_named_and_the_saved_one_trains_on(tmp_path: Path, stage: int) -> None:
    """ZeRO 1-3 record the configured values in the partition index, ZeRO 0 with the counters
    (the optimizer is saved whole there)."""
    d = tmp_path / "ck"
    z = ("--stage", str(stage))
    run(d, *z, "--steps", "4", "--every", "4", "--lr", "0.01")
    changed = run(d, *z, "--steps", "6", "--every", "4", "--lr", "0.1")
    assert isinstance(changed, dict)
    assert CHANGED in changed["output"]
    assert "lr: 0.01 saved, 0.1 now" in changed["output"]
    assert changed["restored"] == 4 and changed["lr"] == 0.01
    ref = run(tmp_path / "ref", *z, "--steps", "6", "--every", "4", "--lr", "0.01")
    assert isinstance(ref, dict)
    assert changed["digest"] == ref["digest"]  # the resume is exact
    assert CHANGED not in ref["output"]


@pytest.mark.slow  # two DeepSpeed runs
def test_an_lr_the_script_sets_while_training_is_no_change(tmp_path: Path) -> None:
    """The loop sets the lr by hand at every step (nanoGPT's get_lr): the saved lr is not the
    configured one, yet the config did not change, and no change is named."""
    d = tmp_path / "ck"
    run(d, "--steps", "4", "--every", "4", "--lr-by-hand")
    resumed = run(d, "--steps", "6", "--every", "4", "--lr-by-hand")
    assert isinstance(resumed, dict) and resumed["restored"] == 4
    assert CHANGED not in resumed["output"]


@pytest.mark.slow  # three DeepSpeed runs each
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2), (1, 2)])
def test_a_zero_stage_change_goes_on_as_the_new_stage_would_have(
    tmp_path: Path, before: int, after: int
) -> None:
    """The fp32 masters and moments are restored by parameter range whatever the stage: the
    resumed run is bit-identical to one at the new stage throughout (on one rank the stages
    train alike until the checkpoint's step), and no hyper-parameter counts as changed."""
    d = tmp_path / "ck"
    run(d, "--stage", str(before), "--steps", "4", "--every", "4", "--scheduler")
    resumed = run(d, "--stage", str(after), "--steps", "8", "--every", "4", "--scheduler")
    ref = run(
        tmp_path / "ref", "--stage", str(after), "--steps", "8", "--every", "4", "--scheduler"
    )
    assert isinstance(resumed, dict) and isinstance(ref, dict)
    assert resumed["restored"] == 4
    assert (resumed["digest"], resumed["lr"]) == (ref["digest"], ref["lr"])
    assert CHANGED not in resumed["output"]


@pytest.mark.slow  # three DeepSpeed runs
def test_a_changed_micro_batch_size_goes_on_at_the_next_sample(tmp_path: Path) -> None:
    """train_micro_batch_size_per_gpu 4, then 8: the loader of ``training_data`` goes on at the
    sample after the last one trained (its position counts samples of the epoch's order), so
    nothing is trained twice or skipped: the samples are those an uninterrupted run at 4 takes."""
    d = tmp_path / "ck"
    first = run(d, "--data", "--steps", "4", "--every", "4")
    then = run(d, "--data", "--micro", "8", "--steps", "8", "--every", "4")
    ref = run(tmp_path / "ref", "--data", "--steps", "12", "--every", "12")
    assert isinstance(first, dict) and isinstance(then, dict) and isinstance(ref, dict)
    assert then["restored"] == 4 and len(then["samples"]) == 4 * 8
    assert first["samples"] + then["samples"] == ref["samples"]


@pytest.mark.slow  # three DeepSpeed runs
def test_a_changed_scheduler_type_schedules_on_from_the_restored_iteration(
    tmp_path: Path,
) -> None:
    """WarmupLR, then WarmupDecayLR in the config: DeepSpeed's schedulers save only their
    iteration, so the new schedule goes on from it (its rate at step 8 is that of a run with
    WarmupDecayLR throughout), with the trained weights of the first."""
    d = tmp_path / "ck"
    run(d, "--steps", "4", "--every", "4", "--scheduler", "WarmupLR")
    then = run(d, "--steps", "8", "--every", "4", "--scheduler", "WarmupDecayLR")
    ref = run(tmp_path / "ref", "--steps", "8", "--every", "4", "--scheduler", "WarmupDecayLR")
    assert isinstance(then, dict) and isinstance(ref, dict)
    assert then["restored"] == 4 and then["lr"] == ref["lr"]
    assert CHANGED not in then["output"]


SETTINGS = "the checkpoint's LR scheduler settings replace those your code passed"


@pytest.mark.slow  # three DeepSpeed runs
def test_a_changed_torch_scheduler_setting_is_named_and_the_saved_one_schedules_on(
    tmp_path: Path,
) -> None:
    """torch's CosineAnnealingLR given to initialize, T_max 10 then 100: its load_state_dict
    takes the checkpoint's T_max (as DeepSpeed's load_checkpoint, which calls it), so the run
    goes on as one with T_max 10 throughout; the new T_max was dropped without a word. A
    warning names it, and the way on."""
    d = tmp_path / "ck"
    run(d, "--scheduler", "Cosine", "--t-max", "10", "--steps", "4", "--every", "4")
    then = run(d, "--scheduler", "Cosine", "--t-max", "100", "--steps", "8", "--every", "4")
    ref = run(tmp_path / "ref", "--scheduler", "Cosine", "--t-max", "10", "--steps", "8")
    assert isinstance(then, dict) and isinstance(ref, dict)
    assert then["restored"] == 4 and then["t_max"] == 10
    assert (then["digest"], then["lr"]) == (ref["digest"], ref["lr"])
    said = then["output"]
    assert SETTINGS in said and SETTINGS not in ref["output"]
    assert (
        "engine.lr_scheduler (CosineAnnealingLR): T_max=10 from the checkpoint (100 here)" in said
    )
    assert "as DeepSpeed's own load_checkpoint does" in said
    assert "set them on engine.lr_scheduler once rcds.initialize" in said  # (not 'restore()')
    assert "restore()" not in said


@pytest.mark.slow  # three DeepSpeed runs
def test_a_roll_back_keeps_the_t_max_set_after_the_resume(tmp_path: Path) -> None:
    """T_max 10, then 100 set on engine.lr_scheduler once rcds.initialize returned, as the
    warning says; at step 6 the loop rolls back (engine.resilient_checkpoint.restore(), to
    step 4). The roll-back loaded T_max 10 again and warned again; now the run keeps its 100 and
    schedules on as the run that did not roll back."""
    d = tmp_path / "ck"
    run(d, "--scheduler", "Cosine", "--t-max", "10", "--steps", "4", "--every", "4")
    new = ("--scheduler", "Cosine", "--t-max", "100", "--set-t-max", "100", "--every", "100")
    back = run(d, *new, "--steps", "8", "--roll-back-at", "6")
    ref = run(d, *new, "--steps", "8")  # (the roll-back saved nothing: from step 4 again)
    assert isinstance(back, dict) and isinstance(ref, dict)
    assert back["restored"] == ref["restored"] == 4
    assert back["t_max"] == ref["t_max"] == 100
    assert back["lr"] == ref["lr"]
    assert back["output"].count(SETTINGS) == 1, back["output"]


@pytest.mark.slow  # three DeepSpeed runs
def test_changed_params_of_deepspeeds_scheduler_take_effect_without_a_word(tmp_path: Path) -> None:
    """WarmupDecayLR's total_num_steps 20, then 40 in the config: DeepSpeed's schedulers save
    only their iteration, so the new settings schedule on from it (the rate at step 8 is that
    of a run with 40 throughout), as with DeepSpeed's load_checkpoint; nothing to name."""
    d = tmp_path / "ck"
    sched = ("--scheduler", "WarmupDecayLR")
    run(d, *sched, "--total", "20", "--steps", "4", "--every", "4")
    then = run(d, *sched, "--total", "40", "--steps", "8", "--every", "4")
    ref = run(tmp_path / "ref", *sched, "--total", "40", "--steps", "8", "--every", "4")
    old = run(tmp_path / "old", *sched, "--total", "20", "--steps", "8", "--every", "4")
    assert isinstance(then, dict) and isinstance(ref, dict) and isinstance(old, dict)
    assert then["restored"] == 4 and then["lr"] == ref["lr"] != old["lr"]
    assert SETTINGS not in then["output"]


@pytest.mark.slow  # two DeepSpeed runs
@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ("fp32", "bf16"),
        ("fp16", "bf16"),
        ("fp16", "fp32"),
        ("bf16", "fp32"),
        ("fp32", "fp16"),
        ("bf16", "fp16"),
    ],
)
def test_a_dtype_change_at_zero0_is_refused_before_anything_loads(
    tmp_path: Path, saved: str, now: str
) -> None:
    """ZeRO 0 saves the optimizer whole, as DeepSpeed builds it for one dtype: fp32 -> bf16
    failed inside DeepSpeed's fp16 wrapper (``KeyError: 'dynamic_loss_scale'``) after the module
    was loaded, and fp16 -> bf16 (the same wrapper class) loaded the fp16 run's dynamic loss
    scaler into the bf16 engine without a word; fp16 or bf16 -> fp32 was refused as another
    optimizer class (DeepSpeed's wrapper, then the torch optimizer) with no word of the dtype.
    All are refused, naming the two dtypes and the ways on."""
    names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    d = tmp_path / "ck"
    run(d, "--stage", "0", "--steps", "4", "--every", "4", "--dtype", saved)
    out = run(d, "--stage", "0", "--steps", "8", "--every", "4", "--dtype", now, fails=True)
    assert isinstance(out, str)
    assert f"trained in {names[saved]} and this engine trains in {names[now]}" in out
    assert "CheckpointMismatchError" in out and "resilient-ckpt export" in out
    assert "rejected the checkpoint" not in out
    assert "does not fit the objects it is loaded into" not in out  # (the optimizer's class)


@pytest.mark.slow  # two DeepSpeed runs
@pytest.mark.parametrize(("saved", "now"), [("WarmupLR", "LambdaLR"), ("LambdaLR", "WarmupLR")])
def test_a_scheduler_of_another_kind_is_refused_before_anything_loads(
    tmp_path: Path, saved: str, now: str
) -> None:
    """DeepSpeed's WarmupLR in the config, then torch's LambdaLR given to initialize (or the
    other way): the saved state of one does not fit the other. It failed in the scheduler's
    load_state_dict (KeyError 'lr_lambdas' or 'last_batch_iteration'), after the model and
    optimizer were loaded; refused first, naming both."""
    d = tmp_path / "ck"
    run(d, "--steps", "4", "--every", "4", "--scheduler", saved)
    out = run(d, "--steps", "8", "--every", "4", "--scheduler", now, fails=True)
    assert isinstance(out, str)
    assert "CheckpointMismatchError: the checkpoint's LR scheduler is" in out
    assert saved in out.split("LR scheduler is")[1].split(",")[0]
    assert "rejected the checkpoint" not in out and "resilient-ckpt export" in out


def test_a_scheduler_of_another_kind_is_refused_before_a_key_ahead_of_the_counters_loads(
    tmp_path: Path,
) -> None:
    """The refusal ran only in the counters' load_state_dict, so it came before the rest loaded
    only while "counters" was the state's first key: a state with the engine's module ahead of
    them (``ds_counters_first.py``) had the module loaded when it came. The counters refuse in
    ``refuse_saved``, which the restore asks before anything loads. (One process, ~5 s.)"""
    import spawn_ranks

    script = Path(__file__).with_name("ds_counters_first.py")
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",  # (the zygote's)
        "PYTHONPATH": os.pathsep.join([str(script.parents[1] / "src"), str(script.parent)]),
    }
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = tmp_path / "ds_counters_first.log"
    zygote = spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu")
    p = zygote.spawn([sys.executable, str(script), str(tmp_path / "ck")], env, log)
    try:
        returncode = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    out = log.read_text()
    assert returncode == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["error"].startswith("CheckpointMismatchError: the checkpoint's LR scheduler")
    assert "WarmupLR, this engine's torch.optim.lr_scheduler.LambdaLR" in result["error"]
    assert result["module_untouched"], "the module was loaded before the refusal"


@pytest.mark.slow  # three Lightning DeepSpeed runs
@pytest.mark.parametrize("stage", [2, 0])
def test_a_lightning_lr_set_by_hand_is_no_change_at_any_resume(tmp_path: Path, stage: int) -> None:
    """Lightning builds the engine's state again after its restore (and before the saves): the
    values recorded as configured were the restored ones, the warm-up's lr of the saved step,
    and the second resume warned of an lr change the config never made."""
    for steps in (4, 6, 8):
        out = _lightning_run("pl_ds_hand_lr.py", tmp_path / "ck", steps, stage)
        assert f"RESULT {steps}" in out
        assert CHANGED not in out, out[-3000:]


@pytest.mark.slow  # two Lightning DeepSpeed runs
def test_a_lightning_deepspeed_scheduler_setting_changed_is_named_once(tmp_path: Path) -> None:
    """Under Lightning's DeepSpeedStrategy, Lightning keeps the scheduler out of the engine and
    restores it itself: T_max 10, then 100 in configure_optimizers, is named once (by the
    Lightning callback), and the saved T_max schedules on, as Lightning's own resume."""
    outs = [
        _lightning_run("pl_ds_scheduler.py", tmp_path / "ck", steps, 2, t_max)
        for steps, t_max in ((4, 10), (6, 100))
    ]
    assert "RESULT 4 10" in outs[0] and "WARNING" not in outs[0]
    assert "RESULT 6 10" in outs[1], outs[1][-3000:]
    said = [x for x in outs[1].splitlines() if x.startswith("WARNING ")]
    assert len(said) == 1, said
    assert (
        "lr_schedulers[0] (CosineAnnealingLR): T_max=10 from the checkpoint (100 here)" in said[0]
    )


def _lightning_run(name: str, *args: object) -> str:
    """The output of the Lightning DeepSpeed script ``tests/<name>`` run with ``args`` in a
    fresh single-process world (no torchrun variables), after it exited 0."""
    script = Path(__file__).with_name(name)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(script.parents[1] / "src"), str(script.parent)]),
    }
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    return out
