"""Background saving: consistent snapshots, bounded memory, errors never lost, signals during
an in-flight save."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest
import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, CheckpointWriteError, catalog


def _model_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt):
    loss = model(torch.randn(16, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _values(model, opt):
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["snapshot", "overlapped"])
def test_mutating_right_after_save_does_not_change_the_checkpoint(tmp_path, overlap):
    model, opt = _model_state()
    _train_step(model, opt)
    state = {"model": model, "optimizer": opt}
    expected = _values(model, opt)  # the state at the save step
    with Checkpointer(tmp_path / "ck", overlap_snapshot=overlap, preemption=False) as ck:
        assert ck.save(1, state)
        # training goes on at once: every tensor changes while the save persists
        for _ in range(3):
            _train_step(model, opt)  # in overlapped mode the optimizer's pre-step hook waits
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)
        ck.flush()
    fresh_model, fresh_opt = _model_state(seed=1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore({"model": fresh_model, "optimizer": fresh_opt}) == 1
    got = _values(fresh_model, fresh_opt)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_overlapped_snapshot_waits_at_the_optimizer_step(tmp_path):
    model, opt = _model_state()
    _train_step(model, opt)
    before = _values(model, opt)
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        _train_step(model, opt)  # no explicit wait: the hook makes the step wait for the copy
        ck.flush()
    fresh_model, fresh_opt = _model_state(seed=1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        ck.restore({"model": fresh_model, "optimizer": fresh_opt})
    got = _values(fresh_model, fresh_opt)
    assert all(torch.equal(got[k], before[k]) for k in before)


@pytest.fixture
def slow_deferred_copies(monkeypatch):
    """The overlapped snapshot's deferred copies start 0.3 s late, so that one that would read
    a tensor written after the save reads the write."""
    import time

    from resilient_callbacks import snapshot

    copy_later = snapshot.Snapshot._copy_later

    def slow(self, items, stream):
        time.sleep(0.3)
        copy_later(self, items, stream)

    monkeypatch.setattr(snapshot.Snapshot, "_copy_later", slow)


def _optimizer_at(address: int, params) -> torch.optim.Optimizer:
    """An AdamW made at ``address`` (a freed optimizer's): CPython hands a freed object's
    memory to the next object of its size, so bare instances are made until one lands there."""
    held = []
    for _ in range(100_000):
        o = object.__new__(torch.optim.AdamW)
        if id(o) == address:
            o.__init__(params, lr=1e-2)
            return o
        held.append(o)
    raise AssertionError("no object was made at the freed optimizer's address")


def test_an_optimizer_made_at_a_freed_ones_address_waits_for_the_copy_too(
    tmp_path, slow_deferred_copies
):
    """An optimizer replaced after a save (layers unfrozen, a new optimizer made) can be made at
    the freed one's address. The hooks were kept by id(): the new optimizer was taken for hooked,
    its step did not wait for the next save's deferred copies, and that checkpoint held the
    parameters after the step."""
    model, opt = _model_state()
    _train_step(model, opt)
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        ck.flush()
        address = id(opt)
        del opt
        gc.collect()
        opt = _optimizer_at(address, model.parameters())
        _train_step(model, opt)
        before = _values(model, opt)
        ck.save(2, {"model": model, "optimizer": opt})
        _train_step(model, opt)  # must wait for save 2's deferred copies
        ck.flush()
    fresh_model, fresh_opt = _model_state(seed=1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore({"model": fresh_model, "optimizer": fresh_opt}) == 2
    got = _values(fresh_model, fresh_opt)
    assert [k for k in before if not torch.equal(got[k], before[k])] == []


@pytest.mark.parametrize("in_optimizer", [False, True], ids=["own", "frozen-in-the-optimizer"])
def test_overlapped_snapshot_copies_a_module_no_optimizer_steps_at_once(
    tmp_path, slow_deferred_copies, in_optimizer
):
    """Only the optimizer's next step waits for the deferred copies, so only what it steps may
    be deferred: an EMA copy of the model (its own module, or frozen inside the optimizer's
    groups), updated in place right after the save (before any step), must be saved as it
    was (the deferred copies are slowed)."""
    model, opt = _model_state()
    ema, _ = _model_state(seed=2)
    if in_optimizer:  # AdamW(self.parameters()) over a module holding a frozen EMA copy
        ema.requires_grad_(False)
        opt.add_param_group({"params": list(ema.parameters())})
    _train_step(model, opt)
    state = {"model": model, "optimizer": opt, "ema": ema}
    expected = {k: v.clone() for k, v in ema.state_dict().items()}
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        ck.save(1, state)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.5)
        _train_step(model, opt)
        ck.flush()
    fresh_model, fresh_opt = _model_state(seed=1)
    fresh_ema, _ = _model_state(seed=3)
    if in_optimizer:
        fresh_ema.requires_grad_(False)
        fresh_opt.add_param_group({"params": list(fresh_ema.parameters())})
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        ck.restore({"model": fresh_model, "optimizer": fresh_opt, "ema": fresh_ema})
    for k, v in fresh_ema.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_overlapped_snapshot_copies_a_two_pass_optimizers_weights_at_once(tmp_path, monkeypatch):
    """A SAM-style optimizer's first_step() writes the weights in place outside any step(),
    right after the save; only its base optimizer's step (after second_step() put them back)
    waited for the deferred copies, which could read the moved weights (a GPU's copy runs
    beside first_step's kernels): the checkpoint held weights of no step. The deferred copies
    run here while the weights are moved. Its parameters are copied before save() returns
    now; the base optimizer's momentum, written only by its step(), is still deferred."""
    from resilient_callbacks import snapshot
    from test_save_on_exception import SAM

    moved, copied = threading.Event(), threading.Event()
    copy_later = snapshot.Snapshot._copy_later

    def between_the_passes(self, items, stream):
        moved.wait(timeout=60)
        copy_later(self, items, stream)
        copied.set()

    monkeypatch.setattr(snapshot.Snapshot, "_copy_later", between_the_passes)

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        sam = SAM(model.parameters(), torch.optim.SGD, lr=0.01, momentum=0.9)
        return {"model": model, "sam": sam, "base": sam.base_optimizer}

    def two_pass_step(state, between=lambda: None):
        model, sam = state["model"], state["sam"]
        x = torch.randn(16, 64)
        model(x).square().mean().backward()
        sam.first_step()
        between()
        sam.zero_grad()
        model(x).square().mean().backward()
        sam.second_step()
        sam.zero_grad()

    def copy_now():
        moved.set()
        copied.wait(timeout=60)  # (no deferred copy at all would do too)

    state = build(0)
    moved.set()
    two_pass_step(state)
    moved.clear()
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    momentum = [s["momentum_buffer"].clone() for s in state["base"].state.values()]
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        ck.save(1, state)
        two_pass_step(state, between=copy_now)
        ck.flush()
    fresh = build(1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore(fresh) == 1
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, expected[k]), k
    got = [s["momentum_buffer"] for s in fresh["base"].state.values()]
    assert all(torch.equal(a, b) for a, b in zip(got, momentum, strict=True))


def test_overlapped_snapshot_defers_a_fabric_optimizers_parameters_as_a_plain_ones():
    """Lightning Fabric's optimizer is a torch optimizer by its class that holds the one it
    steps and passes the hooks' attributes on from it: it was taken for a SAM-style two-pass
    wrapper, so an overlapped save copied its parameters and state before save() returned
    (nothing deferred). They are deferred as the plain optimizer's are."""
    from lightning.fabric import Fabric

    from resilient_callbacks.snapshot import optimizer_step_storages

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    fmodel, fopt = fabric.setup(model, opt)
    fabric.backward(fmodel(torch.randn(3, 4)).sum())
    fopt.step()
    plain = optimizer_step_storages({"model": model, "optimizer": opt})
    assert len(plain) == 6  # (the weight and the bias, and two moments of each)
    assert optimizer_step_storages({"model": fmodel, "optimizer": fopt}) == plain


@pytest.mark.parametrize("how", ["step", "save"])
def test_a_final_overlapped_save_copies_before_it_returns(tmp_path, slow_deferred_copies, how):
    """No optimizer step follows the final save to wait for its deferred copies, and the end
    of training may write the weights in place (the Trainer's load_best_model_at_end, probe):
    the final save's copies are done when it returns (the deferred copies are slowed)."""
    model, opt = _model_state()
    _train_step(model, opt)
    state = {"model": model, "optimizer": opt}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        if how == "step":
            ck.step(1, state, final=True)
        else:
            ck.save(1, state, final=True)
        with torch.no_grad():  # the best model loaded into the live one
            for p in model.parameters():
                p.zero_()
    fresh_model, fresh_opt = _model_state(seed=1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        ck.restore({"model": fresh_model, "optimizer": fresh_opt})
    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_thirty_saves_do_not_grow_memory(tmp_path):
    state = {"w": [torch.randn(4_000_000) for _ in range(4)]}  # 64 MB
    size = 64_000_000
    with Checkpointer(tmp_path / "ck", keep_last=2, preemption=False) as ck:
        ck.save(1, state)
        ck.flush()
        gc.collect()
        after_first = _rss_bytes()
        for s in range(2, 31):
            for t in state["w"]:
                t.add_(1.0)
            ck.save(s, state)
        ck.flush()
        gc.collect()
        growth = _rss_bytes() - after_first
    assert growth <= 0.05 * size, f"RSS grew by {growth / 1e6:.1f} MB over 29 saves"


def test_background_saves_allocate_their_write_buffer_once(tmp_path, monkeypatch):
    """The O_DIRECT bounce buffer is made with the host buffers at the first save and reused:
    later saves allocate nothing (a fresh 16 MB buffer per file showed as RSS noise)."""
    from resilient_callbacks import tensorfile

    made = []
    real = tensorfile.DirectBuffer.__init__

    def counting(self, *a, **k):
        made.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(tensorfile.DirectBuffer, "__init__", counting)
    state = {"w": [torch.randn(3_000_000) for _ in range(2)]}  # two 12 MB tensors: O_DIRECT path
    with Checkpointer(tmp_path / "ck", keep_last=1, preemption=False) as ck:
        for s in range(1, 5):
            for t in state["w"]:
                t.add_(1.0)
            ck.save(s, state)
        ck.flush()
    assert len(made) == 1
    got = {"w": [torch.zeros(3_000_000) for _ in range(2)]}
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore(got) == 4
    assert all(torch.equal(a, b) for a, b in zip(got["w"], state["w"], strict=True))


def test_background_failure_surfaces_on_close(tmp_path):
    state = {"w": torch.zeros(10)}
    ck = Checkpointer(tmp_path / "ck", preemption=False)
    ck.save(1, state)
    ck.flush()
    # root ignores permissions, so break the directory itself: it becomes a file
    (tmp_path / "ck").rename(tmp_path / "moved")
    (tmp_path / "ck").write_text("not a directory")
    ck.save(2, state)  # returns after the snapshot; the write fails in the background
    with pytest.raises(CheckpointWriteError, match="step 2"):
        ck.close()


def test_signal_during_an_in_flight_save_is_handled_after_it_commits(tmp_path):
    state = {"w": torch.randn(20_000_000)}  # 80 MB: the background write takes a while
    with Checkpointer(tmp_path / "ck", every_n_steps=10, exit_on_preemption=False) as ck:
        assert ck.step(10, state) is True  # persisting in the background now
        os.kill(os.getpid(), signal.SIGUSR1)
        state["w"].add_(1.0)
        assert ck.step(11, state) is True  # the emergency save: after the in-flight one commits
        assert ck.preempted
    entries = [e for e in catalog.scan(str(tmp_path / "ck"), catalog.Depth.FULL) if e.manifest]
    assert [(e.step, e.manifest.reason, str(e.status)) for e in entries] == [
        (10, "periodic", "valid"),
        (11, "emergency", "valid"),
    ]


def test_an_optimizer_not_in_the_state_waits_for_the_copy_too(tmp_path, slow_deferred_copies):
    """Overlapped: only the state's optimizers waited for the deferred copies. A second
    optimizer over the same parameters, not in the state (made after the save, or a wrapper's
    own), stepped at once, and the checkpoint held parameters after its step."""
    model, opt = _model_state()
    _train_step(model, opt)
    before = _values(model, opt)
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False) as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        model(torch.randn(16, 64)).square().mean().backward()
        other.step()  # must wait for save 1's deferred copies
        ck.flush()
    fresh_model, fresh_opt = _model_state(seed=1)
    with Checkpointer(tmp_path / "ck", preemption=False) as ck:
        assert ck.restore({"model": fresh_model, "optimizer": fresh_opt}) == 1
    got = _values(fresh_model, fresh_opt)
    assert [k for k in before if not torch.equal(got[k], before[k])] == []


_COMPILED_STEP = """
import sys, torch
from resilient_callbacks import Checkpointer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
step = torch.compile(opt.step, backend="eager")
with Checkpointer(sys.argv[1], every_n_steps=2, overlap_snapshot=True, preemption=False) as ck:
    for s in range(1, 5):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        step()
        opt.zero_grad()
        if ck.step(s, {"model": model, "optimizer": opt}):
            saved = {k: v.clone() for k, v in model.state_dict().items()}
    ck.flush()
fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
with Checkpointer(sys.argv[1], read_only=True) as ck:
    assert ck.restore({"model": fresh}) == 4
assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in saved.items())
print("ok")
"""


def test_an_optimizer_step_under_torch_compile_runs_the_hooks_untraced(tmp_path):
    """``torch.compile(opt.step)`` (PyTorch's recipe for a faster optimizer) traced the
    overlapped snapshot's pre-step hook: a warning at every run ("Dynamo does not know how to
    trace the builtin `_thread.get_ident`"), and the hook's reads became guards of the compiled
    step. The hooks run untraced (``torch.compiler.disable``); the checkpoint holds the state
    at the save."""
    import sys

    # a process of its own (Dynamo's caches), forked from the session's zygote (torch imported)
    p = spawn_ranks.run_python(
        [sys.executable, "-c", _COMPILED_STEP, str(tmp_path / "ck")], timeout=300
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    assert "does not know how to trace" not in p.stderr, p.stderr[-3000:]


def test_a_failed_deferred_copy_fails_the_save_not_the_optimizer_step(tmp_path, monkeypatch):
    """Overlapped: a deferred copy that failed (out of host memory, say) raised its raw error
    from the pre-step hook inside ``optimizer.step()``, the training step crashing in torch's
    optimizer. The state is intact (the copy only reads it): the step runs, and the save fails
    as a background save does (a ``CheckpointWriteError`` naming its step, raised by the next
    save or by ``close()``); the previous checkpoint stays."""
    from resilient_callbacks import snapshot

    def failing(self, items, stream):
        self._error = MemoryError("cannot allocate memory for the copy")

    model, opt = _model_state()
    _train_step(model, opt)
    ck = Checkpointer(tmp_path / "ck", overlap_snapshot=True, preemption=False)
    ck.save(1, {"model": model, "optimizer": opt})
    ck.flush()
    monkeypatch.setattr(snapshot.Snapshot, "_copy_later", failing)
    ck.save(2, {"model": model, "optimizer": opt})
    _train_step(model, opt)  # waits for the copies, and steps
    with pytest.raises(CheckpointWriteError, match="step 2"):
        ck.close()
    entries = catalog.committed(catalog.scan(str(tmp_path / "ck"), catalog.Depth.FULL))
    assert [e.step for e in entries] == [1]


def _gated_background_writes(monkeypatch, fail: bool) -> threading.Event:
    """Background writes wait for the returned event (then fail, with ``fail``); synchronous
    ones (an emergency save) go through at once."""
    from resilient_callbacks import persisting

    gate = threading.Event()
    write = persisting._write

    def gated(saver, session, staging_dir, prepared, background):
        if background:
            gate.wait(120)
            if fail:
                raise OSError("disk went away")
        return write(saver, session, staging_dir, prepared, background)

    monkeypatch.setattr(persisting, "_write", gated)
    return gate


@pytest.mark.parametrize("fails", [False, True], ids=["commits", "fails"])
def test_emergency_save_of_a_step_still_being_written_returns_once_it_is_durable(
    tmp_path, monkeypatch, fails
):
    """emergency_save(N) right after step N's background save started returned False at once
    ("already saved") without waiting for it: a health check that then ended the process lost
    checkpoint N, and if that background write failed, N was never saved. It now waits for the
    background save and, if it failed, saves N itself."""
    gate = _gated_background_writes(monkeypatch, fail=fails)
    state = {"w": torch.arange(10.0)}
    ck = Checkpointer(tmp_path / "ck", every_n_steps=5, preemption=False)
    ck.restore(state)
    assert ck.step(5, state)  # in the background, held at the gate
    opener = threading.Timer(0.3, gate.set)  # the write goes on while emergency_save waits
    opener.start()
    try:
        ck.emergency_save(5, state)
        names = [e.name for e in ck.checkpoints()]  # before anything else can commit it
    finally:
        opener.cancel()
        gate.set()
    assert names == ["step_000000005"]
    entry = catalog.scan(str(tmp_path / "ck"), catalog.Depth.FULL)[-1]
    assert entry.manifest is not None and str(entry.status) == "valid"
    assert entry.manifest.reason == ("emergency" if fails else "periodic")
    ck.close()
