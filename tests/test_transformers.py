"""The Hugging Face Trainer adapter: ``trainer.add_callback(ResilientCheckpoint(...))`` and
``trainer.train()`` resumes exactly.

Crash tests run tests/hf_train.py (a tiny GPT-2 Trainer with gradient accumulation 3, dropout,
evaluation and best-metric tracking) as a real subprocess, stop it with a real SIGKILL or
SIGTERM while the parent watches its per-step JSONL log, and run the same command again: the
per-step losses, gradient norms, learning rates and epochs, the final weights and the Trainer's
log history match an uninterrupted run bit for bit. The other tests build the same Trainer in
this process (``hf_train.build_trainer``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from safetensors.torch import load_file
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from transformers import AutoModel, AutoModelForCausalLM, TrainerCallback

import hf_ds_plain
import hf_train
import spawn_ranks
from resilient_callbacks import (
    Checkpointer,
    CheckpointMismatchError,
    ConfigError,
    ForeignCheckpointsWarning,
    ResumeFallbackWarning,
    catalog,
    history,
)
from resilient_callbacks.transformers import ResilientCheckpoint, export_pretrained
from resilient_callbacks.transformers.data import make_resumable
from resilient_callbacks.transformers.export import cli_export

SCRIPT = Path(__file__).with_name("hf_train.py")
TOTAL = 14  # optimizer steps; an epoch is 5 of them (13 batches, accumulation 3)
UPDATES_PER_EPOCH = 5
EVERY = 2
SLEEP = 0.15  # per step in runs that get a signal, so the parent lands it between steps
RUN_TIMEOUT = 240

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _one_thread():
    """The in-process Trainers use one intra-op thread, like the subprocess runs (the machine
    is small and shared; more threads only contend)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    return env


def _cmd(workdir: Path, sleep: float = 0.0) -> list[str]:
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(workdir / "out"),
        "--max-steps",
        str(TOTAL),
        "--every-n-steps",
        str(EVERY),
        "--out-jsonl",
        str(workdir / "steps.jsonl"),
        "--out-final",
        str(workdir / "final.safetensors"),
    ]
    return [*cmd, "--sleep", str(sleep)] if sleep else cmd


def _start(cmd: list[str], log: Path) -> spawn_ranks.Forked | subprocess.Popen:
    """Start ``cmd`` (of hf_train.py), its stdout and stderr to ``log``: a fresh process forked
    from the session's zygote that imported Transformers once (seconds of CPU a run), with the
    offline variables Hugging Face reads at import set there as in :func:`_env`. A command that
    is not ``python hf_train.py ...`` (``python -m <launcher> ...``) is a fresh interpreter."""
    if cmd[1] != str(SCRIPT):
        with open(log, "w") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
    env = {k: v for k, v in _env().items() if k.startswith(("HF_", "TRANSFORMERS_"))}
    return spawn_ranks.shared_zygote("hf_train", **env).spawn(cmd, _env(), log)


def _run(cmd: list[str]) -> str:
    """Run ``cmd`` to its end; its stderr. ``python hf_train.py ... --out-jsonl F``: forked by
    :func:`_start`, its output (stdout and stderr), also in a log beside F."""
    if cmd[1] != str(SCRIPT) or "--out-jsonl" not in cmd:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=_env())
        assert p.returncode == 0, (
            f"run failed (rc={p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        )
        return p.stderr
    log = Path(cmd[cmd.index("--out-jsonl") + 1]).parent / f"run-{time.time_ns()}.log"
    p = _start(cmd, log)
    try:
        rc = p.wait(timeout=RUN_TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    out = log.read_text()
    assert rc == 0, f"run failed (rc={rc})\n{out[-9000:]}"
    return out


def _restored(stderr: str) -> int:
    m = re.search(r"restored step (\d+)", stderr)
    assert m, f"the script did not report its restored step:\n{stderr[-4000:]}"
    return int(m.group(1))


def _records_from(path: Path, offset: int = 0) -> list[dict]:
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().split(b"\n")[:-1]  # the last piece may be a line being written
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by SIGKILL
            continue
    return out


def _per_step(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _records_from(path)}  # a resumed run's records win


def _run_and_signal(
    cmd: list[str],
    workdir: Path,
    at_step: int,
    sig: int,
    committed: tuple[Path, int] | None = None,
) -> tuple[int, int, str]:
    """Start ``cmd`` (of hf_train.py); once it has logged step ``at_step``, send ``sig``.
    Returns (exit code, last step it logged, its output). The run waits at that step for the
    signal (``--hold-at``), so the signal lands there however loaded the machine is.
    ``committed=(ckpt_dir, step)``: also wait until that step's checkpoint is committed there
    (a background save of an earlier step may still be in flight at ``at_step``)."""
    jsonl = workdir / "steps.jsonl"
    offset = jsonl.stat().st_size if jsonl.exists() else 0
    errpath = workdir / f"stderr-{int(time.time() * 1e6)}.txt"
    proc = _start([*cmd, "--hold-at", str(at_step)], errpath)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            recs = _records_from(jsonl, offset)
            if (
                recs
                and recs[-1]["step"] >= at_step
                and (committed is None or committed[1] in _committed_steps(committed[0]))
            ):
                os.kill(proc.pid, sig)
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended before step {at_step}:\n{errpath.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no step {at_step} within {RUN_TIMEOUT} s:\n{errpath.read_text()}")
            time.sleep(0.05)
        rc = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, _records_from(jsonl, offset)[-1]["step"], errpath.read_text()


def _assert_same_run(ref: Path, got: Path, suffix: str = "") -> None:
    """Per-step records, final weights and log history identical, bit for bit (``total_flos``
    too, also under DeepSpeed ZeRO-3: transformers/under_deepspeed.py)."""
    ref_steps, got_steps = (
        _per_step(ref / f"steps.jsonl{suffix}"),
        _per_step(got / f"steps.jsonl{suffix}"),
    )
    assert sorted(ref_steps) == list(range(1, TOTAL + 1))
    assert sorted(got_steps) == list(range(1, TOTAL + 1)), "steps missing"
    diff = [s for s in ref_steps if ref_steps[s] != got_steps[s]]
    assert not diff, (
        f"{len(diff)} step(s) differ from the uninterrupted run, first {diff[0]}:\n"
        f"  uninterrupted {ref_steps[diff[0]]}\n  resumed       {got_steps[diff[0]]}"
    )
    a = load_file(str(ref / f"final.safetensors{suffix}"))
    b = load_file(str(got / f"final.safetensors{suffix}"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"
    ref_final = json.loads((ref / f"final.safetensors{suffix}.json").read_text())
    got_final = json.loads((got / f"final.safetensors{suffix}.json").read_text())
    assert got_final == ref_final  # log history (loss, eval_loss, epoch, ...) and best metric


def _committed_steps(d: Path) -> set[int]:
    return {e.step for e in catalog.committed(catalog.scan(str(d), catalog.Depth.NONE))}


def _committed(d: Path) -> list[catalog.Entry]:
    return catalog.committed(catalog.scan(str(d), catalog.Depth.FULL))


class _Reference:
    """The uninterrupted run, started in the background (the machine has two cores: it runs
    while a test drives its interrupted run) and awaited on first use."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.log = workdir, workdir / "reference.log"
        self.proc = _start(_cmd(workdir), self.log)
        self.done = False

    def result(self) -> Path:
        if not self.done:
            try:
                self.proc.wait(timeout=RUN_TIMEOUT)
            except TimeoutError:
                self.proc.kill()
                pytest.fail(
                    f"the uninterrupted run did not finish:\n{self.log.read_text()[-4000:]}"
                )
            out = self.log.read_text()
            assert self.proc.returncode == 0, f"uninterrupted run failed:\n{out[-9000:]}"
            assert _restored(out) == 0
            self.done = True
        return self.workdir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = _Reference(tmp_path_factory.mktemp("hf-reference"))
    yield ref.result
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


# ---------------------------------------------------------------------------- crash tests


def test_sigkill_mid_epoch_then_sigterm_then_rerun_is_bit_exact(tmp_path, reference):
    """Run 1 is killed with SIGKILL mid-epoch; run 2 (the same command) resumes and gets SIGTERM,
    saves an emergency checkpoint and exits 75; run 3 resumes at that step and finishes. The
    result equals the uninterrupted run, bit for bit. (No sleep per step: each signal is
    landed at its step by ``--hold-at``, the run waiting there for it.)"""
    cmd = _cmd(tmp_path)
    ckdir = tmp_path / "out" / "ckpt"

    rc, killed_at, err = _run_and_signal(cmd, tmp_path, 7, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert _restored(err) == 0

    rc, stopped_at, err = _run_and_signal(cmd, tmp_path, 10, signal.SIGTERM)
    restored = _restored(err)
    # The newest checkpoint committed before the kill: a multiple of EVERY, inside an epoch
    # (so the resume starts mid-epoch, mid accumulation schedule), at most 2 intervals lost.
    assert restored % EVERY == 0 and 0 < restored <= killed_at and killed_at - restored <= 2 * EVERY
    assert restored % UPDATES_PER_EPOCH != 0, "the kill landed on an epoch boundary"
    assert rc == 75  # SIGTERM: checkpoint saved, "restart me"
    newest = _committed(ckdir)[-1]
    assert newest.status is catalog.Status.VALID and newest.manifest.reason == "emergency"
    assert newest.step == stopped_at  # the step the run had completed when it stopped

    assert _restored(_run(_cmd(tmp_path))) == stopped_at
    _assert_same_run(reference(), tmp_path)
    # Nothing of the Trainer's own checkpointing was written; ours kept keep_last=3.
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").iterdir())
    assert [e.step for e in _committed(ckdir)][-1] == TOTAL
    assert len(_committed(ckdir)) == 3


# ---------------------------------------------------------------------------- in-process


def _train(
    outdir: Path,
    ckpt: ResilientCheckpoint | None,
    max_steps: int,
    *,
    callbacks: list | None = None,
    resume_from_checkpoint: str | None = None,
    **overrides,
):
    trainer = hf_train.build_trainer(str(outdir), max_steps, callbacks=callbacks, **overrides)
    if ckpt is not None:
        trainer.add_callback(ckpt)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


class _CountingSampler:
    """Wraps the Trainer's index sampler and counts the indices it hands out."""

    def __init__(self, inner) -> None:
        self.inner, self.drawn = inner, 0

    def __iter__(self):
        for i in self.inner:
            self.drawn += 1
            yield i

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)


class _CountDraws(TrainerCallback):
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        batch_sampler = train_dataloader.batch_sampler
        self.sampler = batch_sampler.sampler = _CountingSampler(batch_sampler.sampler)


class _ProbeDataset(hf_train.TokenDataset):
    """Records, at its first read, how many indices the sampler had handed out."""

    counter: _CountDraws | None = None
    drawn_at_first_read: int | None = None

    def __getitem__(self, i):
        if self.drawn_at_first_read is None and self.counter is not None:
            self.drawn_at_first_read = self.counter.sampler.drawn
        return super().__getitem__(i)


def test_resume_reads_no_batch_before_the_position(tmp_path):
    """No replay: a resumed run reads exactly the samples the uninterrupted run read after the
    checkpoint, and reaches its position with the same sampler work wherever it is."""
    ck = tmp_path / "ck"
    ref_data = hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1)
    epoch = UPDATES_PER_EPOCH
    _train(
        tmp_path / "ref", ResilientCheckpoint(ck, every_n_steps=1), epoch, train_dataset=ref_data
    )
    assert sorted(ref_data.reads) == list(range(hf_train.NUM_SAMPLES))  # one epoch, read once
    drawn = []
    for step in (1, 4):  # 3 and 12 batches into the epoch
        data = _ProbeDataset(hf_train.NUM_SAMPLES, 1)
        data.counter = counter = _CountDraws()
        cb = ResilientCheckpoint(ck, resume=step, every_n_steps=100, save_on_train_end=False)
        _train(tmp_path / f"from{step}", cb, epoch, train_dataset=data, callbacks=[counter])
        assert cb.restored_step == step
        batches_done = step * 3
        assert data.reads == ref_data.reads[batches_done * 4 :]  # batch size 4: nothing more
        assert cb._batches is not None and cb._batches.fast_forwards == 1
        drawn.append(data.drawn_at_first_read)
    # Reaching batch 3 or batch 12 of the epoch costs the same: one epoch order, nothing else.
    assert drawn == [hf_train.NUM_SAMPLES, hf_train.NUM_SAMPLES]


def test_corrupt_newest_checkpoint_falls_back_loudly(tmp_path):
    ck = tmp_path / "ck"
    _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 4)
    newest = _committed(ck)[-1]
    assert newest.step == 4
    target = Path(newest.path) / "shared.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    with pytest.warns(ResumeFallbackWarning, match="step_000000004"):
        trainer = _train(tmp_path, cb, 5)
    assert cb.restored_step == 2
    assert trainer.state.global_step == 5


def test_remote_copy_resumes_when_the_local_directory_is_gone(tmp_path, s3_remote):
    if "remote" not in inspect.signature(Checkpointer).parameters:
        pytest.skip("the Checkpointer has no remote tier yet")
    url, options = s3_remote
    local = tmp_path / "ck"
    first = _train(
        tmp_path / "a",
        ResilientCheckpoint(local, every_n_steps=2, remote=url, remote_options=options),
        4,
    )
    shutil.rmtree(local)  # the machine died with its disk
    cb = ResilientCheckpoint(local, every_n_steps=2, remote=url, remote_options=options)
    trainer = _train(tmp_path / "b", cb, 5)
    assert cb.restored_step == 4
    assert trainer.state.global_step == 5
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == list(range(1, 6))
    assert first.state.log_history[:4] == trainer.state.log_history[:4]


def test_the_last_step_is_uploaded_whatever_remote_every_n_saves(tmp_path):
    """The end of training is a final save, which the remote tier always takes (with
    remote_every_n_saves=100 it reached the remote only if it was a 100th)."""
    remote = tmp_path / "remote"
    cb = ResilientCheckpoint(
        tmp_path / "ck", every_n_steps=2, remote=f"file://{remote}", remote_every_n_saves=100
    )
    _train(tmp_path / "a", cb, 5)
    uploaded = sorted(p.parent.name for p in remote.glob("step_*/manifest.json"))
    assert uploaded == ["step_000000005"]


def test_resume_restores_callback_state_and_a_finished_run_stays_finished(tmp_path):
    from transformers import EarlyStoppingCallback

    ck = tmp_path / "ck"
    stop = EarlyStoppingCallback(early_stopping_patience=100)
    _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 6, callbacks=[stop], eval_steps=2)
    counter = stop.early_stopping_patience_counter
    assert counter > 0  # eval_loss did not improve at every evaluation

    stop2 = EarlyStoppingCallback(early_stopping_patience=100)
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    trainer = _train(tmp_path, cb, 6, callbacks=[stop2], eval_steps=2)
    assert cb.restored_step == 6
    assert stop2.early_stopping_patience_counter == counter  # restored, not reset
    assert trainer.state.global_step == 6  # nothing left to train
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == list(range(1, 7))

    # max_steps lowered below the checkpoint: nothing to train, said so (not "its final
    # metrics are restored", as for a finished run)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    trainer_log = logging.getLogger("transformers.trainer")
    trainer_log.addHandler(handler)
    try:
        trainer = _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 4, eval_steps=2)
    finally:
        trainer_log.removeHandler(handler)
    assert trainer.state.global_step == 6
    assert any("past max_steps=4 here: nothing to train" in m for m in said), said


def test_a_run_stopped_early_is_not_trained_further_when_re_run(tmp_path):
    """EarlyStoppingCallback ends train() at step 4 of 10 (eval_loss never improves by 100);
    that step is saved. The same script run again restores step 4 and trains nothing: the same
    final train_loss (it trained on to step 6: nothing recorded that the run had stopped)."""
    from transformers import EarlyStoppingCallback

    ck = tmp_path / "ck"

    def run() -> tuple[ResilientCheckpoint, Any]:
        stop = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=100.0)
        cb = ResilientCheckpoint(ck, every_n_steps=3)
        trainer = _train(tmp_path, cb, 10, callbacks=[stop], eval_steps=2)
        return cb, trainer

    _, first = run()
    assert first.state.global_step == 4 and _committed(ck)[-1].step == 4
    cb, again = run()
    assert cb.restored_step == 4 and again.state.global_step == 4
    loss = [e["train_loss"] for e in again.state.log_history if "train_loss" in e]
    assert loss[-1] == [e["train_loss"] for e in first.state.log_history if "train_loss" in e][-1]


def test_eval_on_start_does_not_evaluate_again_in_a_resumed_run(tmp_path):
    """eval_on_start=True: the run evaluates before its first step. A run resumed at step 4
    does not evaluate again (the Trainer would, adding a log entry and drawing from the restored
    RNGs, which changed every later step): log history and weights equal the run not stopped."""
    ck = tmp_path / "ck"
    ref = _train(tmp_path / "a", ResilientCheckpoint(ck, every_n_steps=4), 8, eval_on_start=True)
    cb = ResilientCheckpoint(ck, every_n_steps=4, resume=4)  # as a re-run after a kill at 5
    got = _train(tmp_path / "b", cb, 8, eval_on_start=True)
    assert cb.restored_step == 4 and got.args.eval_on_start  # given back after train()

    def history(t: Any) -> list[dict]:  # without timings and the saves' own log entries
        out = []
        for e in t.state.log_history:
            if not any(k.startswith("resilient/") for k in e):
                out.append(
                    {k: v for k, v in e.items() if "runtime" not in k and "per_sec" not in k}
                )
        return out

    assert history(got) == history(ref)
    a, b = ref.model.state_dict(), got.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Draws(TrainerCallback):
    """Draws from the torch RNG in on_train_begin and on_epoch_begin (any work there)."""

    def on_train_begin(self, args, state, control, **kwargs):
        torch.rand(7)

    def on_epoch_begin(self, args, state, control, **kwargs):
        torch.rand(3)


@pytest.mark.parametrize("stop", [3, 5], ids=["mid-epoch", "epoch-end"])
def test_callbacks_drawing_at_train_and_epoch_begin_do_not_shift_a_resumed_run(tmp_path, stop):
    """A callback after ours draws in on_train_begin and on_epoch_begin. Found 2026-11-25: the
    random streams were put back in our on_train_begin, so that callback's on_train_begin draw,
    and in the middle of an epoch its on_epoch_begin draw (the Trainer fires it again for the
    resumed epoch), shifted every later dropout mask. They are put back around the resumed
    epoch's first on_epoch_begin now, as the Trainer's own resume does. An epoch is 5 steps:
    resumed at 3 (mid-epoch) and 5 (its end), the run equals the run not stopped."""
    ck = tmp_path / "ck"
    ref = _train(
        tmp_path / "a", None, 8, callbacks=[ResilientCheckpoint(ck, every_n_steps=1), _Draws()]
    )
    cb = ResilientCheckpoint(ck, every_n_steps=1, resume=stop)  # as a re-run after a kill
    got = _train(tmp_path / "b", None, 8, callbacks=[cb, _Draws()])
    assert cb.restored_step == stop

    def losses(t: Any) -> list[tuple[int, float]]:
        return [(e["step"], e["loss"]) for e in t.state.log_history if "loss" in e]

    assert losses(got) == losses(ref)
    a, b = ref.model.state_dict(), got.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


class _Killed(Exception):
    pass


class _SeesEpoch(TrainerCallback):
    """Listed before ours: records (event, global_step, epoch) at every event of a step.
    ``kill_at``: the run dies at the start of that step (a SIGKILL's effect, in-process)."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at, self.seen = kill_at, []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.kill_at:
            raise _Killed(f"killed in step {self.kill_at}")
        self.seen.append(("step_begin", state.global_step, state.epoch))

    def on_substep_end(self, args, state, control, **kwargs):
        self.seen.append(("substep_end", state.global_step, state.epoch))

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step_end", state.global_step, state.epoch))

    def on_log(self, args, state, control, **kwargs):
        self.seen.append(("log", state.global_step, state.epoch))

    def on_evaluate(self, args, state, control, **kwargs):
        self.seen.append(("evaluate", state.global_step, state.epoch))

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("save", state.global_step, state.epoch))


@pytest.mark.parametrize("gas", [3, 1], ids=["accumulation-3", "accumulation-1"])
def test_a_callback_before_ours_sees_the_uninterrupted_epoch_after_a_mid_epoch_resume(
    tmp_path, gas
):
    """A callback listed before ours sees state.epoch at every event of a step. Found
    2026-12-05 by a user's probe: after a resume in the middle of an epoch, its on_step_end saw
    the Trainer's value counted from the resume point (1 + 3/10 at step 7 with accumulation 3,
    where the uninterrupted run has 1 + 6/13): ours set the epoch-relative value in its own
    on_step_end only, after it. A run killed in step 8 (checkpoints every 3 steps: resumed at 6, in the middle of epoch 1
    with accumulation 3, of epoch 0 with 1) and re-run: the callback sees, event by event, what
    it sees in the uninterrupted run, whose step ends have the Trainer's own values."""
    steps, batches = 15, 13  # an epoch: 13 batches, 5 optimizer steps (accumulation 3) or 13
    per_epoch = -(-batches // gas)

    def run(out: Path, ck: Path, probe: _SeesEpoch) -> None:
        ours = ResilientCheckpoint(
            ck, every_n_steps=3, trainer_checkpoints=True, log_save_metrics=False
        )
        trainer = hf_train.build_trainer(
            str(out),
            steps,
            callbacks=[probe, ours],
            gradient_accumulation_steps=gas,
            save_strategy="steps",
            save_steps=4,
        )
        trainer.train()

    ref = _SeesEpoch()
    run(tmp_path / "a", tmp_path / "ck_a", ref)
    ends = [(s, e) for event, s, e in ref.seen if event == "step_end"]
    assert ends == [
        (s, (s - 1) // per_epoch + min(((s - 1) % per_epoch + 1) * gas, batches) / batches)
        for s in range(1, steps + 1)
    ]
    with pytest.raises(_Killed):
        run(tmp_path / "b", tmp_path / "ck_b", _SeesEpoch(kill_at=8))
    got = _SeesEpoch()
    run(tmp_path / "b", tmp_path / "ck_b", got)  # the same script again: resumes at step 6
    assert got.seen[0][:2] == ("step_begin", 6)
    events = {event for event, _, _ in got.seen}
    assert {"step_end", "log", "evaluate", "save"} <= events
    assert ("substep_end" in events) == (gas > 1)
    assert got.seen == ref.seen[len(ref.seen) - len(got.seen) :]


@pytest.mark.slow  # three processes with workers; keeps the default suite near its budget
def test_persistent_workers_sigkill_after_an_epoch_boundary_then_rerun_is_exact(tmp_path):
    """dataloader_persistent_workers=True, 2 workers: the uninterrupted run makes its one
    iterator in epoch 0 and resets it later without drawing; a run resumed at the end of epoch 0
    makes a new one, which drew its base seed from the restored global RNG -- every later
    dropout mask differed. Saved at step 10 (an epoch is 5 optimizer steps), killed after step
    12, re-run: the same losses and weights as the run not stopped."""
    ref, got = tmp_path / "ref", tmp_path / "got"

    def cmd(d: Path) -> list[str]:
        return [
            sys.executable, str(SCRIPT), str(d / "out"), "--max-steps", "14",
            "--every-n-steps", "5", "--persistent-workers", "--sleep", str(SLEEP),
            "--out-jsonl", str(d / "steps.jsonl"), "--out-final", str(d / "final.safetensors"),
        ]  # fmt: skip

    ref.mkdir()
    got.mkdir()
    _run(cmd(ref))
    rc, killed_at, _ = _run_and_signal(
        cmd(got), got, 12, signal.SIGKILL, committed=(got / "out" / "ckpt", 10)
    )
    assert rc == -signal.SIGKILL and killed_at < 14
    assert _restored(_run(cmd(got))) == 10
    a, b = _per_step(ref / "steps.jsonl"), _per_step(got / "steps.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 15))
    assert [s for s in a if a[s] != b[s]] == []
    wa, wb = load_file(str(ref / "final.safetensors")), load_file(str(got / "final.safetensors"))
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.parametrize(
    "sampler",
    [
        "weighted",
        pytest.param("subset", marks=pytest.mark.slow),
        pytest.param("random", marks=pytest.mark.slow),
    ],
)
def test_a_sampler_with_its_own_generator_resumes_exactly(tmp_path, monkeypatch, sampler):
    """A Trainer whose _get_train_sampler returns a sampler with its own generator (a
    class-balancing WeightedRandomSampler, a SubsetRandomSampler; a RandomSampler with
    use_seedable_sampler=False, refused before): a resume trained other batches from the next
    epoch on, with no warning, since the generator's state was not saved. Killed after step 11
    (resumed at an epoch's end, 10) and after step 13 (resumed inside an epoch, 12): the same
    losses and weights as the run not stopped."""
    monkeypatch.setenv("RC_OWN_SAMPLER", sampler)
    ref, got = tmp_path / "ref", tmp_path / "got"

    def cmd(d: Path) -> list[str]:
        # (no --sleep: each kill lands where the run holds, once the save before it committed)
        return [
            sys.executable, str(SCRIPT), str(d / "out"), "--max-steps", "15",
            "--every-n-steps", "2",
            "--out-jsonl", str(d / "steps.jsonl"), "--out-final", str(d / "final.safetensors"),
        ]  # fmt: skip

    ref.mkdir()
    got.mkdir()
    _run(cmd(ref))
    ckdir = got / "out" / "ckpt"  # each kill after the save before it committed
    rc, _, _ = _run_and_signal(cmd(got), got, 11, signal.SIGKILL, committed=(ckdir, 10))
    assert rc == -signal.SIGKILL
    rc, _, err = _run_and_signal(cmd(got), got, 13, signal.SIGKILL, committed=(ckdir, 12))
    assert rc == -signal.SIGKILL and _restored(err) == 10  # at an epoch's end
    assert _restored(_run(cmd(got))) == 12  # inside an epoch
    a, b = _per_step(ref / "steps.jsonl"), _per_step(got / "steps.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 16))
    assert [s for s in a if a[s] != b[s]] == []
    wa, wb = load_file(str(ref / "final.safetensors")), load_file(str(got / "final.safetensors"))
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


def test_changed_data_settings_are_refused_unless_the_global_batch_stays(tmp_path):
    """Another per-device batch with the same accumulation (another global batch) is refused,
    naming the global batch to keep; with twice the accumulation (the same global batch: the
    saved position names the same samples) the run resumes, with a warning naming both."""
    ck = tmp_path / "ck"
    _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 2)
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"per_device_batch_size: 4 in the checkpoint, 2.*global batch.*stays 12",
    ):
        _train(tmp_path, cb, 4, per_device_train_batch_size=2)
    assert [e.step for e in _committed(ck)] == [2]  # nothing lost
    cb = ResilientCheckpoint(ck, every_n_steps=2)
    with pytest.warns(UserWarning, match=r"1 process\(es\) x 2 x 6 accumulated: the same global"):
        _train(tmp_path, cb, 4, per_device_train_batch_size=2, gradient_accumulation_steps=6)
    assert cb.restored_step == 2


def test_the_trainers_fsdp_on_xla_is_refused(tmp_path):
    """The Trainer's FSDP through accelerate is supported (tests/test_transformers_fsdp.py); its
    XLA FSDP (TPUs) is not: the Trainer says it is on with ``is_fsdp_xla_enabled`` (set here on
    a real Trainer), and the adapter's check at ``on_train_begin`` refuses it."""
    from resilient_callbacks.transformers.checks import check_setup

    trainer = hf_train.build_trainer(str(tmp_path / "out"), 4)
    trainer.is_fsdp_xla_enabled = True
    with pytest.raises(ConfigError, match=r"does not support the Trainer's FSDP on XLA"):
        check_setup(trainer, trainer.get_train_dataloader())


def test_callbacks_argument_first_run_then_rerun(tmp_path):
    """Trainer(callbacks=[...]) works like add_callback; a first run just starts; the Trainer's
    own save_steps checkpoints are replaced; save timings reach the Trainer's log."""
    out = tmp_path / "out"
    cb = ResilientCheckpoint(every_n_steps=3)  # dirpath: <output_dir>/_resilient_checkpoints
    first = hf_train.build_trainer(str(out), 4, callbacks=[cb], save_strategy="steps", save_steps=2)
    first.train()
    assert cb.restored_step is None
    assert not any(p.name.startswith("checkpoint-") for p in out.iterdir())
    assert [e.step for e in _committed(out / "_resilient_checkpoints")] == [3, 4]
    saves = [e for e in first.state.log_history if "resilient/save_blocking_s" in e]
    assert [e["step"] for e in saves] == [3, 4]
    assert all(e["resilient/save_blocking_s"] >= 0 for e in saves)

    cb2 = ResilientCheckpoint(every_n_steps=3)
    second = hf_train.build_trainer(str(out), 5, callbacks=[cb2])
    second.train()
    assert cb2.restored_step == 4
    assert [e["step"] for e in second.state.log_history if "loss" in e] == list(range(1, 6))


def test_save_strategy_epoch_saves_at_epoch_ends_without_a_no_trigger_warning(tmp_path, caplog):
    """No trigger of ours and save_strategy="epoch": a save at every epoch end (an epoch is 5
    optimizer steps here) and the final step; the core's "no save schedule" warning is not logged,
    since the callback saves on the Trainer's schedule."""
    out = tmp_path / "out"
    cb = ResilientCheckpoint()
    with caplog.at_level(logging.INFO, logger="resilient_callbacks"):
        hf_train.build_trainer(str(out), 12, callbacks=[cb], save_strategy="epoch").train()
    assert [e.step for e in _committed(out / "_resilient_checkpoints")] == [5, 10, 12]
    assert "saving at every epoch end" in caplog.text
    assert "no save schedule" not in caplog.text


def test_explicit_resume_from_checkpoint_wins(tmp_path):
    out = tmp_path / "out"
    cb = ResilientCheckpoint(every_n_steps=2, trainer_checkpoints=True)
    hf_train.build_trainer(str(out), 4, callbacks=[cb], save_strategy="steps", save_steps=2).train()
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    assert [e.step for e in _committed(out / "_resilient_checkpoints")] == [2, 4]

    cb2 = ResilientCheckpoint(every_n_steps=2)
    trainer = hf_train.build_trainer(str(out), 5, callbacks=[cb2])
    with (
        pytest.warns(ForeignCheckpointsWarning),  # the new run leaves the old one alone
        pytest.warns(UserWarning, match=r"from step 2, but .*step_000000004 \(step 4\)"),
    ):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert cb2.restored_step is None  # the Trainer restored step 2 itself, not step 4
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == list(range(1, 6))
    # the run's start is recorded where it started; the last commit is logged once it is
    starts = history.records(str(out / "_resilient_checkpoints"))
    assert [r["step"] for r in starts if r["event"] == "start"][-1] == 2
    committed = [e for e in trainer.state.log_history if "resilient/last_committed_step" in e]
    assert committed[-1]["resilient/last_committed_step"] == 5
    ours = _committed(out / "_resilient_checkpoints")
    assert sorted(e.step for e in ours) == [2, 4, 4, 5]
    assert len({e.manifest.run_id for e in ours}) == 2


def test_retention_keeps_best_and_newest_and_leaves_an_older_run_alone(tmp_path):
    ck = tmp_path / "ck"
    _train(tmp_path / "old", ResilientCheckpoint(ck, every_n_steps=1), 1)  # an older run
    (old,) = _committed(ck)
    # On these random tokens the eval loss rises after step 2: the best is not the newest.
    cb = ResilientCheckpoint(
        ck,
        every_n_steps=2,
        keep_last=1,
        keep_best=1,
        monitor="eval_loss",
        mode="min",
        resume="never",
    )
    with pytest.warns(ForeignCheckpointsWarning):
        trainer = _train(tmp_path / "new", cb, 6, eval_steps=2)
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best = min(evals, key=evals.__getitem__)
    assert best != 6
    entries = _committed(ck)
    assert all(e.status is catalog.Status.VALID for e in entries)
    mine = {e.step: e for e in entries if e.manifest.run_id != old.manifest.run_id}
    assert set(mine) == {best, 6}
    assert mine[best].manifest.metrics["eval_loss"] == pytest.approx(evals[best])
    assert os.path.isdir(old.path)  # the older run's checkpoint is neither counted nor deleted


def test_with_monitor_every_evaluation_is_saved_between_the_periodic_saves(tmp_path):
    """transformers.md: with `monitor` set, also a save after every evaluation that reports it
    (`save_on_evaluate`), so every evaluated state can be the kept best one. The test above
    has its evaluations on the save schedule; here they fall between its saves (every 3
    steps, saves every 10): 3, 6, 9 are saved too; with save_on_evaluate=False only 10, 12."""

    def saved(cb: ResilientCheckpoint, out: Path) -> list[int]:
        _train(out, cb, 12, eval_steps=3, gradient_accumulation_steps=1)
        return [e.step for e in _committed(out / "ck")]

    on = ResilientCheckpoint(
        tmp_path / "a" / "ck", every_n_steps=10, keep_best=1, monitor="eval_loss"
    )
    assert saved(on, tmp_path / "a") == [3, 6, 9, 10, 12]
    off = ResilientCheckpoint(
        tmp_path / "b" / "ck",
        every_n_steps=10,
        keep_best=1,
        monitor="eval_loss",
        save_on_evaluate=False,
    )
    assert saved(off, tmp_path / "b") == [10, 12]


def test_export_newest_checkpoint_loads_with_from_pretrained(tmp_path):
    ck = tmp_path / "ck"
    trainer = _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 4)
    out = export_pretrained(ck, tmp_path / "hf")
    live = trainer.model.state_dict()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    for k, v in model.state_dict().items():
        assert torch.equal(v, live[k]), k
    base = AutoModel.from_pretrained(out)
    assert torch.equal(base.wte.weight, live["transformer.wte.weight"])
    assert not any(p.name.startswith(".hf.") for p in tmp_path.iterdir())  # no staging left

    # The CLI entry point: refuses to overwrite, exports an older step with --force.
    ns = argparse.Namespace(dir=str(ck), out=out, step=2, force=False)
    assert cli_export(ns) == 1
    ns.force = True
    assert cli_export(ns) == 0
    older = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(older.transformer.wte.weight, live["transformer.wte.weight"])


@pytest.mark.slow  # (suite time: a default test covers the same contract)
def test_resilient_ckpt_export_subcommand(tmp_path):
    from resilient_callbacks import cli_parser

    sub = next(
        a for a in cli_parser.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    if "export" not in sub.choices:
        pytest.skip("cli_parser.py does not register the export subcommand yet")
    ck = tmp_path / "ck"
    _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 2)
    # as a user runs it: a fresh interpreter, where importing transformers takes seconds,
    # which passed without a word (up to 15 s on a loaded machine); it is said first now
    r = subprocess.run(
        [sys.executable, "-m", "resilient_callbacks", "export", str(ck), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "step 2" in r.stdout
    assert r.stderr.startswith("resilient-ckpt export: a Trainer run's checkpoint: loading "), (
        r.stderr
    )
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_export_of_a_trainer_run_of_a_plain_module_writes_its_weights(tmp_path, capsys):
    """A Trainer run of a plain torch module records no model configuration: ``export`` wrote
    nothing ("records no model configuration to export"); it writes the weights as
    model.safetensors, as for a plain Checkpointer state. ``export_pretrained`` says why not."""
    from resilient_callbacks import cli

    ck = tmp_path / "ck"
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=hf_ds_plain.PlainLM(),
        args=hf_train.training_args(str(tmp_path), 2, eval_strategy="no"),
        train_dataset=hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1),
        callbacks=[ResilientCheckpoint(ck, every_n_steps=2)],
    )
    trainer.train()
    capsys.readouterr()
    assert cli.main(["export", str(ck), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    got = load_file(tmp_path / "out" / "model.safetensors")
    live = trainer.model.state_dict()
    assert got.keys() == live.keys()
    assert all(torch.equal(got[k], v) for k, v in live.items())
    with pytest.raises(CheckpointMismatchError, match="resilient-ckpt export"):
        export_pretrained(ck, tmp_path / "hf")


def test_export_of_a_peft_lora_run_adapters_and_merged(tmp_path):
    """A PEFT LoRA model trained under the Trainer: export writes its adapters as PEFT's
    save_pretrained does (loaded onto the base model by PeftModel.from_pretrained) and, with
    --merged, the base model with the adapters merged in, for from_pretrained; both equal the
    trained model."""
    peft = pytest.importorskip("peft")
    from resilient_callbacks import cli

    def lora_model():
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM")
        return peft.get_peft_model(hf_train.build_model(), lora)

    model, ck = lora_model(), tmp_path / "ck"
    trainer = transformers.Trainer(
        model=model,
        args=hf_train.training_args(str(tmp_path / "out"), 4, eval_strategy="no"),
        train_dataset=hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1),
        callbacks=[ResilientCheckpoint(ck, every_n_steps=2)],
    )
    trainer.train()
    assert cli.main(["export", str(ck), str(tmp_path / "adapters")]) == 0
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    loaded = peft.PeftModel.from_pretrained(hf_train.build_model(), tmp_path / "adapters")
    trained = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trained[k]), k
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # trained

    assert cli.main(["export", str(ck), str(tmp_path / "merged"), "--merged"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    ids = torch.arange(8).reshape(1, 8)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(input_ids=ids).logits)
    assert merged.lm_head.weight is merged.transformer.wte.weight  # still tied
    # --merged of a model without adapters is refused by name
    plain = tmp_path / "plain"
    _train(tmp_path, ResilientCheckpoint(plain, every_n_steps=2), 2)
    assert cli.main(["export", str(plain), str(tmp_path / "x"), "--merged"]) == 1


def test_unsupported_setups_give_clear_errors(tmp_path):
    # (Trainer + DeepSpeed is supported: tests/test_deepspeed.py runs it.)
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1)[i] for i in range(50))

    with pytest.raises(ConfigError, match="map-style"):
        _train(tmp_path / "s", ResilientCheckpoint(tmp_path / "ck2"), 2, train_dataset=Stream())
    with pytest.raises(ConfigError, match="unknown option"):
        ResilientCheckpoint(tmp_path / "ck", every_n_step=5)
    with pytest.raises(ConfigError, match="keep_last"):
        ResilientCheckpoint(tmp_path / "ck", keep_last=0)


# ---------------------------------------------------------------------------- data fast-forward


def _shards(n: int, bs: int, drop_last: bool, procs: int, rank: int, even: bool, seed: int):
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler

    sampler = (
        SeedableRandomSampler(range(n), data_seed=seed) if seed else SequentialSampler(range(n))
    )
    batches = BatchSampler(sampler, bs, drop_last)
    if procs == 1:
        return batches
    return BatchSamplerShard(batches, procs, rank, split_batches=False, even_batches=even)


def test_fast_forward_matches_accelerate_batches_exactly():
    """Starting at batch c yields exactly what a full iteration yields from c on, for the
    Trainer's batch samplers (accelerate's sharding with its end-of-epoch padding included)."""
    cases = 0
    for n in (1, 3, 7, 8, 13, 50):
        for bs in (1, 3, 4):
            for drop_last in (False, True):
                for procs, even in ((1, True), (2, True), (2, False), (3, True), (3, False)):
                    for rank in range(procs):
                        for seed in (0, 5):
                            ref = list(_shards(n, bs, drop_last, procs, rank, even, seed))
                            for skip in range(len(ref) + 1):
                                bs_obj = make_resumable(
                                    _shards(n, bs, drop_last, procs, rank, even, seed)
                                )
                                bs_obj.resume_at(skip, None)
                                assert list(bs_obj) == ref[skip:], (
                                    n,
                                    bs,
                                    drop_last,
                                    procs,
                                    rank,
                                    even,
                                    skip,
                                )
                                assert bs_obj.fast_forwards == (1 if skip else 0)
                                cases += 1
    assert cases > 1000


def test_fast_forward_replays_an_order_drawn_from_the_global_rng():
    """A sampler that draws its order from the global torch RNG (a plain RandomSampler) gets the
    same order on resume, from the RNG state saved at the epoch start, and the global RNG is
    left as it was."""
    torch.manual_seed(3)
    batches = make_resumable(BatchSampler(RandomSampler(range(20)), 3, False))
    ref = list(batches)
    saved = batches.epoch_rng
    torch.manual_seed(99)  # the resumed process is elsewhere in its random stream
    before = torch.get_rng_state()
    again = make_resumable(BatchSampler(RandomSampler(range(20)), 3, False))
    again.resume_at(4, saved)
    assert list(again) == ref[4:]
    assert torch.equal(torch.get_rng_state(), before)

    # Any other batch sampler: its batches are built (indices only) and sliced.
    from accelerate.data_loader import BatchSamplerShard

    split = BatchSamplerShard(
        BatchSampler(SequentialSampler(range(24)), 4, False), 2, 1, split_batches=True
    )
    ref = list(split)
    other = make_resumable(
        BatchSamplerShard(
            BatchSampler(SequentialSampler(range(24)), 4, False), 2, 1, split_batches=True
        )
    )
    other.resume_at(2, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(other) == ref[2:]
    assert other.fast_forwards == 0


# ---------------------------------------------------------------------------- benchmark


@pytest.mark.benchmark
def test_bench_transformers_quick(tmp_path):
    """benchmarks/bench_transformers.py --quick runs end to end and reports every mode.
    Deselected by default (``-m benchmark``); the full run is
    ``python benchmarks/bench_transformers.py`` (about 10 minutes on 2 cores)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transformers.py"
    cmd = [sys.executable, str(script), "--quick", "--out", str(tmp_path), "--dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "bench_transformers.json").read_text())
    assert set(report["summary"]) == {"none", "trainer", "ours", "ours_overlap"}
    for mode in ("trainer", "ours", "ours_overlap"):
        s = report["summary"][mode]
        assert s["saves_per_run"] == report["meta"]["steps"] // report["meta"]["every"]
        assert s["blocking_per_save_s"] > 0
    assert (
        report["summary"]["ours"]["blocking_per_save_s"]
        < report["summary"]["trainer"]["blocking_per_save_s"]
    )
    assert (tmp_path / "bench_transformers.md").read_text().startswith("# bench_transformers")


def test_keep_best_on_an_eval_metric_without_evaluation_during_training_is_warned(tmp_path):
    cb = ResilientCheckpoint(every_n_steps=2, keep_best=1, monitor="eval_loss")
    with pytest.warns(UserWarning, match="eval_strategy='no'.*none is kept as the best"):
        _train(tmp_path / "out", cb, 2, eval_strategy="no")


@pytest.mark.parametrize("saved", ["once", "apart"])
def test_merged_export_keeps_tied_weights_tied(saved):
    """A LoRA GPT-2's tied embedding as DeepSpeed saves it (once, under its owner's name) or as
    FSDP gathers it (two equal tensors): the merge found the weights untied (lm_head absent:
    "missing from the checkpoint"; apart: PEFT wrote tie_word_embeddings false), so the merged
    export failed or was no longer tied."""
    peft = pytest.importorskip("peft")
    from accelerate import init_empty_weights

    from resilient_callbacks.transformers.export import load_weights

    def lora(model):
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False
        )
        return peft.get_peft_model(model, config)

    trained = lora(hf_train.build_model())
    weights = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    head = "base_model.model.lm_head.weight"
    if saved == "once":
        del weights[head]
    with init_empty_weights():
        empty = lora(hf_train.build_model())
    merged = load_weights(empty, weights, merged=True, where="ck")
    assert merged.config.tie_word_embeddings
    assert merged.lm_head.weight is merged.transformer.wte.weight
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids).logits, trained.eval()(input_ids=ids).logits)


def test_export_directory_is_readable_by_others(tmp_path):
    """The exported directory has the mode save_pretrained gives (umask applied), not the 0700
    of a temporary directory: a serving process of another user could not read the model."""
    ck = tmp_path / "ck"
    _train(tmp_path, ResilientCheckpoint(ck, every_n_steps=2), 2)
    old = os.umask(0o022)
    try:
        export_pretrained(ck, tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "hf").st_mode) == 0o755


class _V2GPT2(transformers.GPT2LMHeadModel):
    """A user's model of version 2: version 1 stored ``ln_f.weight`` halved, and its loader
    doubles what a version-1 (or unversioned: oldest) state dict holds."""

    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if (local_metadata.get("version") or 1) < 2:
            key = prefix + "transformer.ln_f.weight"
            state_dict[key] = state_dict[key] * 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


def test_export_loads_the_weights_by_the_versions_the_checkpoint_recorded(tmp_path):
    """A model whose ``_version`` is 2 saved by the Trainer and exported: export loaded its
    weights with no versions, so its loader took the version-2 entries for version 1 and
    converted them again (``ln_f.weight`` doubled in the exported model)."""
    ck = tmp_path / "ck"
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=_V2GPT2(hf_train.build_model().config),
        args=hf_train.training_args(str(tmp_path), 2, eval_strategy="no"),
        train_dataset=hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1),
        callbacks=[ResilientCheckpoint(ck, every_n_steps=2)],
    )
    trainer.train()
    out = export_pretrained(ck, tmp_path / "hf", model_class=_V2GPT2)
    got = load_file(Path(out) / "model.safetensors")
    live = trainer.model.state_dict()
    assert torch.equal(got["transformer.ln_f.weight"], live["transformer.ln_f.weight"])
    assert all(torch.equal(got[k], live[k]) for k in got)


def test_a_close_that_gives_up_on_uploads_runs_every_callbacks_train_end_first(
    tmp_path, monkeypatch
):
    """The Trainer callback's end of training closes the Checkpointer, which raises
    UploadIncompleteError once it gave up on uploads during an outage. It raised inside the
    callback handler's loop, so the callbacks added after ours (a user's that pushes the model
    or ends a tracking run) never got their on_train_end. Now the close comes after them all,
    and its error is still raised by train()."""
    from resilient_callbacks import checkpointer as ckmod
    from resilient_callbacks import upload_wait
    from resilient_callbacks.errors import UploadIncompleteError
    from resilient_callbacks.remote import RemoteStore

    monkeypatch.setattr(ckmod, "CLOSE_OUTAGE_S", 0.5)
    monkeypatch.setattr(upload_wait, "LOOK_S", 0.05)  # (close() looks 20 times a second)

    def down(*a, **k):
        raise ConnectionError("the store is down")

    monkeypatch.setattr(RemoteStore, "upload", down)
    ended: list[bool] = []

    class After(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            ended.append(True)

    trainer = hf_train.build_trainer(str(tmp_path / "out"), 2)
    ckpt = ResilientCheckpoint(
        str(tmp_path / "ck"), remote=f"file://{tmp_path / 'remote'}", every_n_steps=2
    )
    trainer.add_callback(ckpt)
    trainer.add_callback(After())
    with pytest.raises(UploadIncompleteError, match="step_000000002"):
        trainer.train()
    assert ended == [True]
    assert ckpt.checkpointer is not None and ckpt.checkpointer.closed  # closed all the same
