"""Phases of the GPU benchmarks, on the CPU (the scripts themselves need CUDA): bench_gpu.py's
DCP pinned-stager phase (benchmarks/dcp_pinned.py), its restore breakdown, and the worker of
bench_gpu_stall.py.

On an H200 with torch 2.11 the stager kept between saves failed every save after the first
(``async_save`` had closed it), so the run reported no figure for DCP's fastest staging. The
phase now takes a new stager per save where a reused one fails after serving a save, and says
so in the results. Here a stager that closes itself after staging stands in for that torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from torch_needs import needs_dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = [needs_dcp, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _run(tmp_path: Path, closes: bool, saves: int = 3) -> tuple[int, dict, dict]:
    import bench_gpu
    import dcp_pinned
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    made: list[Any] = []

    def make(out: dict) -> Any:
        stager = DefaultStager(StagingOptions(False, False, True, False))
        if closes:
            stage = stager.stage

            def stage_then_close(sd: Any, **kw: Any) -> Any:
                staged = stage(sd, **kw)
                stager.close()
                return staged

            stager.stage = stage_then_close  # type: ignore[method-assign]
        made.append(stager)
        return stager

    model, opt = bench_gpu.build(8, device="cpu", width=256)
    out: dict[str, Any] = {}
    figures: dict[str, list[float]] = {}
    stagers = dcp_pinned.PinnedStagers(out, make=make)
    for _ in range(saves):
        dcp_pinned.dcp_pinned(
            str(tmp_path),
            model,
            opt,
            stagers,
            lambda k, v: figures.setdefault(k, []).append(v),
            out,
        )
    stagers.close()
    return len(made), out, figures


def test_a_stager_kept_between_saves_serves_every_save(tmp_path):
    made, out, figures = _run(tmp_path, closes=False)
    assert made == 1 and out == {}
    assert len(figures["dcp_pinned.total"]) == 3


def test_a_stager_closed_by_its_save_is_replaced_for_each_save_and_said(tmp_path):
    made, out, figures = _run(tmp_path, closes=True)
    assert len(figures["dcp_pinned.total"]) == 3  # (the old code: 1, then an error)
    assert made == 3 and "dcp_pinned.error" not in out
    assert "a new pinned stager per save" in out["dcp_pinned.note"][0]


def test_the_restore_breakdown_names_each_tensor_file_and_its_costs(tmp_path):
    """The warm-restore breakdown (1.64x torch.load on the H200: where the time goes), on the
    CPU: each tensor file with its size, whether the library judges it cached, the threads
    that would hash it, and the two costs."""
    import bench_gpu

    from resilient_callbacks import Checkpointer

    model, opt = bench_gpu.build(200, device="cpu", width=1024)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        ck.flush()
        path = str(ck.last_save.path)
    with Checkpointer(tmp_path / "ck") as ck:  # (saves bypass the page cache: this reads it in)
        ck.restore({"model": model, "optimizer": opt})
    state = {"model": model, "optimizer": opt}
    b = bench_gpu.restore_breakdown(path, device="cpu", state=state)
    big = b["files"]["shared.safetensors"]
    assert big["bytes"] > 150e6
    # (cached here, after the restore, where the filesystem answers RWF_NOWAIT reads truly)
    assert big["hash_threads"] == (min(b["cpus"], 8, 3) if big["judged_cached"] else 1)
    assert big["map_and_hash_s"] > 0 and big["copy_to_device_s"] > 0
    assert big["copy_staged_pinned_s"] > 0
    # the profile of one more restore names the library's restore (which functions below it
    # make the top lines depends on the machine's load)
    text = "\n".join(b["profile"])
    assert "restoring.py" in text, text
    assert set(b["torch_split"]) == {"torch_load_s", "load_state_dict_s"}
    md = "\n".join(bench_gpu.breakdown_lines(200, b))
    assert "through one pinned buffer" in md and "cProfile" in md and "torch.load(mmap)" in md


@pytest.mark.slow  # suite time: a CPU rehearsal of a GPU benchmark (9 s)
def test_the_allocation_stall_worker_allocates_ahead_and_times_every_step():
    """benchmarks/bench_gpu_stall.py's worker on the CPU at a toy size (the script needs CUDA):
    the host buffers are allocated within the run, every step is timed, and the summary has a
    row per variant and data path."""
    import bench_gpu_stall as s

    from resilient_callbacks import pinned

    cap = pinned.SLAB_MAX
    # (the neighbour variant, which starts a process, once: without the pinned data path)
    runs = [
        s.worker(v, pin, 8, 4, "cpu", 256)
        for v in s.VARIANTS
        for pin in (0, 1)
        if v != "neighbour" or pin == 0
    ]
    assert cap == pinned.SLAB_MAX  # the 64 MiB variant put it back
    assert [len(r["steps_s"]) for r in runs] == [4] * len(runs)
    assert [r["buffer_bytes"] > 0 for r in runs] == [False, False] + [True] * (len(runs) - 2)
    assert runs[-1]["variant"] == "neighbour" and runs[-1]["neighbour_pin_s"] > 0
    rows = s.summarize(runs)
    assert [(r["variant"], r["pin_mb"]) for r in rows] == [
        (v, pin) for pin in (0, 1) for v in s.VARIANTS if v != "neighbour" or pin == 0
    ]


def test_the_allocation_stall_report_names_a_variant_whose_process_failed():
    """A variant whose process failed (a torch that does not know an allocator option) is named
    in the report with its error, not dropped silently."""
    import bench_gpu_stall as s

    run = s.worker("none", 0, 8, 2, "cpu", 256)
    report = {
        "gpu": "cpu", "torch": "x", "date": "d", "library": "l", "mb": 8, "steps": 2,
        "rounds": 1, "rows": s.summarize([run]),
        "failed": [{"variant": "ahead-hostreg", "pin_mb": 0, "error": ["RuntimeError: bad"]}],
    }  # fmt: skip
    md = s.markdown(report)
    assert "| none | 0 |" in md
    assert "ahead-hostreg (pinned data path 0 MB) failed: ['RuntimeError: bad']" in md


def test_the_warm_restore_rounds_alternate_which_side_goes_first(tmp_path):
    """Neither restore always follows the other's reads: the order alternates each round, the
    first round of each is discarded, and each side is timed once per counted round."""
    import bench_gpu

    from resilient_callbacks import Checkpointer

    model, opt = bench_gpu.build(2, device="cpu", width=64)
    with Checkpointer(tmp_path / "default") as ck:
        ck.save(1, {"model": model, "optimizer": opt})
        ck.flush()
    timed: list[str] = []
    restored = bench_gpu.restore_rounds(
        str(tmp_path), model, opt, 4, lambda name, _s: timed.append(name), device="cpu"
    )
    assert restored.endswith("step_000000001")
    ours, torch_ = "restore.ours", "restore.torch_mmap"
    assert timed == [torch_, ours, ours, torch_, torch_, ours, ours, torch_]
    assert not (tmp_path / "torch.pt").exists()
