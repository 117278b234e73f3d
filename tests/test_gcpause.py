"""A restore runs with Python's cyclic collector paused (gcpause.py): no collection walks the
process while it builds the state, the state comes back bit for bit, and the collector is left
as the restore found it."""

from __future__ import annotations

import gc
import os
import select
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_callbacks import Checkpointer, gcpause, restore_load


def _in_load() -> bool:
    """Whether this thread is inside a restore's load (restore_load.CandidateLoader._try_load)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_try_load" and f.f_code.co_filename.endswith("restore_load.py"):
            return True
        f = f.f_back
    return False


@pytest.fixture
def eager_collector() -> Iterator[list[tuple[int, bool]]]:
    """The collector set to run every 20 allocations; yields the collections since: each its
    generation and whether it ran inside a restore's load."""
    seen: list[tuple[int, bool]] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append((info["generation"], _in_load()))

    was, threshold = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(20, 2, 2)
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*threshold)
        (gc.enable if was else gc.disable)()


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"history": [1.5, 2.5], "n": 3}}


def _flat(state: dict[str, Any]) -> list[torch.Tensor]:
    opt_sd = state["optimizer"].state_dict()["state"]
    return list(state["model"].state_dict().values()) + [
        t for s in opt_sd.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_a_restore_runs_no_collection_and_leaves_the_collector_as_it_was(
    tmp_path: Path, eager_collector: list[tuple[int, bool]], enabled: bool
) -> None:
    assert (
        restore_load.CandidateLoader._try_load.__code__.co_name == "_try_load"
    )  # what _in_load finds
    saved = _state(0)
    with Checkpointer(tmp_path, preemption=False, async_save=False) as ck:
        ck.save(1, saved)
    state = _state(1)  # other values, same layout: what a resumed run builds
    if not enabled:
        gc.disable()
    with Checkpointer(tmp_path, preemption=False, read_only=True) as r:
        eager_collector.clear()
        assert r.restore(state) == 1
        during = [g for g, in_load in eager_collector if in_load]
    assert during == []  # (before gcpause: dozens at this threshold, full ones too)
    assert gc.isenabled() is enabled
    got, want = _flat(state), _flat(saved)
    assert len(got) == len(want) > 120
    for a, b in zip(got, want, strict=True):  # bit for bit
        assert a.dtype == b.dtype and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    assert state["extra"] == {"history": [1.5, 2.5], "n": 3}


def test_pauses_of_several_threads_nest() -> None:
    was = gc.isenabled()
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gcpause.paused():
            inside.set()
            release.wait(60)

    t = threading.Thread(target=other)
    try:
        with gcpause.paused():
            t.start()
            assert inside.wait(60)
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause still lasts
        release.set()
        t.join(60)
        assert not t.is_alive()
        assert gc.isenabled()
        with pytest.raises(ValueError), gcpause.paused():  # an error inside: enabled after
            raise ValueError("x")
        assert gc.isenabled()
    finally:
        release.set()
        t.join(60)
        (gc.enable if was else gc.disable)()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_process_forked_during_a_pause_has_the_collector_as_before_it() -> None:
    """A child forked while a pause lasts (another thread starting DataLoader workers) runs
    none of the pauses: it kept the collector disabled for its whole life."""
    was = gc.isenabled()
    gc.enable()
    r, w = os.pipe()
    try:
        with gcpause.paused():
            pid = os.fork()
            if pid == 0:  # the child: report, then leave at once
                try:
                    first = gc.isenabled()
                    with gcpause.paused():  # its own pauses still work (a lock it can take)
                        inner = gc.isenabled()
                    os.write(w, f"{int(first)}{int(inner)}{int(gc.isenabled())}".encode())
                finally:
                    os._exit(0)
            assert not gc.isenabled()  # the parent's pause goes on
        assert gc.isenabled()
        os.close(w)
        w = -1
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "the forked child did not answer in 60 s"
        assert os.read(r, 16) == b"101"  # enabled; paused inside its own pause; enabled after
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        os.close(r)
        if w != -1:
            os.close(w)
        (gc.enable if was else gc.disable)()
