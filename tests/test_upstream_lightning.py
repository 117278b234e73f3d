"""Lightning's own loop-restart tests, run with our callback doing the resume.

The code is upstream's (tests/upstream/lightning/loops_restart.py, vendored from
Lightning-AI/pytorch-lightning tag 2.6.5, tests/tests_pytorch/loops/test_loops.py; what changed
is listed in tests/upstream/lightning/ORIGIN.md). Upstream resumes with
``fit(ckpt_path=".../epoch=0-step=2.ckpt")``; here the first run is stopped before its step 3
(an exception, or a real SIGKILL of a child process) and the same ``fit`` runs again: our
``ResilientCheckpoint`` resumes it. Upstream's assertions then compare the ``ModelCheckpoint``
files the resumed run writes (fit loop, epoch loop and optimizer loop progress, LR scheduler,
weights) with those of an uninterrupted run, and check the counters its restart logic expects
(``test_fit_loop_reset``) on the loop state our callback hands Lightning's restore.
"""

from __future__ import annotations

import pytest

from upstream.lightning import loops_restart as up
from upstream.lightning import restore_step_epoch

# bit-identical to the SIGKILLed child (which runs with one intra-op thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_fit_loop_reset_and_exception_resume(tmp_path):
    """The default test (about 2 s). Upstream's test_fit_loop_reset on the loop state our
    callback hands Lightning for a mid-epoch step (2) and an epoch's last step (4): the same
    counters, before and after the reset, as on Lightning's own ``ModelCheckpoint`` files of
    those steps. Then one case of test_loop_state_on_exception below (accumulation over 2
    batches, stopped in epoch 1 at batch 2, resumed from our exception save): the regression
    test of the train data drawn from the restored random streams."""
    up.test_fit_loop_reset(tmp_path / "reset", source="ours")
    up.test_loop_state_on_exception(2, 1, 2, tmp_path / "exception")


@pytest.mark.slow
def test_fit_loop_reset_control(tmp_path):
    """The same on Lightning's own files (upstream's test as it is): the control."""
    up.test_fit_loop_reset(tmp_path, source="lightning")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_restart_parity(tmp_path, how):
    up.test_restart_parity(tmp_path, how=how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_restart_with_val_parity(tmp_path, how):
    up.test_restart_with_val_parity(tmp_path, how=how)


@pytest.mark.slow
def test_loop_state_on_complete_run(tmp_path):
    up.test_loop_state_on_complete_run(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("with_val", [False, True])
def test_restart_from_last_parity(tmp_path, with_val):
    up.test_restart_from_last_parity(tmp_path, with_val=with_val)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
@pytest.mark.parametrize("stop_epoch", [1, 2])
@pytest.mark.parametrize("stop_batch", [1, 2])
def test_loop_state_on_exception(tmp_path, accumulate_grad_batches, stop_epoch, stop_batch):
    """Upstream's stop points and gradient accumulation, resumed by ours from its exception
    save (``save_on_exception=True``): the run ends with the uninterrupted run's weights and
    loop state. Upstream's BoringModel draws its train data (``RandomDataset``) in
    ``train_dataloader()``: before the fix, a resume built that data from the restored random
    streams, and every one of these resumed runs trained on other data."""
    up.test_loop_state_on_exception(accumulate_grad_batches, stop_epoch, stop_batch, tmp_path)


@pytest.mark.slow
def test_correct_step_and_epoch(tmp_path):
    """Upstream's test_restore.py::test_correct_step_and_epoch: a finished fit (2 epochs) is
    continued by a new Trainer with more epochs, resumed by ours from the checkpoint it saved at
    the end of the first fit: the epoch, the global step and the count of stepped batches at
    ``on_train_start`` and at the end are those of Lightning's ``ckpt_path`` resume."""
    restore_step_epoch.test_correct_step_and_epoch(tmp_path)
