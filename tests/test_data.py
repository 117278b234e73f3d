"""ResumableDataLoader / ResumableSampler: exact mid-epoch resume without replaying batches."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from resilient_callbacks import ResumableDataLoader, ResumableSampler


class Counting(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        return i


def ids(batch) -> list[int]:
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch[0].tolist())


def stream(loader, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n:
        for b in loader:
            out.append(ids(b))
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "stop", [1, 7, 10, 13]
)  # 10 batches per epoch: mid-epoch and at boundaries
def test_resume_continues_with_the_next_unseen_batch(num_workers, stop):
    ds = TensorDataset(torch.arange(40))
    ref = stream(ResumableDataLoader(ds, batch_size=4, seed=3, num_workers=num_workers), 25)
    a = ResumableDataLoader(ds, batch_size=4, seed=3, num_workers=num_workers)
    first = stream(a, stop)
    saved = a.state_dict()
    b = ResumableDataLoader(ds, batch_size=4, seed=3, num_workers=num_workers)
    b.load_state_dict(saved)
    rest = stream(b, 25 - stop)
    assert first + rest == ref
    # epochs are real permutations of the data, different from each other
    assert sorted(i for b in ref[:10] for i in b) == list(range(40)) and ref[:10] != ref[10:20]


def test_restored_at_an_epochs_end_the_next_pass_is_empty_unless_set_epoch_moved_on():
    """Saved after the last batch of epoch 0 (its iterator not run out yet). A plain loop's next
    pass ends epoch 0 (empty) and the one after is epoch 1. Lightning creates the iterator and
    then announces epoch 1 (``set_epoch``) before asking for a batch: that iterator must give
    epoch 1's batches -- an empty pass there made Lightning count it as epoch 1 and lose it."""
    ds = TensorDataset(torch.arange(40))
    ref = ResumableDataLoader(ds, batch_size=4, seed=3)
    epochs = [[ids(b) for b in ref] for _ in range(2)]

    def at_epoch_end() -> ResumableDataLoader:
        a = ResumableDataLoader(ds, batch_size=4, seed=3)
        it = iter(a)
        assert [ids(next(it)) for _ in range(10)] == epochs[0]
        b = ResumableDataLoader(ds, batch_size=4, seed=3)
        b.load_state_dict(a.state_dict())
        return b

    plain = at_epoch_end()
    assert [ids(b) for b in plain] == []
    assert [ids(b) for b in plain] == epochs[1]
    lightning = at_epoch_end()
    it = iter(lightning)
    lightning.set_epoch(1)
    assert [ids(b) for b in it] == epochs[1]
    assert lightning.epoch == 2


def test_creating_iterators_draws_as_the_stock_loader():
    """seed=s: the global RNG is left alone (like DataLoader(generator=...)); no seed: the global
    RNG advances exactly as under DataLoader(shuffle=True)."""
    ds = TensorDataset(torch.arange(10))
    loader = ResumableDataLoader(ds, batch_size=3, seed=1)
    before = torch.get_rng_state().clone()
    for _ in range(3):
        for _b in loader:
            pass
    assert torch.equal(before, torch.get_rng_state())
    states = []
    for make in (lambda: DataLoader(ds, 3, shuffle=True), lambda: ResumableDataLoader(ds, 3)):
        torch.manual_seed(0)
        loader = make()
        for _ in range(3):
            for _b in loader:
                pass
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1]) and not torch.equal(states[0], before)


def test_resume_loads_no_skipped_sample():
    ds = Counting(1_000_000)
    a = ResumableDataLoader(ds, batch_size=10, seed=0)
    a.load_state_dict({**a.state_dict(), "batches_consumed": 90_000})
    it = iter(a)
    next(it)
    assert ds.calls == 10  # only the batch returned was loaded: no replay of 900,000 samples


def test_mismatched_checkpoint_is_an_error():
    a = ResumableDataLoader(TensorDataset(torch.arange(40)), batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        ResumableDataLoader(TensorDataset(torch.arange(40)), batch_size=8).load_state_dict(
            a.state_dict()
        )
    stream(a, 3)  # inside epoch 0: the position means nothing in other data
    with pytest.raises(ValueError, match="saved 3 of 10 batches into epoch 0: the data changed"):
        ResumableDataLoader(TensorDataset(torch.arange(41)), batch_size=4).load_state_dict(
            a.state_dict()
        )
    with pytest.raises(ValueError, match="sampler"):
        ResumableDataLoader(TensorDataset(torch.arange(4)), sampler=[0, 1])
    data = TensorDataset(torch.arange(40))
    state = ResumableDataLoader(data, batch_size=4).state_dict()  # no generator of its own
    said = "without its own generator (seed=/generator=), this one is with; construct it"
    with pytest.raises(ValueError, match=re.escape(said)):
        ResumableDataLoader(data, batch_size=4, seed=1).load_state_dict(state)


@pytest.mark.parametrize("at", ["end", "start"])
def test_data_added_between_runs_is_taken_at_an_epochs_end_or_start(at):
    """A run re-run with more data (40 samples, then 48) was refused at any checkpoint, even
    at an epoch's end where the saved position is the whole epoch (a probe, 2026-12-05): the
    next epoch goes over the new data (the one saved at its start, when saved there), with a
    warning."""
    old = ResumableDataLoader(TensorDataset(torch.arange(40)), batch_size=4, seed=0)
    stream(old, 10 if at == "end" else 0)  # epoch 0 over, or not begun
    new = ResumableDataLoader(TensorDataset(torch.arange(48)), batch_size=4, seed=0)
    with pytest.warns(UserWarning, match=f"saved at the {at} of epoch 0: epoch"):
        new.load_state_dict(old.state_dict())
    epoch = [i for b in stream(new, 12) for i in b]
    assert sorted(epoch) == list(range(48))  # one whole epoch of the new data
    assert new.epoch == (1 if at == "end" else 0)


def test_the_sampler_takes_the_number_of_samples_and_says_so_when_given_a_dataset():
    with pytest.raises(TypeError, match=re.escape("ResumableSampler(len(dataset), seed=...)")):
        ResumableSampler(TensorDataset(torch.arange(10)), seed=3)  # type: ignore[arg-type]
    assert len(list(ResumableSampler(10, seed=3))) == 10


def test_sharding_partitions_each_epoch_across_ranks():
    n, world = 10, 3
    shards = [list(ResumableSampler(n, seed=1, num_replicas=world, rank=r)) for r in range(world)]
    assert all(len(s) == 4 for s in shards)  # padded by wrapping, like DistributedSampler
    assert {i for s in shards for i in s} == set(range(n))


def test_sampler_resumes_mid_epoch_with_plain_dataloader():
    s = ResumableSampler(20, seed=5)
    it = iter(s)
    head = [next(it) for _ in range(7)]
    t = ResumableSampler(20, seed=5)
    t.load_state_dict(s.state_dict())
    ref = list(ResumableSampler(20, seed=5))
    assert head + list(t) == ref


def _taken(loaders: list[ResumableDataLoader], batches: int) -> list[int]:
    """Each rank takes ``batches`` batches in lockstep (data-parallel training); the samples."""
    its = [iter(ld) for ld in loaders]
    out: list[int] = []
    for _ in range(batches):
        for it in its:
            out += next(it)[0].tolist()
    return out


@pytest.mark.parametrize("world, batch", [(1, 8), (3, 2), (2, 4)])
def test_an_epoch_saved_on_other_ranks_or_batch_size_goes_on_without_repeating_a_sample(
    world, batch
):
    ds = TensorDataset(torch.arange(50))
    saved = [ResumableDataLoader(ds, 4, seed=0, num_replicas=2, rank=r) for r in range(2)]
    for ld in saved:  # epoch 0 whole, then 3 batches of epoch 1 on each rank
        list(ld)
    first = _taken(saved, 3)
    state = saved[0].state_dict()  # every rank holds the same position: rank 0's is enough
    if (world, batch) == (2, 4):  # unchanged sharding: its own state, as before
        state = saved[1].state_dict()
        resumed = [ResumableDataLoader(ds, 4, seed=0, num_replicas=2, rank=1)]
    else:
        resumed = [
            ResumableDataLoader(ds, batch, seed=0, num_replicas=world, rank=r) for r in range(world)
        ]
    for ld in resumed:
        ld.load_state_dict(state)
    rest = [x for ld in resumed for b in ld for x in b[0].tolist()]
    if (world, batch) == (2, 4):
        assert rest == [x for b in saved[1] for x in b[0].tolist()]
        return
    assert sorted(set(first) | set(rest)) == list(range(50))  # nothing of epoch 1 left out
    assert not set(first) & set(rest)  # nothing trained twice
    assert len(rest) <= 50 - len(first) + world  # only DistributedSampler's padding added
    # the next epoch is the plain sharding of this number of ranks
    fresh = [
        ResumableDataLoader(ds, batch, seed=0, num_replicas=world, rank=r) for r in range(world)
    ]
    for ld in fresh:
        ld.set_epoch(2)
    assert [[b[0].tolist() for b in ld] for ld in resumed] == [
        [b[0].tolist() for b in ld] for ld in fresh
    ]


def test_a_resharded_epoch_saved_again_resumes_where_it_was():
    ds = TensorDataset(torch.arange(50))
    saved = [ResumableDataLoader(ds, 4, seed=0, num_replicas=2, rank=r) for r in range(2)]
    first = _taken(saved, 2)
    one = ResumableDataLoader(ds, 8, seed=0, num_replicas=1, rank=0)
    one.load_state_dict(saved[0].state_dict())
    second = _taken([one], 1)
    again = ResumableDataLoader(ds, 8, seed=0, num_replicas=1, rank=0)
    again.load_state_dict(one.state_dict())  # same sharding now: continues the re-sharded order
    rest = [x for b in again for x in b[0].tolist()]
    assert rest == [x for b in one for x in b[0].tolist()]
    assert sorted(first + second + rest) == list(range(50))


def test_the_sampler_alone_refuses_a_position_of_another_sharding():
    s2 = ResumableSampler(20, num_replicas=2, rank=0)
    it = iter(s2)
    next(it)
    with pytest.raises(ValueError, match="num_replicas=1 here but 2 in the checkpoint"):
        ResumableSampler(20, num_replicas=1, rank=0).load_state_dict(s2.state_dict())


def test_a_sharded_position_written_before_reshuffle_existed_keeps_its_order():
    old = ResumableSampler(20, num_replicas=2, rank=0)
    it = iter(old)
    next(it)
    state = old.state_dict()
    del state["reshuffle"]  # as versions before it wrote the state
    s = ResumableSampler(20, num_replicas=2, rank=0, reshuffle=False)
    s.load_state_dict(state)
    assert s.reshuffle is True  # the run goes on in the order it began with
    with pytest.raises(ValueError, match="reshuffle=False here but True"):
        ResumableSampler(20, num_replicas=2, rank=0, reshuffle=False).load_state_dict(
            old.state_dict()
        )


@pytest.mark.slow  # suite time budget (rank changes run by default in test_lightning_reshard.py)
@pytest.mark.distributed
def test_a_loader_saved_on_two_ranks_goes_on_over_three(tmp_path):
    import json
    import sys
    from pathlib import Path

    import spawn_ranks

    worker = str(Path(__file__).with_name("loader_ranks_worker.py"))
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")

    def run(args: list[str], world: int, name: str, expect: int | None = 0) -> list[str]:
        argv = [sys.executable, worker, *args]
        return spawn_ranks.run(argv, world, tmp_path, name, expect=expect, deadline=150).outputs

    def read(name: str) -> list[int]:
        return json.loads(Path(name).read_text())

    run(["save", root, out], 2, "save")
    run(["resume", root, out], 3, "resume")  # rank 2 wrote nothing: it takes rank 0's state
    taken = read(f"{out}.taken.rank0.json") + read(f"{out}.taken.rank1.json")
    rest = [x for r in (0, 1, 2) for x in read(f"{out}.rank{r}.json")]
    assert len(taken) == 24 and not set(taken) & set(rest)  # nothing of the epoch twice
    assert set(taken) | set(rest) == set(range(50))  # nothing left out
    assert len(rest) == 27  # the 26 left, padded to 3 equal shares as DistributedSampler pads
    # with new_ranks="refuse" (the default) rank 2 has no state: the resume is refused
    refused = run(["resume", root, out + "x", "refuse"], 3, "refuse", expect=None)
    assert any("missing for this rank" in o for o in refused), refused


# ---------------------------------------------------------------------------- loops users write


def _epochs_loop(loader, epochs: int, *, start_step: int = 0, stop: int | None = None):
    """``for epoch in range(start, E): loader.sampler.set_epoch(epoch); for batch in loader``,
    as DDP and Lightning code announce epochs; the batches (and the state at ``stop``)."""
    seen, step = [], start_step
    first = start_step // len(loader) if not loader.passes_are_epochs else 0
    for epoch in range(first, epochs):
        loader.sampler.set_epoch(epoch)
        for (b,) in loader:
            step += 1
            seen.append(b.tolist())
            if step == stop:
                return seen, loader.state_dict()
    return seen, None


@pytest.mark.parametrize("stop", [6, 9])  # an epoch's last batch; mid-epoch
@pytest.mark.parametrize("passes", [False, True])
def test_set_epoch_every_epoch_resumes_exactly(stop, passes):
    """``set_epoch`` for an epoch the resumed run skips (``passes_are_epochs``) keeps the
    restored position (it replayed the epoch); after a checkpoint at an epoch's last batch,
    ``set_epoch`` of the next one first finishes the sampler as the uninterrupted loop's
    iterator did (RandomSampler's trailing draw: every later epoch came in another order)."""
    ds = TensorDataset(torch.arange(24))

    def make():
        return ResumableDataLoader(ds, 4, seed=5, passes_are_epochs=passes)

    ref, _ = _epochs_loop(make(), 3)
    head, state = _epochs_loop(make(), 3, stop=stop)
    resumed = make()
    resumed.load_state_dict(state)
    rest, _ = _epochs_loop(resumed, 3, start_step=stop)
    assert head + rest == ref


def test_options_a_resume_cannot_honour_are_refused():
    ds = TensorDataset(torch.arange(24))
    with pytest.raises(ValueError, match="in_order=True"):
        ResumableDataLoader(ds, 4, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match="batch_size=None"):
        ResumableDataLoader(ds, batch_size=None)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(ValueError, match="needs a map-style dataset"):  # was torch's len() error
        ResumableDataLoader(Stream(), 4)
    saved = ResumableDataLoader(ds, 4, seed=3)
    next(iter(saved))
    for other in (
        ResumableDataLoader(ds, 4, seed=4),
        ResumableDataLoader(ds, 4, generator=torch.Generator().manual_seed(4)),
    ):
        with pytest.raises(ValueError, match="another seed"):
            other.load_state_dict(saved.state_dict())
    same = ResumableDataLoader(ds, 4, generator=torch.Generator().manual_seed(3))
    same.load_state_dict(saved.state_dict())  # the same generator, given either way


def test_persistent_workers_resumed_later_take_the_first_epochs_seed():
    """Persistent workers are made once, by the first epoch's iterator: a run resumed in a
    later epoch makes its pool with that seed (it took the later epoch's)."""
    ds = TensorDataset(torch.arange(16))

    def make():
        return ResumableDataLoader(ds, 4, seed=1, num_workers=2, persistent_workers=True)

    def seeds(loader, epochs):
        out = []
        for _ in range(epochs):
            it = iter(loader)
            next(it)
            out.append(loader._iterator._base_seed)
            for _ in it:
                pass
        return out

    ref = make()
    want = seeds(ref, 3)
    part = make()
    seeds(part, 1)
    state = part.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert seeds(resumed, 2) == want[1:]


def test_a_discarded_loader_with_persistent_workers_stops_them_at_once():
    import gc
    import time

    ds = TensorDataset(torch.arange(16))
    gc.disable()  # as between two collections: only reference counting frees the loader
    try:
        loader = ResumableDataLoader(ds, 4, num_workers=2, persistent_workers=True)
        next(iter(loader))
        workers = list(loader._iterator._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        del loader
        deadline = time.monotonic() + 120
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


def test_a_loader_resharded_at_an_epoch_boundary_says_that_epoch_was_complete(caplog):
    """Saved on 2 ranks right at the end of an epoch and resumed on 1: the warning said "the
    rest of epoch 0 (0 of its samples, ...) is sharded", as if work were left (the docs
    walkthrough). It now says the epoch was complete; the next one starts as usual."""
    ds = TensorDataset(torch.arange(50))
    saved = [ResumableDataLoader(ds, 4, seed=0, num_replicas=2, rank=r) for r in range(2)]
    _taken(saved, len(saved[0]))  # every batch of epoch 0, the iterator not yet at its end
    one = ResumableDataLoader(ds, 4, seed=0, num_replicas=1, rank=0)
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        one.load_state_dict(saved[0].state_dict())
    said = [r.getMessage() for r in caplog.records if "data loader" in r.getMessage()]
    assert said and "epoch 0 was complete" in said[0] and "0 of its samples" not in said[0], said
    assert list(one) == []  # the rest of epoch 0: nothing
    assert sorted(x for b in one for x in b[0].tolist()) == list(range(50))  # epoch 1, whole


def test_a_drop_last_epoch_saved_at_its_end_is_over_on_another_number_of_ranks(caplog):
    """drop_last=True on 2 ranks of 50 samples leaves one sample per rank out of each epoch
    (25 a rank, batches of 4). Saved after epoch 0's last batch and resumed on 1 rank, the
    resumed run trained those two left-out samples as one more batch of epoch 0 (the epoch's
    boundary moved by a step, and the warning said "the rest of epoch 0 (2 of its samples)");
    the epoch is over now, as it was for the run that saved it."""
    ds = TensorDataset(torch.arange(50))
    saved = [
        ResumableDataLoader(ds, 4, seed=0, num_replicas=2, rank=r, drop_last=True) for r in range(2)
    ]
    first = _taken(saved, len(saved[0]))  # every batch of epoch 0
    assert len(first) == 48
    one = ResumableDataLoader(ds, 4, seed=0, num_replicas=1, rank=0, drop_last=True)
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        one.load_state_dict(saved[0].state_dict())
    said = [r.getMessage() for r in caplog.records if "data loader" in r.getMessage()]
    assert said and "epoch 0 was complete (48 samples trained)" in said[0], said
    assert list(one) == []  # the end of epoch 0: no batch
    assert one.epoch == 1
    assert len([x for b in one for x in b[0].tolist()]) == 48  # epoch 1, whole, on one rank


def test_a_drop_last_rest_resharded_says_how_many_samples_it_leaves_out(caplog):
    """drop_last=True, 16 samples on 2 ranks with batches of 3 (two batches a rank), saved
    after the first, resumed on 3 ranks: of the 10 samples left each rank gets 4 (padded),
    one whole batch, so one sample is not trained. The warning said "the rest of epoch 0 (10
    of its samples) is sharded", as if all of it would be; it now says how many are left out."""
    ds = TensorDataset(torch.arange(16))
    saved = [
        ResumableDataLoader(ds, 3, seed=0, num_replicas=2, rank=r, drop_last=True) for r in range(2)
    ]
    first = _taken(saved, 1)
    three = [
        ResumableDataLoader(ds, 3, seed=0, num_replicas=3, rank=r, drop_last=True) for r in range(3)
    ]
    with caplog.at_level(logging.WARNING, logger="resilient_callbacks"):
        for ld in three:
            ld.load_state_dict(saved[0].state_dict())
    rest = [x for ld in three for b in ld for x in b[0].tolist()]
    assert not set(first) & set(rest) and len(rest) == 9
    left_out = set(range(16)) - set(first) - set(rest)
    said = [r.getMessage() for r in caplog.records if "data loader" in r.getMessage()]
    assert len(said) == 1 and "the rest of epoch 0 (10 of its samples" in said[0], said
    assert len(left_out) == 1 and "with drop_last=True the last 1 of them" in said[0], said


def test_lightning_says_a_sampler_with_its_own_generator_changes_later_epochs_too():
    """A Lightning train loader it cannot rebuild: the warning said only that a mid-epoch
    resume restarts the epoch's data; with a sampler of its own generator (not saved), every
    epoch after any resume draws another order too, and the warning says so."""
    pytest.importorskip("lightning")
    from torch.utils.data import WeightedRandomSampler

    from resilient_callbacks.lightning.loaders import make_resumable

    ds = TensorDataset(torch.arange(8.0))
    g = torch.Generator().manual_seed(0)
    own = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8, generator=g))
    loader, reason = make_resumable(own)
    assert loader is own and "the following epochs draw other orders too" in str(reason)
    plain = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    assert make_resumable(plain)[1] == "its sampler is a WeightedRandomSampler"
