"""Host buffers of background saves are allocated ahead, in a helper thread, at the first step
that does not save; the first save then copies into them instead of allocating."""

from __future__ import annotations

import torch

from resilient_callbacks import Checkpointer
from resilient_callbacks.snapshot import HostBuffers


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt, {"model": model, "optimizer": opt, "extra": {"t": torch.arange(5)}}


def test_first_save_uses_the_buffers_allocated_ahead(tmp_path):
    model, _opt, state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=3) as ck:
        assert ck.step(1, state) is False
        ck._buffers.wait_allocated()
        ahead = {k: b.data_ptr() for k, b in ck._buffers._bufs.items()}
        # parameters, both AdamW moments per parameter, and the extra tensor
        assert len(ahead) >= 4 + 8 + 1
        assert ck.step(2, state) is False
        assert ck.step(3, state) is True
        ck.flush()
        after = {k: b.data_ptr() for k, b in ck._buffers._bufs.items()}
        assert after == ahead  # the save copied into them; nothing was allocated again
        want = {k: v.clone() for k, v in model.state_dict().items()}
    model2, _opt2, state2 = _state()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(state2) == 3
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_synchronous_saves_allocate_nothing_ahead(tmp_path):
    _, _, state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=3, async_save=False) as ck:
        ck.step(1, state)
        ck._buffers.wait_allocated()
        assert ck._buffers.nbytes == 0


def test_buffers_wait_for_the_allocation_and_match_shapes():
    bufs = HostBuffers()
    tensors = {"a": torch.ones(1000, 300), "b": torch.ones(3, dtype=torch.bfloat16)}
    bufs.allocate_in_background(tensors)
    b = bufs.get("a", tensors["a"])  # waits for the helper thread
    assert b.shape == (1000, 300) and b.dtype == torch.float32
    assert bufs.get("b", tensors["b"]).dtype == torch.bfloat16
    # a changed shape gets a new buffer
    assert bufs.get("a", torch.ones(10)).shape == (10,)
    bufs.allocate_in_background(tensors)  # buffers exist: nothing started
    assert bufs._filler is None


def test_close_waits_for_the_buffers_being_allocated_ahead(tmp_path, monkeypatch):
    """A run that ends (an exception, a preemption) right after its first step closed the
    Checkpointer while the helper thread still allocated, a daemon thread inside torch when
    the interpreter exited: now and then the process aborted ("terminate called without an
    active exception", exit 134 instead of the exception's 1; 2 of 120 runs on a loaded
    machine). close() waits for it."""
    import threading
    import time

    from resilient_callbacks import snapshot

    make = snapshot._make

    def slow_make(specs):
        time.sleep(1.0)  # (a few GB take as long)
        return make(specs)

    monkeypatch.setattr(snapshot, "_make", slow_make)
    _, _, state = _state()
    with Checkpointer(tmp_path / "ck", every_n_steps=10) as ck:
        assert ck.step(1, state) is False
    assert not [t.name for t in threading.enumerate() if t.name == "rc-host-buffers"]


def test_a_snapshot_checks_each_buffer_once_and_copies_without_a_graph(monkeypatch):
    """Snapshot takes its buffers from ensure(), which checks every name's shape and dtype once,
    instead of asking get() again per tensor (two checks, two calls a tensor: a fixed cost of
    every background save of a many-tensor state). The copies hold the values, made again for a
    new shape, and record no autograd graph from a tensor that requires grad."""
    from resilient_callbacks.snapshot import Snapshot

    calls = []
    get = HostBuffers.get
    monkeypatch.setattr(HostBuffers, "get", lambda self, *a: calls.append(a) or get(self, *a))
    leaf = torch.randn(3, requires_grad=True)
    tensors = {f"t{i}": torch.full((2,), float(i)) for i in range(50)} | {"leaf": leaf}
    hb = HostBuffers()
    first = Snapshot(tensors, hb).copies
    again = Snapshot(tensors, hb).copies
    assert calls == []
    assert all(again[k] is first[k] for k in tensors)  # the same buffers, reused
    assert all(torch.equal(again[k], t.detach()) for k, t in tensors.items())
    assert not again["leaf"].requires_grad and again["leaf"].grad_fn is None
    tensors["t0"] = torch.ones(4, dtype=torch.float64)
    resized = Snapshot(tensors, hb).copies
    assert resized["t0"].dtype == torch.float64 and torch.equal(resized["t0"], tensors["t0"])
