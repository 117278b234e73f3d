"""More notices of a run of two gloo ranks, counted per rank as tests/test_rank_notices.py does:
each said once where it is the same on every rank, by its rank, naming it, where it is one
rank's own (the rule in ``resilient_callbacks.notices``).

The worker (this file: ``python test_rank_notices_inputs.py worker DIR``), on both ranks:

- saves a state whose optimizer steps a tensor the state does not hold (said once: the state's
  structure is the same on every rank; it was said by every rank);
- restores a ``ResumableDataLoader`` saved at an epoch's end over a dataset grown since (said
  once: the dataset is the same on every rank; it was said by every rank);
- creates a ``PreemptionWatcher`` in another thread, and replaces the Checkpointer's SIGUSR1
  handler with its own (each said once: the same code runs on every rank);
- saves a ``FilePart`` incrementally whose frozen tensor rank 1 alone then changes through
  ``.data`` (said by rank 1, naming it: that rank's own shard; it named no rank).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading

import torch
from torch import nn

import spawn_ranks
from resilient_callbacks import Checkpointer, PerRank
from resilient_callbacks.data import ResumableDataLoader


def _unsaved_params(root: str) -> None:
    model = nn.Linear(2, 2)
    master = nn.Parameter(torch.zeros(3))  # stepped, but in no state_dict() of the state
    opt = torch.optim.SGD([*model.parameters(), master], lr=0.1)
    with Checkpointer(root, async_save=False, preemption=False) as ck:
        ck.save(1, {"model": model, "opt": opt})


def _grown_dataset(root: str, rank: int) -> None:
    def loader(n: int) -> ResumableDataLoader:
        return ResumableDataLoader(list(range(n)), 2, seed=0, num_replicas=2, rank=rank)

    first = loader(8)
    for _ in first:  # the whole epoch
        pass
    with Checkpointer(root, async_save=False, preemption=False) as ck:
        ck.save(1, {"data": PerRank(first)})
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"data": PerRank(loader(12))}) == 1


def _watchers(root: str) -> None:
    from resilient_callbacks.preemption.signals import PreemptionWatcher

    other = threading.Thread(target=lambda: PreemptionWatcher().install())
    other.start()
    other.join(60)
    ck = Checkpointer(root, every_n_steps=10**6, exit_on_preemption=False, async_save=False)
    state = {"model": nn.Linear(2, 2)}
    ck.step(1, state)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # replaces the Checkpointer's
    try:
        ck.step(2, state)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    ck.close()


def _written_unseen(root: str, rank: int) -> None:
    from test_part_blobs import WithOptimizer

    part = WithOptimizer()
    with Checkpointer(root, incremental=True, preemption=False, async_save=False) as ck:
        ck.save(1, {"engine": part})
        if rank == 1:
            part.frozen.data.add_(1.0)  # through .data: its version counter does not move
        ck.save(2, {"engine": part})


def worker(root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    _unsaved_params(os.path.join(root, "params"))
    _grown_dataset(os.path.join(root, "data"), rank)
    _watchers(os.path.join(root, "watchers"))
    _written_unseen(os.path.join(root, "parts"), rank)
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "worker":
    worker(sys.argv[2])


import pytest  # noqa: E402  (after the worker code, which does not need it)

from test_rank_notices import _count  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_notices_of_the_state_the_data_and_the_watcher_said_once_a_shards_by_its_rank(tmp_path):
    argv = [sys.executable, __file__, "worker", str(tmp_path / "ckpt")]
    zygote = spawn_ranks.shared_zygote()  # (each rank forked: torch imported once)
    outputs = spawn_ranks.run(argv, 2, tmp_path, "inputs", deadline=240, zygote=zygote).outputs
    shown = "\n".join(f"--- rank {r}:\n{out}" for r, out in enumerate(outputs))
    once = [
        "the state's optimizer(s) step 1 tensor(s) that the state does not hold",
        "ResumableDataLoader: the dataset has 12 samples here but 8 in the checkpoint",
        "PreemptionWatcher.install() was called outside the main thread",
        "the SIGUSR1 handler was replaced after the checkpointer installed its own",
    ]
    for text in once:
        assert _count(outputs, text) == [1, 0], f"{text!r}:\n{shown}"
    unseen = "incremental=True: frozen tensor(s) 'frozen' changed since the last save"
    assert _count(outputs, unseen) == [0, 1], shown
    assert _count(outputs, f"rank 1: {unseen}") == [0, 1], shown
