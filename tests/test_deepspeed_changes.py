"""DeepSpeed resumes with unusual optimizer state, and with what changed between two runs of a
directory (real DeepSpeed on the CPU, one rank; ``ds_changes.py`` is the run):

- an optimizer whose state holds values besides its moments and ``step`` (NAdam's
  ``mu_product``, ASGD's ``eta``/``mu``): saved and restored, the resume exact (it crashed);
- another optimizer than the one the checkpoint was written with: refused, naming both (its
  state keys and hyper-parameters were loaded into it);
- another dtype (bf16 <-> fp16): the new engine's loss scaler is kept, with a warning (the
  saved one's fields were copied onto it);
- fp16, a checkpoint of before the first step that was not skipped: DeepSpeed's
  ``safe_get_full_optimizer_state`` still finds the moments after the resume (it never did).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).with_name("ds_changes.py")


def run(d: Path, *args: str, fails: bool = False) -> dict | str:
    """One run of ``ds_changes.py`` on ``d``; its RESULT, or its output where it ``fails``. A
    fresh process forked from the session's zygote that imported deepspeed once (its import
    costs seconds a run)."""
    import spawn_ranks

    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",  # (the zygote's: else a fresh interpreter is started)
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1] / "src"), str(SCRIPT.parent)]),
    }
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = d.parent / f"ds_changes.{time.time_ns()}.log"
    zygote = spawn_ranks.shared_zygote("deepspeed", DS_ACCELERATOR="cpu")
    p = zygote.spawn([sys.executable, str(SCRIPT), "--dir", str(d), *args], env, log)
    try:
        returncode = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    out = log.read_text()  # (stdout and stderr)
    if fails:
        assert returncode != 0, out[-3000:]
        return out
    assert returncode == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return {**json.loads(line[len("RESULT ") :]), "output": out}


@pytest.mark.parametrize(
    ("opt", "stage"),
    [
        ("NAdam", 2),
        pytest.param("ASGD", 1, marks=pytest.mark.slow),
        pytest.param("NAdam", 3, marks=pytest.mark.slow),
    ],
)
def test_an_optimizer_with_values_besides_its_moments_resumes_exactly(
    tmp_path: Path, opt: str, stage: int
) -> None:
    common = ("--opt", opt, "--stage", str(stage), "--every", "4")
    ref = run(tmp_path / "ref", "--steps", "7", *common)
    assert run(tmp_path / "run", "--steps", "4", *common)["restored"] == 0
    resumed = run(tmp_path / "run", "--steps", "7", *common)
    assert resumed["restored"] == 4
    assert resumed["digest"] == ref["digest"]
    assert resumed["keys"] == ref["keys"]


@pytest.mark.slow  # suite time budget (each a DeepSpeed run or two)
def test_single_values_follow_the_parameter_group_into_other_partitions(tmp_path: Path) -> None:
    """Saved at ZeRO 2 (one flat partition), resumed at ZeRO 3 with a sub_group_size that
    splits the group into two sub-groups: each gets the group's ``mu_product`` (the second got
    none, and the first step raised KeyError), and both go on stepping alike."""
    stage3 = ("--opt", "NAdam", "--stage", "3", "--sub-group-size", "16")
    first = run(tmp_path / "run", "--steps", "4", "--opt", "NAdam", "--stage", "2")
    (saved,) = first["values"]
    assert "mu_product" in saved, first
    resumed = run(tmp_path / "run", "--steps", "6", *stage3)
    assert resumed["restored"] == 4
    assert resumed["restored_values"] == [saved, saved], resumed
    after, also = resumed["values"]
    assert after == also and after["mu_product"] != saved["mu_product"], resumed


def test_another_optimizer_than_the_checkpoints_is_refused(tmp_path: Path) -> None:
    run(tmp_path / "ck", "--steps", "4", "--opt", "AdamW")
    out = run(tmp_path / "ck", "--steps", "6", "--opt", "SGD", "--lr", "0.1", fails=True)
    said = " ".join(out.split())
    assert "CheckpointMismatchError" in said, said[-2000:]
    assert "AdamW" in said and "SGD" in said, said[-2000:]


@pytest.mark.slow  # suite time budget (each a DeepSpeed run or two)
def test_another_dtype_keeps_the_new_engines_loss_scaler(tmp_path: Path) -> None:
    """bf16 then fp16: the fp16 run starts with its configured dynamic scale (2**8), not the
    bf16 run's static scale of 1; a warning names both dtypes."""
    run(tmp_path / "ck", "--steps", "4", "--dtype", "bf16")
    resumed = run(tmp_path / "ck", "--steps", "4", "--dtype", "fp16", "--scale-power", "8")
    assert resumed["restored"] == 4
    assert resumed["dynamic"] is True and resumed["scale"] == 2.0**8, resumed
    said = " ".join(resumed["output"].split())
    assert "trained in bfloat16, this engine in float16" in said and "loss scale" in said, said


@pytest.mark.slow  # suite time budget (each a DeepSpeed run or two)
def test_fp16_moments_stay_reachable_after_a_resume_before_the_first_real_step(
    tmp_path: Path,
) -> None:
    """A scale of 2**30 overflows: the first steps are skipped, and the checkpoint at step 2
    holds no moments yet. After the resume, the first step that is not skipped makes them, and
    DeepSpeed's safe_get_full_optimizer_state finds them (it raised "exp_avg not found")."""
    common = ("--dtype", "fp16", "--scale-power", "30", "--every", "2", "--stage", "2")
    first = run(tmp_path / "ck", "--steps", "2", *common)
    assert first["keys"] == [], first  # every step so far was skipped: no state yet
    resumed = run(tmp_path / "ck", "--steps", "40", *common)
    assert resumed["restored"] == 2 and resumed["keys"], resumed
    assert resumed["exp_avg"] is True, resumed


@pytest.mark.slow  # suite time budget (each a DeepSpeed run or two)
def test_the_engines_training_dataloader_is_the_resumable_one(tmp_path: Path) -> None:
    """A script iterating ``engine.training_dataloader`` (DeepSpeed's attribute for the loader
    it makes from training_data), as unchanged scripts under the launcher do: it was None. It is
    the loader returned (whose exact mid-epoch resume test_deepspeed.py tests)."""
    first = run(tmp_path / "run", "--steps", "4", "--data", "--every", "4")
    assert first["engines_loader_is_the_returned_one"] is True
    resumed = run(tmp_path / "run", "--steps", "6", "--data", "--every", "4")
    assert resumed["restored"] == 4 and resumed["engines_loader_is_the_returned_one"] is True


def test_the_guard_sees_a_section_given_by_the_deprecated_deepscale_config(tmp_path: Path) -> None:
    """``--deepscale_config`` (DeepSpeed's old name for --deepspeed_config, still accepted):
    its section was not looked at, so no warning said nothing is checkpointed."""
    import argparse

    import resilient_callbacks_ds_guard as guard

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"resilient_checkpoint": {"dirpath": str(tmp_path / "ck")}}))
    assert guard.has_section(args=argparse.Namespace(deepscale_config=str(path)))


@pytest.mark.slow
def test_initialize_checkpoints_with_the_deprecated_deepscale_config(tmp_path: Path) -> None:
    """rcds.initialize(args=...) with the config in ``args.deepscale_config``: checkpointed."""
    run(tmp_path / "ck", "--steps", "4", "--deepscale")
    assert run(tmp_path / "ck", "--steps", "5", "--deepscale")["restored"] == 4


@pytest.mark.distributed
@pytest.mark.slow  # suite time budget (a refusal; 10 s)
def test_moe_expert_parallelism_is_refused_at_initialize(tmp_path: Path) -> None:
    """Experts split over 2 ranks (ep_size=2) were saved under the same names by both ranks
    (a resume on 1 rank missed half of them; export failed); docs promised a refusal."""
    import spawn_ranks

    outs = spawn_ranks.run(
        [sys.executable, str(SCRIPT.with_name("ds_moe.py")), str(tmp_path / "ck")],
        2,
        tmp_path,
        "moe",
        env={"DS_ACCELERATOR": "cpu"},
        deadline=300.0,
    ).outputs
    for out in outs:
        said = " ".join(out.split())
        assert "REFUSED UnsupportedStateError" in said and "ep_size=2" in said, said[-2000:]


@pytest.mark.parametrize("frozen_first", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_parameter_frozen_in_one_run_only_is_named_as_the_change(
    tmp_path: Path, frozen_first: bool
) -> None:
    """ZeRO 1, the bias frozen in one run and trained in the other: the error named an
    internal key ("unexpected keys in checkpoint: 'module_extras'"); it names the bias."""
    first, second = (["--freeze-bias"], []) if frozen_first else ([], ["--freeze-bias"])
    run(tmp_path / "ck", "--steps", "4", "--stage", "1", *first)
    out = run(tmp_path / "ck", "--steps", "6", "--stage", "1", *second, fails=True)
    said = " ".join(out.replace("[rank0]:", "").split())
    assert "CheckpointMismatchError" in said, said[-2000:]
    assert "requires_grad=False" in said and "Freeze the same parameters" in said, said[-2000:]
    if not frozen_first:
        assert "this engine freezes bias (requires_grad=False)" in said, said[-2000:]
    else:  # (it said "some parameters frozen")
        assert "saved with bias frozen (requires_grad=False)" in said, said[-2000:]


@pytest.mark.slow  # suite time budget: test_a_parameter_frozen_in_one_run_only_... runs by default
@pytest.mark.parametrize("frozen_first", [False, True])
def test_a_freeze_change_at_zero3_names_the_parameter_as_frozen_or_trained(
    tmp_path: Path, frozen_first: bool
) -> None:
    """ZeRO 3, the bias frozen in one run only: the error said the bias was "not in the model"
    (or "missing from the checkpoint"); it says which run froze it."""
    first, second = (["--freeze-bias"], []) if frozen_first else ([], ["--freeze-bias"])
    run(tmp_path / "ck", "--steps", "4", "--stage", "3", *first)
    out = run(tmp_path / "ck", "--steps", "6", "--stage", "3", *second, fails=True)
    said = " ".join(out.replace("[rank0]:", "").split())
    change = "frozen when saved, trained now" if frozen_first else "trained when saved, frozen now"
    assert "CheckpointMismatchError: parameters changed between frozen" in said, said[-2000:]
    assert f"{change}: ['bias']" in said and "Freeze the same parameters" in said, said[-2000:]


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_another_number_of_parameter_groups_is_refused_saying_how_on(tmp_path: Path) -> None:
    """One parameter group when saved, two now (a no-weight-decay group for the biases): each
    group's hyper-parameters are restored by position, so the checkpoint is refused as a
    mismatch that says how on (it was an UnsupportedStateError that said neither)."""
    run(tmp_path / "ck", "--steps", "4")
    out = run(tmp_path / "ck", "--steps", "6", "--two-groups", fails=True)
    said = " ".join(out.split())
    assert "CheckpointMismatchError" in said, said[-2000:]
    assert "has 1 parameter group(s), this engine's 2" in said, said[-2000:]
    assert "Give the optimizer the parameter groups" in said, said[-2000:]


@pytest.mark.distributed
@pytest.mark.slow  # two groups of 2 DeepSpeed ranks
def test_parameters_given_in_another_order_resume_on_the_same_number_of_ranks(
    tmp_path: Path,
) -> None:
    """ZeRO 2 on 2 ranks, resumed with the optimizer given the biases before the weights (the
    same parameters, another flat layout: each rank now holds other ranges of them). Each rank
    read only its own files, found them short and called the checkpoint corrupt; now the
    layout is recorded and another one reads every rank's ranges: the restored weights and
    moments are those saved."""
    from test_deepspeed import _opts, final, restored, run_group

    ck = str(tmp_path / "ck")
    run_group(
        ["--dir", ck, "--out", str(tmp_path / "saved"), *_opts(2, "fp32", 6)], 2, tmp_path, "a"
    )
    more = ["--dir", ck, "--out", str(tmp_path / "more"), "--dump-restored", "--biases-first"]
    run_group([*more, *_opts(2, "fp32", 8)], 2, tmp_path, "b")
    assert all(restored(tmp_path / "more", r)["step"] == 6 for r in range(2))
    saved = final(tmp_path / "saved")
    loaded = json.loads(Path(f"{tmp_path / 'more'}.rank0.restored_state.json").read_text())
    assert saved.keys() == loaded.keys()
    assert [k for k in saved if saved[k] != loaded[k]] == []


CURRICULUM = """
import torch
from ds_noshm import skip_shm_op
skip_shm_op()
import resilient_callbacks.deepspeed as rcds
from resilient_callbacks import UnsupportedStateError
curriculum = {"enabled": True, "curriculum_metrics": {}}
cfg = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "data_efficiency": {"enabled": True,
                           "data_sampling": {"enabled": True, "curriculum_learning": curriculum}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2}}
data = torch.utils.data.TensorDataset(torch.randn(8, 4))
try:
    rcds.initialize(model=torch.nn.Linear(4, 1), training_data=data, config=cfg)
except UnsupportedStateError as e:
    print("REFUSED:", e)
"""


def test_curriculum_data_sampling_with_training_data_is_refused(tmp_path: Path) -> None:
    """DeepSpeed's curriculum data sampling orders the batches of the loader it makes from
    ``training_data``; ours replaced that loader without it, and the run trained without its
    curriculum, in silence. Refused, before DeepSpeed builds the engine."""
    from test_deepspeed import run_one_rank

    code = CURRICULUM.replace("DIRPATH", repr(str(tmp_path / "ck")))
    out = run_one_rank(tmp_path / "curriculum.py", code)
    assert out.returncode == 0, out.stderr[-3000:]
    said = " ".join(out.stdout.split())
    assert "REFUSED: resilient_callbacks.deepspeed: curriculum data sampling" in said, (
        out.stdout[-2000:] + out.stderr[-2000:]
    )
    assert not (tmp_path / "ck").exists()  # nothing was made


@pytest.mark.parametrize(
    ("saved", "now"), [(2, 3), pytest.param(3, 2, marks=pytest.mark.slow)], ids=["2to3", "3to2"]
)
def test_a_stage_change_with_frozen_parameters_is_refused_as_such(
    tmp_path: Path, saved: int, now: int
) -> None:
    """The bias frozen in both runs, the ZeRO stage changed between 1-2 (frozen parameters
    saved whole) and 3 (by partition): the refusal said that one run trained every parameter,
    which neither did; it says that this stage change with frozen parameters is not supported
    yet, and how on."""
    run(tmp_path / "ck", "--steps", "4", "--stage", str(saved), "--freeze-bias")
    out = run(tmp_path / "ck", "--steps", "6", "--stage", str(now), "--freeze-bias", fails=True)
    said = " ".join(out.replace("[rank0]:", "").split())
    assert "CheckpointMismatchError" in said, said[-2000:]
    assert "trains every one" not in said, said[-2000:]
    assert "with frozen parameters is not supported yet" in said, said[-2000:]
    how = "Resume at ZeRO 1 or 2" if saved == 2 else "resume at ZeRO 3"
    assert how in said, said[-2000:]


NOT_GIVEN = """
import sys, torch
import resilient_callbacks.deepspeed as rcds
from ds_noshm import skip_shm_op
skip_shm_op()
torch.manual_seed(SEED)  # the second run starts the layer the optimizer is not given elsewhere
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": STAGE},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2, "async_save": False}}
engine, *_ = rcds.initialize(model=model, model_parameters=model[2].parameters(), config=cfg)
x = torch.ones(2, 4)
while engine.global_steps < 4:
    engine.backward(engine(x).pow(2).mean())
    engine.step()
print("RESTORED", engine.resilient_checkpoint.restored_step)
print("OUT", engine(x).detach().flatten()[0].item().hex())
engine.resilient_checkpoint.close()
"""


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_parameters_not_given_to_the_optimizer_are_saved_and_exported(
    tmp_path: Path, stage: int
) -> None:
    """ZeRO 1-3 with the optimizer given only the last layer, the first still requiring grad:
    the first layer is in no ZeRO partition, and nothing saved it. A run resumed with that
    layer initialised otherwise went on with those values, in silence, and `export` left it
    out. It is saved like a frozen parameter: the resumed model is the saved one."""
    from test_deepspeed import run_one_rank

    ck = tmp_path / "ck"
    outs = []
    for seed in (0, 7):
        code = NOT_GIVEN.replace("SEED", str(seed)).replace("STAGE", str(stage))
        out = run_one_rank(tmp_path / f"run{seed}.py", code.replace("DIRPATH", repr(str(ck))))
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out.stdout)
    assert "RESTORED 0" in outs[0] and "RESTORED 4" in outs[1], outs
    first, resumed = (re.search(r"OUT (\S+)", o).group(1) for o in outs)
    assert resumed == first, outs
    cli = [sys.executable, "-m", "resilient_callbacks", "export", str(ck), str(tmp_path / "w")]
    subprocess.run(cli, check=True, capture_output=True, text=True)
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "w" / "model.safetensors")) == [
        "0.bias", "0.weight", "2.bias", "2.weight",
    ]  # fmt: skip


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_an_lr_scheduler_added_between_runs_is_refused_saying_so(tmp_path: Path) -> None:
    """A scheduler in the second run's config only: the refusal named an internal key
    ("missing keys in checkpoint: 'lr_scheduler'") and suggested another model or run; it
    says which run had a scheduler and how on."""
    run(tmp_path / "ck", "--steps", "4")
    out = run(tmp_path / "ck", "--steps", "6", "--scheduler", fails=True)
    said = " ".join(out.replace("[rank0]:", "").split())
    assert "CheckpointMismatchError" in said, said[-2000:]
    assert "saved by an engine with no LR scheduler; this engine has one" in said, said[-2000:]
    assert "Configure the scheduler as the run that saved it did" in said, said[-2000:]


RANDOM_LTD = """
import json, sys, torch
from ds_noshm import skip_shm_op
skip_shm_op()
import resilient_callbacks.deepspeed as rcds
torch.manual_seed(0)
ltd = {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1,
       "random_ltd_layer_id": [0], "model_mask_name": "attention_mask",
       "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
       "random_ltd_schedule": {"min_value": 8, "max_value": 64, "schedule_type": "fixed_linear",
                               "schedule_config": {"require_steps": 10, "seq_per_step": 8}}}
cfg = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}},
       "resilient_checkpoint": {"dirpath": DIRPATH, "every_n_steps": 2}}
model = torch.nn.Linear(4, 1)
engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
while engine.global_steps < STEPS:
    loss = engine(torch.randn(2, 4)).sum(); engine.backward(loss); engine.step()
print("RESULT", json.dumps(engine.random_ltd_scheduler.state_dict()))
"""


BEFORE_2026_12_06 = """
import resilient_callbacks.deepspeed.engine_state as es
def _as_before(engine):  # what this module saved before 33989e5: the frozen parameters only
    return {f"frozen/{n}": p.data for n, p in engine.module.named_parameters()
            if not p.requires_grad}
es.module_extras = _as_before
import resilient_callbacks.deepspeed.stage_views as vw
_init = vw.Zero3View.__init__
def _init_as_before(self, engine):  # ZeRO 3: the frozen ones only, by partition
    _init(self, engine)
    self._frozen = {n: p for n, p in engine.module.named_parameters()
                    if not p.requires_grad and getattr(p, "ds_tensor", None) is not None}
vw.Zero3View.__init__ = _init_as_before
"""


@pytest.mark.slow
def test_random_ltd_scheduler_state_resumes(tmp_path: Path) -> None:
    """DeepSpeed's Random-LTD scheduler counts the layer tokens consumed (and the kept length);
    DeepSpeed's checkpoints hold that count, ours did not: a resumed run counted from 0 again.
    Saved and restored now: stopped at step 4 and resumed to 6, it counts as a run of 6."""
    from test_deepspeed import run_one_rank

    def result(d: str, steps: int) -> dict:
        code = RANDOM_LTD.replace("DIRPATH", repr(str(tmp_path / d))).replace("STEPS", str(steps))
        out = run_one_rank(tmp_path / f"ltd_{d}_{steps}.py", code)
        assert out.returncode == 0, out.stderr[-3000:]
        (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[len("RESULT ") :])

    ref = result("ref", 6)
    stopped = result("run", 4)
    assert stopped["consumed_layer_tokens"] < ref["consumed_layer_tokens"]
    assert result("run", 6) == ref


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_before_parameters_not_given_to_the_optimizer_were_saved_resumes(
    tmp_path: Path, stage: int
) -> None:
    """ZeRO 2-3, the optimizer given only the last layer: a checkpoint written before such
    parameters were saved (33989e5) holds none of them. The upgrade refused it (ZeRO 2: 'this
    engine freezes 0.bias, 0.weight (requires_grad=False)', which it did not; ZeRO 3: 'frozen
    ZeRO-3 parameters differ'); it resumes, as the version that wrote it did, keeping this
    run's values of them, and says so."""
    from test_deepspeed import run_one_rank

    ck = tmp_path / "ck"
    outs = []
    for i in range(2):
        code = NOT_GIVEN.replace("SEED", "0").replace("STAGE", str(stage))
        if i == 0:  # saved by the code of before
            code = code.replace("skip_shm_op()\n", "skip_shm_op()\n" + BEFORE_2026_12_06, 1)
        out = run_one_rank(tmp_path / f"run{i}.py", code.replace("DIRPATH", repr(str(ck))))
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out)
    assert "RESTORED 0" in outs[0].stdout and "RESTORED 4" in outs[1].stdout
    first, resumed = (re.search(r"OUT (\S+)", o.stdout).group(1) for o in outs)
    assert resumed == first
    assert "holds no values of 0.bias, 0.weight, which require grad" in outs[1].stderr
