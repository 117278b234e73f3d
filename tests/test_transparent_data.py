"""ResumableDataLoader changes nothing in an uninterrupted run, and resumes exactly.

Swapping the stock ``DataLoader`` for a ``ResumableDataLoader`` with the same shuffling gives the
same batches, the same draws from the global torch RNG and from the loader's generator (so
dropout sees the same numbers), and the same worker base seeds; a plain training loop with
dropout, a shuffled loader and a ``Checkpointer`` saving every few steps ends with the same
losses and weights, bit for bit, as the loop with the stock loader and no checkpointer. A run
restored from a checkpoint mid-epoch or at an epoch boundary then continues exactly as the
uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from resilient_callbacks import Checkpointer, ResumableDataLoader, ResumableSampler

N, BS = 22, 4  # 6 batches per epoch, the last one of 2


class Indexed(Dataset):
    """Sample i is (i, the seed of the process that loads it): a worker's seed is the loader's
    base seed plus its id, so batches show the base seed the loader drew."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, torch.initial_seed()


def epochs(loader, n_epochs: int = 3) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Every batch of ``n_epochs`` epochs, the seeds that loaded them, and the global RNG state
    at the end (what the loader drew from it)."""
    batches, seeds = [], []
    for e in range(n_epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(e)
        for idx, seed in loader:
            batches.append(idx.tolist())
            seeds.append(seed.tolist())
    return batches, seeds, torch.get_rng_state()


def stock_and_ours(kind: str, **kw):
    ds = Indexed()
    if kind == "global":
        return DataLoader(ds, BS, shuffle=True, **kw), ResumableDataLoader(ds, BS, **kw)
    if kind == "seed":
        stock = DataLoader(ds, BS, shuffle=True, generator=torch.Generator().manual_seed(5), **kw)
        return stock, ResumableDataLoader(ds, BS, seed=5, **kw)
    if kind == "sequential":
        return DataLoader(ds, BS, **kw), ResumableDataLoader(ds, BS, shuffle=False, **kw)
    assert kind == "distributed"
    sampler = DistributedSampler(ds, num_replicas=3, rank=1, seed=9)
    stock = DataLoader(ds, BS, sampler=sampler, **kw)
    return stock, ResumableDataLoader(ds, BS, num_replicas=3, rank=1, seed=9, **kw)


@pytest.mark.parametrize("kind", ["global", "seed", "sequential", "distributed"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_and_draws_as_the_stock_loader(kind, drop_last):
    stock, ours = stock_and_ours(kind, drop_last=drop_last)
    torch.manual_seed(3)
    ref = epochs(stock)
    torch.manual_seed(3)
    got = epochs(ours)
    assert got[0] == ref[0]
    assert torch.equal(got[2], ref[2])  # the same draws from the global RNG
    if kind == "seed":
        torch.manual_seed(3)
        assert torch.equal(ref[2], torch.get_rng_state())  # the global RNG is not touched
        assert torch.equal(stock.generator.get_state(), ours.generator.get_state())


@pytest.mark.parametrize("kind", ["global", "seed"])
def test_same_worker_seeds_as_the_stock_loader(kind):
    stock, ours = stock_and_ours(kind, num_workers=2)
    torch.manual_seed(4)
    ref = epochs(stock, 2)
    torch.manual_seed(4)
    got = epochs(ours, 2)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert torch.equal(got[2], ref[2])


def test_global_order_equals_dataloader_after_manual_seed_not_a_generator():
    """seed=None follows the global RNG (as DataLoader(shuffle=True) after torch.manual_seed);
    seed=s follows DataLoader(generator=torch.Generator().manual_seed(s)). The two stock loaders
    differ from each other, so no single setting can equal both."""
    ds = Indexed()
    torch.manual_seed(7)
    via_global = epochs(ResumableDataLoader(ds, BS), 1)[0]
    via_seed = epochs(ResumableDataLoader(ds, BS, seed=7), 1)[0]
    torch.manual_seed(7)
    assert via_global == epochs(DataLoader(ds, BS, shuffle=True), 1)[0]
    gen = torch.Generator().manual_seed(7)
    assert via_seed == epochs(DataLoader(ds, BS, shuffle=True, generator=gen), 1)[0]
    assert via_global != via_seed


# ---------------------------------------------------------------------------- a training loop


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def loop(loader, steps: int, ckpt_dir=None, every: int = 3, fresh_rng: int | None = None):
    """Train ``steps`` steps; with ``ckpt_dir`` under a Checkpointer that restores first and
    saves every ``every`` steps. ``fresh_rng``: the process starts elsewhere in its random
    streams (a resumed process is not where the interrupted one was)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(11 if fresh_rng is None else fresh_rng)
    state = {"model": model, "optimizer": opt, "data": loader}
    ckpt = Checkpointer(ckpt_dir, every_n_steps=every, async_save=False) if ckpt_dir else None
    step = ckpt.restore(state) if ckpt else 0
    losses = {}
    while step < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            losses[step] = loss.item()
            if ckpt:
                ckpt.step(step, state)
            if step >= steps:
                break
    if ckpt:
        ckpt.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("kind", ["global", "seed"])
def test_loop_with_checkpointer_equals_the_stock_loop(tmp_path, kind):
    ds = make_data()
    if kind == "global":
        stock, ours = DataLoader(ds, BS, shuffle=True), ResumableDataLoader(ds, BS)
    else:
        stock = DataLoader(ds, BS, shuffle=True, generator=torch.Generator().manual_seed(2))
        ours = ResumableDataLoader(ds, BS, seed=2)
    ref = loop(stock, 20)  # 3 epochs and a bit, no checkpointer
    assert_same(loop(ours, 20, tmp_path / "ck"), ref)


@pytest.mark.parametrize("kind", ["global", "seed", "distributed"])
@pytest.mark.parametrize("stop", [8, 12])  # mid-epoch; the end of epoch 2 (6 batches each)
def test_resume_is_exact(tmp_path, kind, stop):
    ds = make_data()

    def loader():
        if kind == "global":
            return ResumableDataLoader(ds, BS)
        if kind == "seed":
            return ResumableDataLoader(ds, BS, seed=2)
        return ResumableDataLoader(ds, BS, num_replicas=1, rank=0, seed=2)

    ref = loop(loader(), 20)
    first = loop(loader(), stop, tmp_path / "ck", every=stop)
    rest = loop(loader(), 20, tmp_path / "ck", every=100, fresh_rng=999)
    assert {**first[0], **rest[0]} == ref[0]
    assert min(rest[0]) == stop + 1  # nothing replayed
    for k in ref[1]:
        assert torch.equal(rest[1][k], ref[1][k]), k


@pytest.mark.parametrize("kind", ["global", "seed"])
def test_resumed_workers_get_the_base_seed_of_the_interrupted_epoch(kind):
    _, a = stock_and_ours(kind, num_workers=2)
    _, ref = stock_and_ours(kind, num_workers=2)
    torch.manual_seed(4)
    want = [(i.tolist(), s.tolist()) for i, s in ref]
    torch.manual_seed(4)
    it = iter(a)
    head = [(i.tolist(), s.tolist()) for i, s in (next(it), next(it))]
    saved, rng = a.state_dict(), torch.get_rng_state()
    del it
    _, b = stock_and_ours(kind, num_workers=2)
    b.load_state_dict(saved)
    torch.manual_seed(123)  # elsewhere in the stream; the Checkpointer would restore rng
    torch.set_rng_state(rng)
    assert head + [(i.tolist(), s.tolist()) for i, s in b] == want
    assert torch.equal(torch.get_rng_state(), rng)  # the resumed iterator drew nothing


def test_sampler_alone_draws_like_random_sampler():
    from torch.utils.data import RandomSampler

    gen = torch.Generator().manual_seed(8)
    stock = RandomSampler(range(10), generator=gen)
    ours = ResumableSampler(10, seed=8)
    assert [list(stock) for _ in range(3)] == [list(ours) for _ in range(3)]
    assert torch.equal(gen.get_state(), ours.generator.get_state())
    torch.manual_seed(1)
    ref = [list(RandomSampler(range(10))) for _ in range(2)]
    torch.manual_seed(1)
    s = ResumableSampler(10)
    assert [list(s) for _ in range(2)] == ref
