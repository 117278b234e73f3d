"""Every save path is a consistent cut on a GPU, in both directions (``pytest -m gpu``).

``tests/test_gpu.py`` shows that a plain ``Checkpointer`` save followed at once by in-place
writes commits the saved state. This module covers what it does not:

- **Sharded state** (``Sharded`` over FSDP2, a ``FilePart``) next to a CUDA tensor of the core
  state: a save makes one snapshot for the part and one for the rest; in overlapped mode the
  part's copies are deferred and the core's are not (two side streams per device).
- **The DCP drop-in**: ``dcp.async_save`` with ``ResilientStorageWriter`` as its stager, with the
  copy made before ``async_save`` returns and with ``async_staging=True`` (the caller waits for
  ``staging_completion``, as documented).
- **Writes queued before the save.** The optimizer step and in-place writes are launched behind
  ``torch.cuda._sleep`` and have not run when ``save`` is called: the copies must read their
  result (the side stream waits for the training stream), not the values before them.

All cases run in one worker process (1 rank, NCCL on the GPU; 300 MB of state: the copies take
milliseconds, the writes launched after the save well under one): a warm-up save; an optimizer step
and in-place writes queued behind a sleeping kernel; the save at once; the state at that point
cloned on the training stream (in order, without a synchronization); the next step and writes at
once; then a restore into a fresh model compared with the clone. The controls remove one
ordering each (the training stream's wait for the copies, the side stream's wait for the
training stream, the optimizer's pre-step wait) and must see differing tensors, so the cases can
fail. A default test runs the cases on the CPU (gloo, a small model, about 3 s): the harness
itself, and the CPU's deferred-copy thread.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import spawn_ranks
from torch_needs import needs_dcp

CASES = (
    "plain-default",
    "plain-overlapped",
    "sharded-default",
    "sharded-overlapped",
    "dcp-staged",
    "dcp-async",
)
# case: the ordering its control removes
CONTROLS = {
    "plain-default": "no-side-wait",
    "sharded-default": "no-order",
    "sharded-overlapped": "no-pre-step-wait",
    "dcp-async": "no-side-wait",
}
TENSORS = 6 + 2 * 6 + 1  # 6 weights, their 2 AdamW moments, the EMA tensor


# ----------------------------------------------------------------------------- the worker


def _build(seed: int, device: torch.device, sharded: bool, width: int) -> tuple[Any, Any, Any]:
    """6 bias-free ``Linear(width, width)`` layers (FSDP2 for ``sharded``), AdamW with its state
    materialized, and a separate CUDA tensor no optimizer steps (an EMA, a running statistic)."""
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(6)]).to(device)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _writes(model, opt, None, 1.0)
    ema = torch.full((width * width,), float(seed), device=device)
    return model, opt, ema


def _writes(model: Any, opt: Any, ema: Any, value: float) -> None:
    """An optimizer step and in-place writes to every saved tensor, all launched at once."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)
        if ema is not None:
            ema.add_(value)


def _locals(model: Any, opt: Any, ema: Any) -> dict[str, torch.Tensor]:
    """The rank's own tensors (a DTensor's local shard; on 1 rank the whole tensor)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(model.parameters())
    out = {f"model.{i}": local(p.detach()) for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"opt.{i}.{k}"] = local(v)
    out["ema"] = ema
    return out


def _delay(device: torch.device) -> None:
    """Keep the training stream busy (~0.1 s) so the kernels launched next have not run when
    ``save`` is called."""
    if device.type == "cuda":
        torch.cuda._sleep(200_000_000)


@contextlib.contextmanager
def _control(name: str | None) -> Iterator[None]:
    """Remove one ordering for the duration (``None``: none)."""
    from resilient_callbacks import snapshot

    patches: dict[str, tuple[Any, str, Any]] = {
        "no-order": (snapshot, "_order_after", lambda stream, event: None),
        "no-side-wait": (torch.cuda.Stream, "wait_stream", lambda self, other: None),
        "no-pre-step-wait": (snapshot.Snapshot, "wait_device", lambda self: None),
    }
    if name is None:
        yield
        return
    owner, attr, fake = patches[name]
    real = getattr(owner, attr)
    setattr(owner, attr, fake)
    try:
        yield
    finally:
        setattr(owner, attr, real)


def _with_checkpointer(
    case: str, control: str | None, root: Path, device: torch.device, width: int
) -> dict[str, Any]:
    from resilient_callbacks import Checkpointer

    kind, mode = case.split("-")
    sharded = kind == "sharded"

    def state_of(model: Any, opt: Any, ema: Any) -> dict[str, Any]:
        if sharded:
            from resilient_callbacks.dcp import Sharded

            return {"train": Sharded(model, opt), "ema": ema}
        return {"model": model, "optimizer": opt, "ema": ema}

    model, opt, ema = _build(0, device, sharded, width)
    state = state_of(model, opt, ema)
    overlap = mode == "overlapped"
    with Checkpointer(root, keep_last=2, overlap_snapshot=overlap, preemption=False) as ck:
        ck.save(1, state)
        ck.flush()  # host buffers allocated: the next save is the warm, fast path
        _delay(device)
        _writes(model, opt, ema, 0.5)  # queued behind the sleep
        with _control(control):
            ck.save(2, state)
            expected = {k: v.clone() for k, v in _locals(model, opt, ema).items()}
            _writes(model, opt, ema, 1.0)
        ck.flush()
    fresh = _build(1, device, sharded, width)
    with Checkpointer(root, preemption=False) as ck:
        step = ck.restore(state_of(*fresh))
    return _compare(step, expected, _locals(*fresh))


def _with_dcp(
    case: str, control: str | None, root: Path, device: torch.device, width: int
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

    group = dist.new_group(backend="gloo")
    model, opt, ema = _build(0, device, True, width)
    msd, osd = get_state_dict(model, opt)  # views of the live tensors
    sd = {"model": msd, "optim": osd, "ema": ema}
    with ResilientStorageWriter(root, keep_last=2, async_staging=case == "dcp-async") as writer:

        def save(step: int) -> Any:
            return dcp.async_save(
                sd, storage_writer=writer, checkpoint_id=step, process_group=group
            )

        def staged(response: Any) -> None:
            if hasattr(response, "staging_completion"):
                response.staging_completion.result()  # the caller's duty, as documented

        def done(response: Any) -> None:
            getattr(response, "upload_completion", response).result()

        first = save(1)
        staged(first)
        done(first)
        _delay(device)
        _writes(model, opt, ema, 0.5)
        with _control(control):
            second = save(2)
            staged(second)
            expected = {k: v.clone() for k, v in _locals(model, opt, ema).items()}
            _writes(model, opt, ema, 1.0)
        done(second)
    model2, opt2, ema2 = _build(1, device, True, width)
    msd2, osd2 = get_state_dict(model2, opt2)
    into = {"model": msd2, "optim": osd2, "ema": ema2}
    reader = ResilientStorageReader(root)
    dcp.load(into, storage_reader=reader, process_group=group)
    set_state_dict(model2, opt2, model_state_dict=into["model"], optim_state_dict=into["optim"])
    return _compare(reader.loaded_step, expected, _locals(model2, opt2, ema2))


def _compare(
    step: Any, expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> dict[str, Any]:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    return {"step": step, "total": len(expected), "differ": differ}


def worker(out: str) -> None:
    """Every case and control, one after another (``RC_DEVICE``: cpu or cuda; ``RC_TORN_WIDTH``:
    the layers' width: 2048 on a GPU, 300 MB of state). Results as JSON in ``out``."""
    import torch.distributed as dist

    from dcp_helpers import _device, backend

    dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=120))
    torch.use_deterministic_algorithms(False)  # (backend() turns it on for CUDA; no matmuls here)
    device = _device()
    width = int(os.environ.get("RC_TORN_WIDTH", "2048"))
    runs = [(c, None) for c in CASES]
    if os.environ.get("RC_TORN_CONTROLS", "1") == "1":
        runs += list(CONTROLS.items())
    results: dict[str, Any] = {}
    for case, control in runs:
        name = case if control is None else f"{case}:{control}"
        root = Path(out).with_name(name.replace(":", "_"))
        run = _with_dcp if case.startswith("dcp") else _with_checkpointer
        try:
            results[name] = run(case, control, root, device, width)
        except BaseException as e:  # (DCP's CheckpointException is one) the other cases go on
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(name, results[name], flush=True)
    Path(out).write_text(json.dumps(results))
    spawn_ranks.leave_group()


# ----------------------------------------------------------------------------- the tests


def _run_all(tmp_path: Path, device: str, width: int, controls: bool) -> dict[str, Any]:
    out = tmp_path / "results.json"
    env = {"RC_DEVICE": device, "RC_TORN_WIDTH": str(width), "RC_TORN_CONTROLS": str(int(controls))}
    spawn_ranks.run(
        [sys.executable, __file__, str(out)], 1, tmp_path, "torn", env=env, deadline=600.0
    )
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def on_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case and control, in one worker on this machine's GPU (one CUDA and NCCL start)."""
    return _run_all(tmp_path_factory.mktemp("torn"), "cuda", 2048, controls=True)


def _on_gpu(test: Any) -> Any:
    """The marks of a test that needs this machine's GPU (and DCP, for the sharded cases)."""
    for mark in (
        needs_dcp,
        pytest.mark.timeout(900),
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        pytest.mark.distributed,
        pytest.mark.gpu,
    ):
        test = mark(test)
    return test


def _consistent(result: dict[str, Any]) -> None:
    assert "error" not in result, result["error"]
    assert result["step"] == 2
    assert result["total"] == TENSORS
    assert result["differ"] == [], f"{len(result['differ'])} of {TENSORS} torn: {result['differ']}"


@_on_gpu
@pytest.mark.parametrize("case", CASES)
def test_save_between_queued_and_following_writes_is_a_consistent_cut(case, on_gpu):
    _consistent(on_gpu[case])


@_on_gpu
@pytest.mark.parametrize("case", sorted(CONTROLS))
def test_control_without_one_ordering_differs(case, on_gpu):
    """With the ordering ``CONTROLS[case]`` removed the checkpoint holds other values than the
    state at the save: the case above can fail."""
    result = on_gpu[f"{case}:{CONTROLS[case]}"]
    assert "error" not in result, result["error"]
    assert result["step"] == 2
    assert result["differ"], f"{case} without {CONTROLS[case]}: nothing differs, the test is blind"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@needs_dcp
def test_every_case_is_a_consistent_cut_on_the_cpu(tmp_path):
    """The same cases on the CPU (gloo, 64-wide layers): the harness restores step 2 and finds
    every tensor as it was at the save (in overlapped mode the deferred copies run in a helper
    thread that the optimizer's pre-step hook joins)."""
    results = _run_all(tmp_path, "cpu", 64, controls=False)
    assert sorted(results) == sorted(CASES)
    for case in CASES:
        _consistent(results[case])


if __name__ == "__main__":
    worker(sys.argv[1])
