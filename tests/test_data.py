"""ResumableDataLoader / ResumableSampler: exact mid-epoch resume without replaying batches."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="num_samples"):
        ResumableDataLoader(TensorDataset(torch.arange(41)), batch_size=4).load_state_dict(
            a.state_dict()
        )
    with pytest.raises(ValueError, match="sampler"):
        ResumableDataLoader(TensorDataset(torch.arange(4)), sampler=[0, 1])


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
