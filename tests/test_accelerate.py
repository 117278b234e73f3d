"""A plain Hugging Face Accelerate loop (``accelerator.prepare`` + ``accumulate``) with a
Checkpointer: SIGKILLed mid-epoch and mid accumulation window, re-run, it equals the run never
stopped bit for bit (docs/accelerate.md); accelerate's prepared loaders and a save inside an
accumulation window are refused, before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import spawn_ranks
from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import UnsupportedStateError

LOOP = str(Path(__file__).with_name("accelerate_loop.py"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        i, v = line.split()
        out[int(i)] = v  # a resumed run logs the steps after its checkpoint again: last wins
    return out


def _one(tmp: Path, ck: str, out: str, kill_at: int, expect: int) -> None:
    p = subprocess.run(
        [sys.executable, LOOP, str(tmp / ck), str(tmp / out), str(kill_at)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == expect, p.stdout + p.stderr


def _same(tmp: Path, a: str, b: str, ranks: int) -> None:
    for r in range(ranks):
        la, lb = _losses(tmp / f"{a}.rank{r}.losses"), _losses(tmp / f"{b}.rank{r}.losses")
        assert la == lb, f"rank {r}: first differing micro-step " + str(
            min(i for i in la if la[i] != lb.get(i))
        )
    pa = torch.load(tmp / f"{a}.params")
    pb = torch.load(tmp / f"{b}.params")
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow  # three processes importing accelerate: about 15 s
def test_killed_mid_window_resumes_exactly_one_process(tmp_path: Path) -> None:
    _one(tmp_path, "ck_full", "full", 0, 0)
    _one(tmp_path, "ck", "run", 9, -9)  # mid epoch 0 (11 batches), in a window (after step 4)
    _one(tmp_path, "ck", "run", 0, 0)
    assert len(_losses(tmp_path / "full.rank0.losses")) == 33
    _same(tmp_path, "full", "run", 1)


@pytest.mark.slow
def test_killed_mid_window_resumes_exactly_two_processes(tmp_path: Path) -> None:
    def group(ck: str, out: str, kill_at: int, expect: int) -> None:
        argv = [sys.executable, LOOP, str(tmp_path / ck), str(tmp_path / out), str(kill_at)]
        spawn_ranks.run(argv, 2, tmp_path, f"{out}{kill_at}", expect=expect)

    group("ck_full", "full", 0, 0)
    group("ck", "run", 5, -9)  # mid epoch 0 (6 batches a rank), in a window
    group("ck", "run", 0, 0)
    assert len(_losses(tmp_path / "full.rank1.losses")) == 18  # two ranks sharded the data
    _same(tmp_path, "full", "run", 2)


REFUSAL = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from resilient_callbacks import Checkpointer
from resilient_callbacks.errors import UnsupportedStateError
cfg = DataLoaderConfiguration(use_stateful_dataloader=sys.argv[2] == "stateful")
acc = Accelerator(cpu=True, dataloader_config=cfg)
ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
loader = acc.prepare(torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True))
next(iter(loader))
with Checkpointer(sys.argv[1]) as ckpt:
    try:
        ckpt.save(1, {"data": loader})
    except UnsupportedStateError as e:
        print("REFUSED", e)
"""


@pytest.mark.parametrize("kind", ["plain", "stateful"])
def test_prepared_loader_refused(tmp_path: Path, kind: str) -> None:
    """Old src: plain failed inside accelerate (AttributeError: 'DataLoader' object has no
    attribute 'dl_state_dict'); stateful was saved and resumed with other batches, silently."""
    if kind == "stateful":
        pytest.importorskip("torchdata")
    p = subprocess.run(
        [sys.executable, "-c", REFUSAL, str(tmp_path / "ck"), kind],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "REFUSED state['data'] is accelerate's DataLoaderShard" in p.stdout, p.stderr
    assert "ResumableDataLoader" in p.stdout and "docs/accelerate.md" in p.stdout
    assert not any((tmp_path / "ck").glob("step*"))


class _FakeAccelerator:  # the two attributes Accumulation reads, as accelerate names them
    def __init__(self, step: int, sync: bool) -> None:
        self.gradient_state = object()
        self.step, self.sync_gradients, self.gradient_accumulation_steps = step, sync, 4


def test_accumulation_saves_the_step_and_refuses_mid_window(tmp_path: Path) -> None:
    from resilient_callbacks.accelerate import Accumulation

    with Checkpointer(tmp_path / "ck") as ckpt:
        with pytest.raises(UnsupportedStateError, match="inside a gradient accumulation window"):
            ckpt.save(1, {"acc": Accumulation(_FakeAccelerator(3, False))})
        assert ckpt.save(2, {"acc": Accumulation(_FakeAccelerator(8, True))})
    live = _FakeAccelerator(0, True)
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore({"acc": Accumulation(live)}) == 2
    assert live.step == 8
    with pytest.raises(TypeError, match=r"accelerate\.Accelerator"):
        Accumulation(object())


def test_save_on_exception_with_step_called_every_micro_batch(tmp_path: Path) -> None:
    """With save_on_exception, every step() remembers its state for an exception's save: one
    inside an accumulation window (no save due) raised Accumulation's refusal, so a loop
    calling step() every micro-batch died at its first one. Now that step() goes on, and an
    exception mid-window saves the window's start (the last optimizer step)."""
    from resilient_callbacks.accelerate import Accumulation

    live = _FakeAccelerator(0, True)
    w = torch.zeros(3)
    state = {"w": w, "acc": Accumulation(live)}
    with (
        pytest.raises(RuntimeError, match="boom"),
        Checkpointer(tmp_path / "ck", every_n_steps=100, save_on_exception=True) as ckpt,
    ):
        for micro in range(1, 7):
            live.step, live.sync_gradients = micro, micro % 4 == 0
            if live.sync_gradients:
                w += 1.0  # the optimizer step
            assert not ckpt.step(micro, state)
        raise RuntimeError("boom")  # inside the second window (micro-steps 5, 6)
    back = _FakeAccelerator(0, True)
    got = {"w": torch.zeros(3), "acc": Accumulation(back)}
    with Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.restore(got) == 4
    assert back.step == 4 and torch.equal(got["w"], torch.ones(3))


def test_a_subclass_of_a_prepared_loader_is_refused_too(tmp_path: Path) -> None:
    """A user's subclass of accelerate's DataLoaderShard has its state_dict(): it was not
    refused (the check read the class's own name), and the save failed inside accelerate."""
    from accelerate.data_loader import DataLoaderShard

    class MyShard(DataLoaderShard):
        pass

    loader = MyShard(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with (
        pytest.raises(UnsupportedStateError, match=r"DataLoaderShard \(MyShard subclasses it\)"),
        Checkpointer(tmp_path / "ck", async_save=False) as ckpt,
    ):
        ckpt.save(1, {"data": loader})
    assert not any((tmp_path / "ck").glob("step*"))
