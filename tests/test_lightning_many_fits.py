"""Many ``fit()``\\ s in one process, one after another (a sweep, a notebook): each fit with
ResilientCheckpoint leaves nothing of itself behind, whether it ended, failed or was preempted,
and the next one (on the same dirpath too) runs as in a fresh process."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from resilient_callbacks.lightning import ResilientCheckpoint

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _UserError(Exception):
    pass


class _Net(L.LightningModule):
    def __init__(self, fail_at: int | None = None, signal_at: int | None = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.fail_at, self.signal_at = fail_at, signal_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise _UserError("the user's training step failed")
        if self.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    tmp_path: Path, module: _Net, dirpath: Path, max_steps: int = 4, **kw
) -> ResilientCheckpoint:
    rc = ResilientCheckpoint(dirpath, every_n_steps=2, **kw)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=[rc],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on workers and logging
        trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=4))
    return rc


def _users_handler(signum, frame):  # pragma: no cover - never called
    pass


@pytest.fixture
def handlers():
    """A handler of the user's on SIGTERM and SIGUSR1 for the test, the old ones after it."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _users_handler)
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_a_fit_that_failed_gives_the_signal_handlers_back(tmp_path, handlers):
    """Lightning's signal connector took our handler as the one to restore (the Checkpointer
    installs it before the connector registers its own), and restores it after the
    ``on_exception`` hooks closed the Checkpointer: the closed watcher's handler stayed on
    SIGTERM and SIGUSR1 after a failed fit (found 2026-12-07), where a later Trainer's
    connector composed it into its own SIGTERM handler (the signal then killed the process
    instead of stopping that Trainer)."""
    threads = threading.active_count()
    with pytest.raises(_UserError):
        _fit(tmp_path, _Net(fail_at=3), tmp_path / "ck")
    assert [signal.getsignal(s) for s in SIGNALS] == [_users_handler] * 2
    assert threading.active_count() == threads
    # the next fit, on the same dirpath: resumes from the failed fit's checkpoint, and gives
    # the handlers back again
    rc = _fit(tmp_path, _Net(), tmp_path / "ck", max_steps=6)
    assert rc.restored_step == 2
    assert [signal.getsignal(s) for s in SIGNALS] == [_users_handler] * 2


def test_fits_that_end_or_are_preempted_leave_nothing_behind(tmp_path, handlers):
    """A fit that ended and one preempted with ``exit_on_preemption=False``, each followed by
    a fit on its dirpath: the handlers, threads and file descriptors of before, the lock free
    (the next fit resumes), the process not taken for one exiting."""
    from resilient_callbacks.preemption import exiting

    _fit(tmp_path, _Net(), tmp_path / "warm-up")
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for name, net, resumed in (("ended", _Net(), 4), ("preempted", _Net(signal_at=1), 2)):
        rc = _fit(tmp_path, net, tmp_path / name, exit_on_preemption=False)
        assert rc.preempted == (name == "preempted")
        assert exiting.code() is None
        rc = _fit(tmp_path, _Net(), tmp_path / name, max_steps=6)
        assert rc.restored_step == resumed
        assert [signal.getsignal(s) for s in SIGNALS] == [_users_handler] * 2
        assert threading.active_count() == threads
        assert len(os.listdir("/proc/self/fd")) == fds


def test_a_sweep_of_trainers_keeps_no_entry_per_fit(tmp_path):
    """What the callback remembers of a finished fit (so that the same Trainer's next fit goes
    on from the live state) stayed, one entry per dirpath, after its Trainer and module were
    gone: one per trial of a sweep, for the life of the process."""
    import gc

    from resilient_callbacks.lightning import refit

    for trial in range(3):
        _fit(tmp_path, _Net(), tmp_path / f"t{trial}")
        gc.collect()
    mine = [k for k in refit._FINISHED if k.startswith(os.path.realpath(tmp_path))]
    assert len(mine) <= 1, mine
