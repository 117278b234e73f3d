"""Adding the Lightning ``ResilientCheckpoint`` changes nothing in the run, and a resume is
announced in ``fit()``'s default output.

The script is tests/lightning_train.py: dropout, Python/NumPy noise in the loss, a shuffled
train ``DataLoader`` (which the callback rebuilds as a ``ResumableDataLoader``) of 13 batches
per epoch, validation every 6 batches and a sanity check (their iterators draw from the global
torch RNG), AdamW with a per-step schedule.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import lightning_train
from resilient_callbacks import catalog
from test_lightning import _argv, _finish, _losses, _start

pytestmark = pytest.mark.timeout(300)


def _run(work: Path, *more: str, loader: str = "plain"):
    work.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lightning_train.main(_argv(work, *more, loader=loader))


def _assert_same(a: Path, b: Path) -> None:
    la, lb = _losses(a / "losses.jsonl"), _losses(b / "losses.jsonl")
    assert la and la == lb
    pa, pb = load_file(str(a / "params.safetensors")), load_file(str(b / "params.safetensors"))
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_adding_the_callback_changes_nothing(tmp_path, loader):
    """30 steps (two epoch boundaries, validations between steps), a checkpoint every 4 steps:
    per-step losses and final weights equal the run without the callback, bit for bit."""
    _run(tmp_path / "without", "--max-steps", "30", "--no-callback", loader=loader)
    rc = _run(tmp_path / "with", "--max-steps", "30", loader=loader)
    assert rc is not None and rc.restored_step is None
    assert [e.step for e in catalog.committed(catalog.scan(str(tmp_path / "with" / "ckpt")))]
    _assert_same(tmp_path / "without", tmp_path / "with")


def test_data_seed_changes_the_order_on_purpose(tmp_path):
    """data_seed= replaces the loader's randomness (documented): the control that shows the
    comparison above can fail."""
    _run(tmp_path / "without", "--max-steps", "8", "--no-callback")
    _run(tmp_path / "with", "--max-steps", "8", "--data-seed", "3")
    assert _losses(tmp_path / "without" / "losses.jsonl") != _losses(
        tmp_path / "with" / "losses.jsonl"
    )


@pytest.mark.parametrize(
    "stop, where",
    [(13, "end of epoch 0"), (18, "epoch 1, 5 batch(es) into it")],
    ids=["epoch-end", "mid-epoch"],
)
def test_resumed_run_equals_the_run_without_the_callback(tmp_path, caplog, stop, where):
    _run(tmp_path / "without", "--max-steps", "30", "--no-callback")
    work = tmp_path / "with"
    _run(work, "--max-steps", str(stop))
    with caplog.at_level("INFO"):
        rc = _run(work, "--max-steps", "30")
    assert rc is not None and rc.restored_step == stop
    assert f"ResilientCheckpoint: resumed at step {stop} ({where})" in caplog.text
    _assert_same(tmp_path / "without", work)


def test_with_gradient_accumulation_a_resumed_run_equals_the_run_without_the_callback(tmp_path):
    """accumulate_grad_batches=3 (14 batches an epoch: optimizer steps after batches 3, 6, 9,
    12 and at the epoch's end): stopped at step 7, in epoch 1, and resumed, the run is the run
    without the callback, loss for loss and in its final weights."""
    acc = ("--accumulate", "3")
    _run(tmp_path / "without", "--max-steps", "20", "--no-callback", *acc)
    work = tmp_path / "with"
    _run(work, "--max-steps", "7", *acc)
    rc = _run(work, "--max-steps", "20", *acc)
    assert rc is not None and rc.restored_step == 7
    _assert_same(tmp_path / "without", work)


def test_the_announced_epoch_is_the_trainers_after_a_resume_from_an_epoch_end_ckpt(
    tmp_path, caplog
):
    """A run resumed with fit(ckpt_path=) from ModelCheckpoint's .ckpt written as the last
    fit() stopped counts its epochs one ahead in Lightning's "processed" progress; our next
    resume named that (epoch 2, where the Trainer was training epoch 1)."""
    work = tmp_path / "run"
    _run(work, "--max-steps", "13", "--model-checkpoint", "--val-every", "0")
    (ckpt,) = (work / "mc").glob("epoch=0-step=13.ckpt")
    _run(work, "--max-steps", "20", "--ckpt-path", str(ckpt))  # ours saves 16 and 20
    with caplog.at_level("INFO"):
        rc = _run(work, "--max-steps", "22")
    assert rc is not None and rc.restored_step == 20
    assert "resumed at step 20 (epoch 1, 6 batch(es) into it)" in caplog.text, caplog.text


def test_the_resume_is_announced_in_the_default_output(tmp_path):
    work = tmp_path / "run"
    _run(work, "--max-steps", "6")
    # a process of its own (forked from the zygote that imported Lightning: its logging set
    # up as a fresh interpreter's), its stdout and stderr to one file
    log = tmp_path / "out.txt"
    text = _finish(_start(_argv(work, "--max-steps", "7"), log), log)
    line = next((x for x in text.splitlines() if "ResilientCheckpoint: resumed" in x), None)
    assert line is not None, text[-4000:]
    assert "resumed at step 6 (epoch 0, 6 batch(es) into it)" in line, line
    assert "step_000000006" in line and "(local copy)" in line


@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size"])
def test_a_dict_of_train_loaders_of_different_lengths_is_unchanged(tmp_path, mode, caplog):
    """Two train loaders of 4 and 7 batches: Lightning's CombinedLoader ("max_size_cycle")
    restarts the shorter one within each epoch. Rebuilt as a ResumableDataLoader it numbered
    those restarts as epochs of its own and, from the second epoch on, gave other samples and
    skipped the global-RNG draws of the original; it is now left as it is (with a warning):
    the run with the callback is the run without it, batch for batch. Mode "max_size" lets the
    shorter one run out within the epoch (found 2026-11-25: rebuilt, a resume after it ran out
    gave its next epoch's batches in the same epoch): left as it is too."""
    import lightning as L
    from lightning.pytorch.utilities import CombinedLoader
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from resilient_callbacks.lightning import ResilientCheckpoint

    class Idx(Dataset):
        def __len__(self) -> int:
            return self.n

        def __init__(self, n: int) -> None:
            self.n = n

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([float(i)])

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.seen = nn.Linear(1, 1), []

        def training_step(self, batch, i):  # type: ignore[no-untyped-def]
            got = [batch[k] for k in ("a", "b") if batch[k] is not None]  # max_size: a runs out
            a, b = (None if batch[k] is None else batch[k].flatten().tolist() for k in "ab")
            self.seen.append((self.current_epoch, i, a, b, torch.rand(()).item()))
            return sum(self.lin(x).mean() for x in got)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            loaders = {
                "a": DataLoader(Idx(32), batch_size=8, shuffle=True),  # 4 batches: cycled
                "b": DataLoader(Idx(28), batch_size=4, shuffle=True),  # 7 batches
            }
            return CombinedLoader(loaders, mode=mode)

    def fit(callbacks: list) -> list:
        L.seed_everything(0, verbose=False)
        model = Model()
        trainer = L.Trainer(
            max_epochs=3, callbacks=callbacks, logger=False, enable_checkpointing=bool(callbacks),
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model)
        return model.seen

    without = fit([])
    with_cb = fit([ResilientCheckpoint(tmp_path / "ck", every_n_steps=2)])
    assert len(without) == 21 and with_cb == without
    assert "shorter loader within an epoch" in caplog.text and "left as it is" in caplog.text
