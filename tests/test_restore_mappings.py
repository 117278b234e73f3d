"""A restore maps checkpoint files; objects of the state must not keep those mappings, or the
files' disk space stays in use after retention deletes the checkpoint (a resumed run then
needed room for one checkpoint more than a fresh one: the disk probe's ENOSPC)."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
import torch

from resilient_callbacks import Checkpointer, mapped


def _held(directory) -> list[str]:
    """Files under ``directory`` that this process maps or has open (Linux /proc)."""
    prefix = os.path.abspath(directory)
    held = []
    with open("/proc/self/maps") as f:
        held += [line.split(None, 5)[-1].strip() for line in f if prefix in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            held.append(target)
    return held


class Keeper:
    """A user object that keeps the tensors its load_state_dict is given."""

    def __init__(self) -> None:
        self.buf = torch.zeros(4096)

    def state_dict(self):
        return {"buf": self.buf}

    def load_state_dict(self, sd):
        self.buf = sd["buf"]


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    keeper = Keeper()
    keeper.buf.normal_()
    return {"model": model, "opt": opt, "keeper": keeper, "extra": {"arr": np.arange(8192.0)}}


def test_a_restored_run_keeps_no_checkpoint_file_mapped(tmp_path):
    """AdamW on the CPU, a user object that keeps what it loads and a NumPy array: after the
    restore nothing maps or holds the checkpoint's files, and the values are the saved ones."""
    saved = _state(0)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, saved)
    live = _state(1)
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(live) == 1
        path = ck.last_restore.path
        assert mapped.still_mapped(path) == []
        assert _held(path) == []
        # what retention does later: the checkpoint goes, and the restored state stays intact
        shutil.rmtree(path)
        assert [f for f in _held(tmp_path / "ck") if not f.endswith(".lock")] == []
    for p, q in zip(live["opt"].state.values(), saved["opt"].state.values(), strict=True):
        assert torch.equal(p["exp_avg"], q["exp_avg"])
        assert torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
    assert torch.equal(live["keeper"].buf, saved["keeper"].buf)
    assert np.array_equal(live["extra"]["arr"], saved["extra"]["arr"])
    live["opt"].step()  # the copies are the optimizer's own, writable memory


def test_an_optimizer_on_a_gpu_would_copy_its_state_so_none_is_made_here():
    """keeps_host_tensors: a module copies; an optimizer keeps host tensors only for
    parameters on the CPU; anything else may keep them."""
    m = torch.nn.Linear(2, 2)
    assert not mapped.keeps_host_tensors(m)
    assert mapped.keeps_host_tensors(torch.optim.SGD(m.parameters(), lr=0.1))
    assert mapped.keeps_host_tensors(Keeper())
    meta = torch.nn.Parameter(torch.empty(2, device="meta"))
    assert not mapped.keeps_host_tensors(torch.optim.SGD([meta], lr=0.1))


@pytest.mark.filterwarnings("ignore:the state's optimizer")  # (saved without its model)
def test_an_optimizer_off_the_cpu_keeps_no_step_tensor_viewing_the_file(tmp_path, caplog):
    """AdamW over parameters off the CPU (meta here, CUDA on a GPU, where bench_gpu.py found
    it): torch moves the moments to the parameters' device but keeps ``step`` on the CPU as
    given, so it viewed the mapped file (the restore warned that the checkpoint's disk space
    stays in use). It is a copy of its own now, with the saved value."""
    saved = _state(0)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"opt": saved["opt"]})
    params = [
        torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in saved["model"].parameters()
    ]
    live = torch.optim.AdamW(params, lr=0.01)
    with Checkpointer(tmp_path / "ck") as ck, caplog.at_level("WARNING", "resilient_callbacks"):
        assert ck.restore({"opt": live}) == 1
        assert mapped.still_mapped(ck.last_restore.path) == []
    assert "still view" not in caplog.text
    for p, q in zip(live.state.values(), saved["opt"].state.values(), strict=True):
        assert p["step"].device.type == "cpu" and not mapped.is_mapped(p["step"])
        assert torch.equal(p["step"], q["step"])
        assert p["exp_avg"].device.type == "meta"


def test_nothing_maps_the_files_once_restore_returns_without_a_collection(tmp_path):
    """The recursive closures that decode and load a checkpoint referred to themselves: a
    cycle that kept the decoded tensors (views of the mapped files) alive until the cyclic GC
    ran, so each restore paid a full collection (0.4 s with torch, Lightning and Transformers
    imported) to free them."""
    import gc

    saved = _state(0)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, saved)
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.disable()
    gc.callbacks.append(seen)
    try:
        with Checkpointer(tmp_path / "ck") as ck:
            assert ck.restore(_state(1)) == 1
            assert mapped.still_mapped(ck.last_restore.path) == []
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    assert collections == []  # (the restore collected when something still mapped the files)


def test_a_checkpoint_the_caller_opened_before_the_restore_is_not_blamed_on_the_state(
    tmp_path, caplog, monkeypatch
):
    """architecture.md's reader: an evaluator that opened the checkpoint with
    `reader.open_checkpoint` (holding its mapped tensors) and then restored a model from it got
    "tensors of the state still view shared.safetensors ... a FilePart's load() should copy"
    (found 2026-12-06): the state kept nothing, the caller's own mapping was counted. Only
    mappings the restore made count now; a state object that keeps one is still warned about."""
    from resilient_callbacks import reader

    saved = _state(0)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, saved)
    opened = reader.open_checkpoint(reader.select(tmp_path / "ck").path)  # kept alive
    with (
        Checkpointer(tmp_path / "ck", read_only=True) as ck,
        caplog.at_level("WARNING", "resilient_callbacks"),
    ):
        assert ck.restore({"model": _state(1)["model"]}) == 1
    assert "still view" not in caplog.text
    assert mapped.still_mapped(ck.last_restore.path)  # the caller's mapping is there
    # a state object that keeps what the restore mapped (no private copy made for it)
    monkeypatch.setattr(mapped, "private", lambda value: value)
    with (
        Checkpointer(tmp_path / "ck", read_only=True) as ck,
        caplog.at_level("WARNING", "resilient_callbacks"),
    ):
        assert ck.restore({"keeper": _state(1)["keeper"]}) == 1
    assert "still view shared.safetensors" in caplog.text
    del opened


class _CountingLock:
    def __init__(self) -> None:
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self) -> None:
        self.taken += 1
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_the_private_copies_of_many_small_tensors_look_up_the_mappings_once(tmp_path, monkeypatch):
    """A CPU optimizer's state of many small tensors: each gets its private copy (not mapped,
    the saved values), and the registry of mappings is read once per object loaded, not two or
    three times per tensor (a restore of 20,000 tensors spent about 0.1 s of its training-thread
    time there)."""
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(300)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sum(p.sum() for p in model).backward()
    opt.step()
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, {"model": model, "opt": opt})
    live_model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(16)) for _ in range(300)])
    live_opt = torch.optim.AdamW(live_model.parameters(), lr=0.01)
    counting = _CountingLock()
    monkeypatch.setattr(mapped, "_lock", counting)
    with Checkpointer(tmp_path / "ck") as ck:
        taken = counting.taken
        assert ck.restore({"model": live_model, "opt": live_opt}) == 1
        taken = counting.taken - taken
        assert mapped.still_mapped(ck.last_restore.path) == []
    assert len(live_opt.state) == 300
    for p, q in zip(live_opt.state.values(), opt.state.values(), strict=True):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(p[k], q[k]) and not mapped.is_mapped(p[k])
    assert taken < 60, taken  # (it was over 1,800: is_mapped and release per tensor)
