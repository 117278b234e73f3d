"""GPU checks of the code that came after the last GPU run (``pytest -m gpu``; CUDA needed).

The H200 run of docs/performance.md tested the library code of 9c6a21b. What touches CUDA
tensors since then has run on the CPU only; each test here checks one such path on a GPU:

- ``incremental=True`` compares a sample of every frozen tensor it would skip with the same
  elements at the last save (``unchanged.watch_all``). On a GPU the sample must read what the
  kernels queued before the save wrote (a ``.data`` write behind a sleeping kernel is found and
  stored), for a contiguous and a transposed frozen weight; its control removes the comparison
  and must restore the stale tensor. The sample costs one host synchronization per device and
  save, as docs/incremental.md says, and a save without ``incremental`` none
  (``torch.cuda.set_sync_debug_mode``).
- Overlapped mode: an optimizer not in the state (made after the save) that steps the saved
  parameters at once waits for the deferred copies (the global optimizer pre-step hook); its
  control removes that hook and must tear. The same with ``torch.compile(opt.step)`` (the hooks
  run untraced, ``torch.compiler.disable``).
- A CUDA ``torch.Generator`` in the state round-trips (``rng.GeneratorState``).

Skipped where ``torch.cuda.is_available()`` is False, deselected by default (the ``gpu`` marker).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from resilient_callbacks import Checkpointer, saving, unchanged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]

WIDTH = 4096  # a 64 MB fp32 weight: its copy takes milliseconds, a sleeping kernel longer


def _sleep_then(write: Callable[[], object]) -> None:
    """Queue ``write`` behind a kernel that sleeps about 0.1 s: not run when this returns."""
    torch.cuda._sleep(200_000_000)
    write()


# ------------------------------------------------------------ incremental: the frozen sample


def _frozen_model(seed: int, transposed: bool) -> nn.Module:
    """A frozen ``Linear(WIDTH, WIDTH)`` (an EMA, a frozen base model) and a trained one, on
    the GPU; ``transposed``: the frozen weight is a transposed view (no flat view)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(64, 64)).cuda()
    if transposed:
        w = torch.randn(WIDTH, WIDTH, device="cuda").t()
        model[0].weight = nn.Parameter(w)
    model[0].weight.requires_grad_(False)
    return model


def _frozen_written_behind_a_kernel(tmp_path: Path, transposed: bool) -> tuple[bool, list[str]]:
    """Save, write the frozen weight through ``.data`` behind a sleeping kernel, save at once;
    restore. Returns (restored weight == written weight, warnings)."""
    model = _frozen_model(0, transposed)
    opt = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt}
    with (
        Checkpointer(tmp_path / "ck", keep_last=3, incremental=True) as ck,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        ck.save(1, state)
        ck.flush()
        _sleep_then(lambda: model[0].weight.data.add_(1.0))  # the version counter stays
        ck.save(2, state)  # the sample must wait for the write queued before this save
        torch.cuda.synchronize()
        want = model[0].weight.detach().clone()
        ck.flush()
    fresh = _frozen_model(1, transposed)
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.restore({"model": fresh, "optimizer": torch.optim.AdamW(fresh[1].parameters())})
    said = [str(w.message) for w in caught if "version counter" in str(w.message)]
    return torch.equal(fresh[0].weight, want), said


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_frozen_write_queued_before_the_save_is_found_and_stored(tmp_path, transposed):
    same, said = _frozen_written_behind_a_kernel(tmp_path, transposed)
    assert same, "the checkpoint holds the frozen weight before the write queued before save()"
    assert len(said) == 1, said


def test_control_without_the_sample_restores_the_stale_frozen_weight(tmp_path, monkeypatch):
    """Without the comparison the version counter alone decides, and the write through
    ``.data`` is missed: proves the test above can fail."""
    monkeypatch.setattr(unchanged, "_picks", lambda t: torch.zeros(1, dtype=torch.uint8))
    same, said = _frozen_written_behind_a_kernel(tmp_path, transposed=False)
    assert not same and not said, "the write was stored without the sample: the test is blind"


def _syncs_during_a_warm_save(tmp_path: Path, incremental: bool) -> list[str]:
    """Where the training thread synchronized with the GPU during one warm save (a frozen
    contiguous and a frozen transposed weight, a trained layer with AdamW)."""
    model = _frozen_model(0, transposed=True)
    model.append(nn.Linear(WIDTH, 8, bias=False).cuda().requires_grad_(False))
    opt = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    model[1](torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    with Checkpointer(tmp_path / "ck", keep_last=2, incremental=incremental) as ck:
        ck.save(1, state)
        ck.flush()  # host buffers made, the tracker has seen the frozen tensors
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ck.save(2, state)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        ck.flush()
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def test_a_save_does_not_synchronize_the_training_thread(tmp_path):
    """The snapshot's copies are queued on a side stream, ordered on the GPU: ``save`` returns
    without waiting for the kernels queued before it."""
    assert _syncs_during_a_warm_save(tmp_path, incremental=False) == []


def test_an_incremental_save_synchronizes_once_per_device(tmp_path):
    """The frozen tensors' samples come to the host in one copy per device (docs/incremental.md),
    which waits for the queued kernels; nothing else waits. A transposed weight's sample used
    to add three more (its indices copied from the host, and ``unravel_index``'s two)."""
    syncs = _syncs_during_a_warm_save(tmp_path, incremental=True)
    assert len(syncs) == 1, syncs


# ------------------------------------------------ overlapped: another optimizer, a compiled step


def _params_after_save_then_other_step(tmp_path: Path, compiled: bool) -> tuple[int, int]:
    """Overlapped save of 6 x 64 MB weights and their AdamW state; at once, an SGD not in the
    state (as one made after the save) steps the weights; restore. Returns (weights that differ from
    those at the save, weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(6)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = {"model": model, "optimizer": opt}
    other = torch.optim.SGD(model.parameters(), lr=1.0)  # no hook of its own
    step = torch.compile(other.step, backend="eager") if compiled else other.step
    with Checkpointer(tmp_path / "ck", keep_last=2, overlap_snapshot=True) as ck:
        ck.save(1, state)  # hooks the optimizers
        step()  # compiled now, with the hooks there: the step after save 2 runs at once
        ck.flush()  # warm host buffers: the next copies are the fast path
        opt.step()
        torch.cuda.synchronize()
        want = [p.detach().clone() for p in model.parameters()]
        torch.cuda.synchronize()
        ck.save(2, state)
        step()  # must wait (on the GPU) for save 2's deferred copies of the weights
        ck.flush()
    torch.manual_seed(1)
    fresh = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(6)]).cuda()
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.restore({"model": fresh}) == 2
    got = list(fresh.parameters())
    return sum(not torch.equal(g, w) for g, w in zip(got, want, strict=True)), len(want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_optimizer_not_in_the_state_waits_for_the_deferred_copies(tmp_path, compiled):
    differ, total = _params_after_save_then_other_step(tmp_path, compiled)
    assert differ == 0, f"{differ} of {total} weights torn"


def test_control_without_the_global_pre_step_hook_tears(tmp_path, monkeypatch):
    """Only the state's optimizers hooked (as before the global hook): the other optimizer's
    step overwrites the weights while the deferred copies read them. Proves the test above
    can fail."""

    class _NoHook:
        def remove(self) -> None:
            pass

    monkeypatch.setattr(saving, "register_optimizer_step_pre_hook", lambda hook: _NoHook())
    differ, _ = _params_after_save_then_other_step(tmp_path, compiled=False)
    assert differ > 0, "no torn weight without the global hook: nothing was deferred"


# ------------------------------------------------------------------------- a CUDA generator


def test_a_cuda_generator_in_the_state_round_trips(tmp_path):
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    torch.rand(100, device="cuda", generator=g)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"gen": g})
    want = torch.rand(100, device="cuda", generator=g)
    other = torch.Generator(device="cuda")
    other.manual_seed(99)
    with Checkpointer(tmp_path / "ck", read_only=True) as ck:
        assert ck.restore({"gen": other}) == 1
    assert torch.equal(torch.rand(100, device="cuda", generator=other), want)
