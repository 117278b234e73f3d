"""A script of several ``fit()`` stages on one Trainer (pre-training, then fine-tuning with a
larger ``max_epochs`` and another learning rate), killed in a later stage and run again.

The uninterrupted run: stage 1 trains 2 epochs (16 steps), stage 2 goes on from the live state
with fresh optimizers (``configure_optimizers`` gives lr 0.01 now) to 4 epochs (32 steps). The
"kill" is an exception at the start of a step (no emergency save), the re-run a new module and
Trainer running the same two stages; it must end as the run without the callback did: every
step's loss (dropout, a shuffled loader), learning rate and the final weights.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from resilient_callbacks.lightning import ResilientCheckpoint

pytestmark = pytest.mark.timeout(300)


class _Killed(Exception):
    pass


class _KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            raise _Killed(f"killed before step {self.step + 1}")


class _Staged(L.LightningModule):
    """Momentum SGD and dropout; ``lr`` changes between the stages."""

    def __init__(self, seen: dict[int, tuple[float, float]]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3))
        self.lr = 0.1
        self.seen = seen  # global step -> (loss, lr)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.net(batch[0]).pow(2).mean()
        lr = self.optimizers().param_groups[0]["lr"]
        self.seen[self.global_step + 1] = (loss.item(), lr)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _stages(work: Path, seen: dict, callbacks: list, by_steps: int = 0) -> tuple[_Staged, list]:
    """Run the script: stage 1 (2 epochs), stage 2 (to 4 epochs, lr 0.01). Returns the module
    and the callback's ``restored_step`` after each stage. ``by_steps``: stage 1 to that step
    (12: in epoch 1; 16: epoch 1's last), stage 2 to step 30 (``max_steps``)."""
    torch.manual_seed(0)
    module = _Staged(seen)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)  # 8 steps an epoch
    trainer = L.Trainer(
        max_epochs=-1 if by_steps else 2,
        max_steps=by_steps or -1,
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        default_root_dir=work,
    )
    restored = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
        restored.append(getattr(callbacks[0], "restored_step", None) if callbacks else None)
        module.lr = 0.01  # stage 2: fine-tuning
        if by_steps:
            trainer.fit_loop.epoch_loop.max_steps = 30
        else:
            trainer.fit_loop.max_epochs = 4
        trainer.fit(module, loader)
        restored.append(getattr(callbacks[0], "restored_step", None) if callbacks else None)
    return module, restored


@pytest.mark.parametrize(
    ("kill_at", "restored"),
    [(17, 16), (20, 18), (28, 27)],
    ids=["after-stage-1s-end", "stage-2-in-stage-1s-last-epoch", "stage-2-past-stage-1s-epochs"],
)
def test_a_two_stage_script_killed_in_its_second_stage_resumes_exactly(tmp_path, kill_at, restored):
    """Found 2026-12-05: re-run after a kill in stage 2, stage 1's fit() resumed from stage 2's
    checkpoint: in stage 2's epoch 2 it trained nothing and stage 2 then went on "from the live
    state" with fresh optimizers (momentum and the scheduler lost, the RNG and data position
    not restored: every later step differed); in epoch 3 Lightning raised "You restored a
    checkpoint with current_epoch=3, but you have set Trainer(max_epochs=2)", so the script
    could not resume at all. Stage 1 now trains nothing from a checkpoint past its end and stage
    2 resumes from that checkpoint."""
    ref: dict = {}
    plain, _ = _stages(tmp_path / "plain", ref, [])
    assert sorted(ref) == list(range(1, 33))
    ck = tmp_path / "ck"
    first: dict = {}
    with pytest.raises(_Killed):
        _stages(
            tmp_path / "run", first, [ResilientCheckpoint(ck, every_n_steps=3), _KillAt(kill_at)]
        )
    again: dict = {}
    resumed, restores = _stages(tmp_path / "run", again, [ResilientCheckpoint(ck, every_n_steps=3)])
    # stage 2 resumes from its own checkpoint; after stage 1's end it goes on from the live state
    assert restores == [restored, None if restored == 16 else restored]
    assert min(again) == restored + 1
    assert {s: again[s] for s in again} == {s: ref[s] for s in again}
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("stage_1", "kill_at"), [(12, 13), (12, 17), (12, 25), (16, 17), (16, 25)])
def test_two_stages_by_max_steps_killed_in_the_second_resume_exactly(tmp_path, stage_1, kill_at):
    """Stage 1 to step 12 (in epoch 1) or 16 (epoch 1's last step), stage 2 to step 30
    (``fit_loop.epoch_loop.max_steps``): killed past stage 1's end, the re-run's stage 1 trains
    nothing and stage 2 resumes exactly. Found 2026-12-05 (kill_at 13 and 17 after stage 1's
    last step: no checkpoint of stage 2 yet): Lightning skips the loop of a fit() restored at
    its max_steps, so the re-run's stage 1 did not end epoch 1 (its on_train_epoch_end, the
    epoch counted done) nor leave its loops restarting no more, and stage 2 went on in that
    epoch (or repeated its end) where the run started epoch 2: every later step differed."""
    ref: dict = {}
    plain, _ = _stages(tmp_path / "plain", ref, [], by_steps=stage_1)
    ck = tmp_path / "ck"
    with pytest.raises(_Killed):
        _stages(
            tmp_path / "run",
            {},
            [ResilientCheckpoint(ck, every_n_steps=3), _KillAt(kill_at)],
            stage_1,
        )
    again: dict = {}
    resumed, _ = _stages(
        tmp_path / "run", again, [ResilientCheckpoint(ck, every_n_steps=3)], stage_1
    )
    assert again and {s: again[s] for s in again} == {s: ref[s] for s in again}
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_finished_script_run_again_trains_nothing_and_ends_with_its_random_streams(tmp_path):
    """Both stages restore the last checkpoint and train nothing; the script's code after them
    draws what it drew after the finished run (it drew from the new process's streams: the
    restored ones were put back only before a batch)."""
    ck = tmp_path / "ck"
    first, _ = _stages(tmp_path, {}, [ResilientCheckpoint(ck, every_n_steps=3)])
    after = torch.get_rng_state()
    again: dict = {}
    module, restores = _stages(tmp_path, again, [ResilientCheckpoint(ck, every_n_steps=3)])
    assert restores == [32, 32] and again == {}
    assert torch.equal(torch.get_rng_state(), after)
    for a, b in zip(first.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.lin(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_with_model_checkpoint(
    work: Path, callbacks: list, max_steps: int = 10
) -> L.pytorch.callbacks.ModelCheckpoint:
    torch.manual_seed(0)
    mc = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=work / "mc",
        every_n_train_steps=1,
        save_top_k=2,
        monitor="train_loss",
        save_last=True,
    )
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=[mc, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Linear(), torch.utils.data.DataLoader(data, batch_size=4))
    return mc


def test_model_checkpoint_files_of_the_killed_steps_do_not_linger_or_get_renamed(tmp_path):
    """A ModelCheckpoint (every step, top 2 by train_loss, last) next to ours (every 4 steps),
    killed after step 7 and resumed at step 4. Found 2026-12-05: the files it wrote for steps 5
    and 7 before the kill stayed (4 .ckpt files with save_top_k=2), and step 7 was written again
    as "epoch=0-step=7-v1.ckpt", the best-k names then differing from the uninterrupted run's.
    The directory and the best-k list now end as the uninterrupted run's."""
    ref = _fit_with_model_checkpoint(tmp_path / "ref", [])
    run = tmp_path / "run"
    with pytest.raises(_Killed):
        _fit_with_model_checkpoint(
            run, [ResilientCheckpoint(run / "ck", every_n_steps=4), _KillAt(7)]
        )
    assert {"epoch=0-step=5.ckpt", "epoch=0-step=7.ckpt"} <= {
        p.name for p in (run / "mc").iterdir()
    }
    rc = ResilientCheckpoint(run / "ck", every_n_steps=4)
    got = _fit_with_model_checkpoint(run, [rc])
    assert rc.restored_step == 4
    names = sorted(p.name for p in (run / "mc").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ref" / "mc").iterdir()), names
    assert {Path(p).name for p in got.best_k_models} == {Path(p).name for p in ref.best_k_models}
    assert Path(got.best_model_path).name == Path(ref.best_model_path).name


def test_model_checkpoint_files_of_another_run_in_the_folder_stay(tmp_path):
    """A file of an earlier run in the same ModelCheckpoint folder (written before this run
    began: its step is past the resumed one only by chance) is not this run's to remove."""
    run = tmp_path / "run"
    (run / "mc").mkdir(parents=True)
    other = run / "mc" / "other-run-step=40.ckpt"
    other.write_bytes(b"an earlier experiment's weights")
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    with pytest.raises(_Killed):
        _fit_with_model_checkpoint(
            run, [ResilientCheckpoint(run / "ck", every_n_steps=4), _KillAt(7)]
        )
    rc = ResilientCheckpoint(run / "ck", every_n_steps=4)
    _fit_with_model_checkpoint(run, [rc])
    assert rc.restored_step == 4
    assert other.read_bytes() == b"an earlier experiment's weights"
    assert not (run / "mc" / "epoch=0-step=7-v1.ckpt").exists()  # this run's own: removed


def test_model_checkpoint_files_stay_when_the_user_chose_an_older_checkpoint(tmp_path):
    """resume=4 (a branch from an older step, not a resume after a kill): the later files
    stay, as Lightning leaves them with fit(ckpt_path=...)."""
    _fit_with_model_checkpoint(tmp_path, [ResilientCheckpoint(tmp_path / "ck", every_n_steps=4)])
    before = {p.name for p in (tmp_path / "mc").iterdir()}
    assert "epoch=0-step=10.ckpt" in before
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=4, resume=4)
    _fit_with_model_checkpoint(tmp_path, [rc], max_steps=6)  # steps 5, 6: not 10 again
    assert rc.restored_step == 4
    assert before <= {p.name for p in (tmp_path / "mc").iterdir()}


class _Export(L.Callback):
    """Records the hooks; exports the weights at ``on_train_end`` (``fail``: killed there)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[str] = []
        self.exported: list[torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.seen.append("train_start")

    def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.seen.append(f"epoch_end {trainer.current_epoch}")

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.seen.append(f"train_end at epoch {trainer.current_epoch}")
        if self.fail:
            raise _Killed("killed while exporting")
        self.exported = [p.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize("max_steps", [12, 16], ids=["mid-epoch", "at-an-epochs-end"])
def test_a_finished_max_steps_run_killed_in_on_train_end_exports_when_run_again(
    tmp_path, max_steps
):
    """Found 2026-12-05: a run that reached max_steps saved its last step, then was killed in
    on_train_end (a long export, an upload). Run again, Lightning skipped its whole loop (the
    checkpoint is at max_steps, as with fit(ckpt_path=...)): no on_train_start, no
    on_train_end, so the export never happened, and the fit ended in epoch 1 where the run
    ended in epoch 2. A run ended by max_epochs got both hooks. Now the re-run trains nothing and
    does what the run did after its last step: the hooks (the end of the epoch the last step was
    in, too), in the run's epoch, with the run's weights."""

    def fit(export: _Export) -> L.Trainer:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            callbacks=[ResilientCheckpoint(tmp_path / "ck", every_n_steps=5), export],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_Linear(), torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        return trainer

    killed = _Export(fail=True)
    with pytest.raises(_Killed):
        fit(killed)
    assert killed.seen == ["train_start", "epoch_end 0", "epoch_end 1", "train_end at epoch 2"]
    again = _Export()
    trainer = fit(again)
    epoch_end = [] if max_steps == 16 else ["epoch_end 1"]  # (16: saved after the epoch's end)
    assert again.seen == ["train_start", *epoch_end, "train_end at epoch 2"]
    assert trainer.current_epoch == 2 and trainer.global_step == max_steps
    assert again.exported is not None
    for a, b in zip(again.exported, trainer.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)


class _ValLoss(_Linear):
    """``val_loss`` rises with every validation: ``EarlyStopping(patience=0)`` stops at the
    second one (step 6, in the middle of epoch 0)."""

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val_loss", float(self.global_step))


def test_a_run_early_stopped_mid_epoch_run_again_ends_that_epoch_as_the_run_did(tmp_path):
    """Found 2026-12-05: run again, the stopped run (restored at its last step, stopped) went
    to on_train_end at once: no on_train_epoch_end for the epoch the stop was in, and
    trainer.current_epoch 0 where the run ended with 1."""

    def fit() -> tuple[list[str], int]:
        torch.manual_seed(0)
        export = _Export()
        stop = L.pytorch.callbacks.EarlyStopping("val_loss", patience=0)
        trainer = L.Trainer(
            max_epochs=5,
            val_check_interval=3,
            num_sanity_val_steps=0,
            accelerator="cpu",
            callbacks=[export, stop, ResilientCheckpoint(tmp_path / "ck", every_n_steps=5)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(
                _ValLoss(),
                torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
                torch.utils.data.DataLoader(data, batch_size=16),
            )
        assert trainer.global_step == 6
        return export.seen, trainer.current_epoch

    assert fit() == (["train_start", "epoch_end 0", "train_end at epoch 1"], 1)
    assert fit() == (["train_start", "epoch_end 0", "train_end at epoch 1"], 1)


def _fit_from_last(work: Path, seen: dict, callbacks: list, mc_every: int) -> L.Trainer:
    """20 steps of ``_Staged`` with a ``ModelCheckpoint(save_last=True)`` every ``mc_every``
    steps, ``fit(ckpt_path="last")``: Lightning's idiom for resuming a script."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    )
    mc = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=work / "mc", every_n_train_steps=mc_every, save_last=True
    )
    trainer = L.Trainer(
        max_steps=20,
        accelerator="cpu",
        callbacks=[mc, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Staged(seen), loader, ckpt_path="last")
    return trainer


@pytest.mark.parametrize(("mc_every", "restored"), [(4, 8), (1, None)])
def test_ckpt_path_last_resumes_from_ours_when_ours_is_as_new(tmp_path, mc_every, restored):
    """Killed before step 11: ours (every 4 steps) has step 8. Found 2026-12-05: with
    Lightning's last.ckpt of step 8 too, fit(ckpt_path="last") loaded it, silently: no random
    streams in it, so dropout drew other masks and every later step differed. Now ours, as new,
    is taken (exact). A last.ckpt of step 10 (every step) is newer: Lightning's is loaded."""
    ref: dict = {}
    _fit_from_last(tmp_path / "ref", ref, [], mc_every)
    work, ck = tmp_path / "run", tmp_path / "run" / "ck"
    with pytest.raises(_Killed):
        _fit_from_last(work, {}, [ResilientCheckpoint(ck, every_n_steps=4), _KillAt(10)], mc_every)
    again: dict = {}
    rc = ResilientCheckpoint(ck, every_n_steps=4)
    _fit_from_last(work, again, [rc], mc_every)
    assert rc.restored_step == restored
    assert min(again) == (restored or 10) + 1
    if restored is not None:
        assert again == {s: ref[s] for s in again}


def test_ckpt_path_last_takes_ours_of_the_same_step_written_before_lightnings(tmp_path):
    """Found 2026-12-06 under DDP (tests/test_lightning_setups.py, -m slow): a run resumed in
    its last steps, in which the ModelCheckpoint saved nothing, gets Lightning's last.ckpt
    written in on_train_end, after our final checkpoint of the same step committed; run again,
    fit(ckpt_path="last") took Lightning's file (newer by its time), which holds no random
    streams: the re-run did not end as the run did. The same step is as new: ours is taken."""
    work, ck = tmp_path / "run", tmp_path / "run" / "ck"
    with pytest.raises(_Killed):
        _fit_from_last(work, {}, [ResilientCheckpoint(ck, every_n_steps=4), _KillAt(18)], 8)
    rc = ResilientCheckpoint(ck, every_n_steps=4)
    _fit_from_last(work, {}, [rc], 8)  # from our step 16 (Lightning's last.ckpt: 16 too) to 20
    assert rc.restored_step == 16
    ours = os.path.getmtime(ck / "step_000000020" / "manifest.json")
    os.utime(work / "mc" / "last.ckpt", (ours + 5, ours + 5))  # written later (as under DDP)
    rc = ResilientCheckpoint(ck, every_n_steps=4)
    _fit_from_last(work, {}, [rc], 8)
    assert rc.restored_step == 20


class _Clock:
    """Lightning's Timer reads ``time.monotonic()``: here each training batch takes 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def on_train_batch_start(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.now += 1.0


def test_a_run_stopped_by_max_time_run_again_ends_as_the_run_did(tmp_path, monkeypatch):
    """Found 2026-12-05: run again with its max_time used up, the Timer set should_stop in
    on_fit_start and Lightning skipped the whole loop: no on_train_start (so not our line
    saying why nothing trains), no end of the epoch the stop was in, no on_train_end."""
    from datetime import timedelta

    clock = _Clock()
    monkeypatch.setattr("lightning.pytorch.callbacks.timer.time", clock)
    tick = type("_Tick", (L.Callback,), {"on_train_batch_start": clock.on_train_batch_start})

    def fit() -> tuple[list[str], int, int | None]:
        export = _Export()
        rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=100)
        timer = L.pytorch.callbacks.Timer(timedelta(seconds=5), interval="step")
        trainer = L.Trainer(
            max_steps=40,
            accelerator="cpu",
            callbacks=[timer, tick(), export, rc],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_Linear(), torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
        assert trainer.global_step == 5  # stopped by the Timer, in the middle of epoch 0
        return export.seen, trainer.current_epoch, rc.restored_step

    hooks = ["train_start", "epoch_end 0", "train_end at epoch 1"]
    assert fit() == (hooks, 1, None)
    assert fit() == (hooks, 1, 5)  # the same max_time: used up, nothing trained


class _Starts(L.Callback):
    """The global step at each ``fit()``'s first batch."""

    def __init__(self) -> None:
        self.at: list[int] = []

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.at.append(trainer.global_step)


def test_an_explicit_resume_applies_to_the_first_fit_only(tmp_path, caplog):
    """``ResilientCheckpoint(resume=4)`` in a two-stage script: stage 1 resumes from step 4,
    stage 2 (the same Trainer's second ``fit()``) goes on from the live state, as with
    ``resume="auto"``. (Found 2026-12-06: stage 2 restored step 4 again, throwing away stage
    1's steps 5..12 and its fresh optimizers.) The abandoned branch's 16..30 is no "newer
    checkpoint" that stage 2 trains again."""
    _stages(tmp_path, {}, [ResilientCheckpoint(tmp_path / "ck", every_n_steps=4)], by_steps=12)
    seen: dict = {}
    starts = _Starts()
    rc = ResilientCheckpoint(tmp_path / "ck", every_n_steps=4, resume=4)
    _stages(tmp_path, seen, [rc, starts], by_steps=12)
    assert starts.at == [4, 12]
    assert sorted(seen) == list(range(5, 31))
    assert {seen[s][1] for s in range(13, 31)} == {0.01}  # stage 2's fresh optimizer
    assert "newer checkpoint" not in caplog.text
