"""GPU snapshots are consistent cuts; exact resume on CUDA (``pytest -m gpu``; CUDA needed).

Skipped where ``torch.cuda.is_available()`` is False, and deselected by default (the ``gpu``
marker): CI has no GPU. Run on a GPU machine with ``python -m pytest -m gpu tests/test_gpu.py``.

- A save followed *at once* by the optimizer step and in-place writes (nothing to hide the copy)
  must commit the state of the saved step: 0 differing tensors, in the default and the overlapped
  mode, with warm buffers and >= 1 GB of state so the device-to-host copy takes tens of ms. The
  controls skip the GPU-side ordering (default mode) or the pre-step wait (overlapped mode) and
  must see torn tensors, so the tests can fail.
- A saved tensor freed right after the save is not reused before the copy has read it (its
  control skips ``record_stream`` and must read the memory's next owner).
- SIGKILL and resume on CUDA is bit-exact (deterministic algorithms, CUDA RNG restored): the
  plain loop; Lightning plain, under FSDP1, FSDP2 and DeepSpeed ZeRO 2/3; Transformers plain
  and under FSDP1/FSDP2. Restore lands in CUDA tensors; bf16 and AMP state round-trip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer, mapped, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(900),
]

HERE = Path(__file__).parent
LAYERS, WIDTH = 6, 4096  # 6 x (64 MB weight + 2 x 64 MB AdamW moments) ~ 1.2 GB of state


def _big(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # materialize the optimizer state
    return model, opt


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"opt.{i}.{k}"] = v
    return out


def _torn_after_save_then_step(tmp_path: Path, overlap: bool) -> tuple[int, int]:
    """Save, then at once step and write in place; restore; count tensors that differ from the
    state at save time. Returns (differing, total)."""
    model, opt = _big()
    state = {"model": model, "optimizer": opt}
    with Checkpointer(tmp_path / "ck", keep_last=2, overlap_snapshot=overlap) as ck:
        ck.save(1, state)
        ck.flush()  # host buffers allocated: the next save is the warm, fast path
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        torch.cuda.synchronize()
        expected = {k: v.detach().clone() for k, v in _flat(model, opt).items()}
        torch.cuda.synchronize()
        ck.save(2, state)
        # no compute in between: the next kernels would overwrite what the copy reads
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        ck.flush()
    fresh, fresh_opt = _big(seed=1)
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore({"model": fresh, "optimizer": fresh_opt}) == 2
    got = _flat(fresh, fresh_opt)
    assert got.keys() == expected.keys()
    differ = sum(not torch.equal(got[k], expected[k]) for k in expected)
    return differ, len(expected)


@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlapped"])
def test_save_then_immediate_step_commits_the_saved_state(tmp_path, overlap):
    differ, total = _torn_after_save_then_step(tmp_path, overlap)
    assert total == 3 * LAYERS
    assert differ == 0, f"{differ} of {total} tensors torn"


def test_control_without_gpu_ordering_tears(tmp_path, monkeypatch):
    """The same sequence with the current stream *not* ordered after the copy (the bug this
    library had): the checkpoint holds later values. Proves the test above can fail."""
    monkeypatch.setattr(snapshot, "_order_after", lambda stream, event: None)
    differ, _total = _torn_after_save_then_step(tmp_path, overlap=False)
    assert differ > 0, "no torn tensor without the ordering: the test cannot detect tearing"


def test_control_overlapped_without_the_pre_step_wait_tears(tmp_path, monkeypatch):
    """Overlapped mode with the optimizer's pre-step wait removed: the deferred copies are not
    waited for, and the checkpoint holds later values. Proves that the copies are deferred and
    that the overlapped case above can fail (with deferral silently off it would still pass)."""
    monkeypatch.setattr(snapshot.Snapshot, "wait_device", lambda self: None)
    differ, _total = _torn_after_save_then_step(tmp_path, overlap=True)
    assert differ > 0, "no torn tensor without the pre-step wait: nothing was deferred"


def _freed_right_after_the_save(tmp_path: Path) -> torch.Tensor:
    """Save a 1 GB parameter that the optimizer steps (so its copy is deferred), then at once
    replace it everywhere, so it is freed while the copy may still read it, and fill new
    allocations; return the restored parameter (all 3.0 when nothing overwrote the freed one)."""
    torch.manual_seed(0)
    n = 256 * 1024 * 1024  # 1 GB of float32
    with Checkpointer(tmp_path / "ck", keep_last=2, overlap_snapshot=True) as ck:
        lin = torch.nn.Linear(1, 1).cuda()
        lin.weight = torch.nn.Parameter(torch.zeros(n, 1, device="cuda"))
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
        state = {"model": lin, "optimizer": opt}
        ck.save(1, state)
        ck.flush()
        lin.weight.data.fill_(3.0)
        ck.save(2, state)
        # replace the parameter in the module and the optimizer: the saved one is freed now,
        # while its deferred copy may still run
        lin.weight = torch.nn.Parameter(torch.full((n, 1), 9.0, device="cuda"))
        opt.param_groups[0]["params"] = [lin.weight, lin.bias]
        junk = [torch.full((n, 1), 7.0, device="cuda") for _ in range(2)]
        ck.flush()
        del junk
    restored = torch.nn.Linear(1, 1).cuda()
    restored.weight = torch.nn.Parameter(torch.empty(n, 1, device="cuda"))
    fresh = {"model": restored, "optimizer": torch.optim.SGD(restored.parameters(), lr=0.0)}
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(fresh) == 2
    return restored.weight


def test_saved_tensor_freed_right_after_the_save_is_not_reused_before_the_copy(tmp_path):
    assert bool((_freed_right_after_the_save(tmp_path) == 3.0).all())


def test_control_without_record_stream_reads_reused_memory(tmp_path, monkeypatch):
    """The same without marking the saved tensors used by the copy stream: the freed block goes
    to the next allocation, whose fill the copy reads. Proves the test above can fail."""
    monkeypatch.setattr(snapshot, "_mark_used_by", lambda t, stream: None)
    weight = _freed_right_after_the_save(tmp_path)
    assert not bool((weight == 3.0).all()), "no reuse without record_stream: the test is blind"


def test_restore_lands_in_cuda_tensors_with_bf16_and_amp_state(tmp_path):
    """fp32 master weights trained under fp16 autocast with a GradScaler (AMP), a bf16 module
    beside them (e.g. an EMA copy) and loose fp16 tensors all restore into CUDA tensors of their
    dtypes, bit-exact, with the scaler's state, and nothing of it left viewing the checkpoint's
    files (on an H200, AdamW's `step` did: the restore warned)."""

    def build(seed: int, init_scale: float = 2.0**16):
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 64).cuda()
        ema = torch.nn.Linear(64, 64).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, ema, opt, torch.amp.GradScaler("cuda", init_scale=init_scale)

    model, ema, opt, scaler = build(0)
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    extra = {"t": torch.arange(10, device="cuda", dtype=torch.float16)}
    state = {"model": model, "ema": ema, "optimizer": opt, "scaler": scaler, "extra": extra}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state)
    want = {
        **{f"m.{k}": v.clone() for k, v in model.state_dict().items()},
        **{f"e.{k}": v.clone() for k, v in ema.state_dict().items()},
    }
    want_scaler = scaler.state_dict()

    model2, ema2, opt2, scaler2 = build(1, init_scale=4.0)
    extra2 = {"t": torch.zeros(10, device="cuda", dtype=torch.float16)}
    state2 = {"model": model2, "ema": ema2, "optimizer": opt2, "scaler": scaler2, "extra": extra2}
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore(state2) == 1
        # AdamW keeps `step` on the CPU as given: a copy of its own, not a view of the file
        assert mapped.still_mapped(ck.last_restore.path) == []
    got = {
        **{f"m.{k}": v for k, v in model2.state_dict().items()},
        **{f"e.{k}": v for k, v in ema2.state_dict().items()},
    }
    for k, v in got.items():
        assert v.device.type == "cuda" and v.dtype == want[k].dtype, k
        assert torch.equal(v, want[k]), k
    assert ema2.weight.dtype == torch.bfloat16
    assert len(opt2.state) == 2
    for s in opt2.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.device.type == "cuda"
    assert scaler2.state_dict() == want_scaler
    assert extra2["t"].device.type == "cuda" and torch.equal(extra2["t"], extra["t"])


# ---------------------------------------------------------------- SIGKILL and resume on CUDA


def _kill_and_resume(tmp_path: Path, cmd: list[str], jsonl: Path, kill_at: int) -> None:
    import test_exact_resume as ter

    last, _ = ter._run_and_kill(cmd, jsonl, kill_at)
    stderr = ter._run_to_completion(cmd)
    restored = ter._restored_step(stderr)
    assert 0 < restored <= last


def _losses(path: Path) -> dict[int, str]:
    import test_exact_resume as ter

    return ter._last_loss_per_step(ter._read_records(path))


def _same_params(a: Path, b: Path) -> None:
    import test_exact_resume as ter

    ter._assert_same_params(a, b)


@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlapped"])
def test_plain_loop_sigkill_resume_on_cuda_is_bit_exact(tmp_path, overlap):
    import test_exact_resume as ter

    def cmd(workdir: Path, sleep: float) -> list[str]:
        c = [*ter._cmd(workdir, "resumable", sleep=sleep), "--device", "cuda"]
        return c + (["--overlap-snapshot"] if overlap else [])

    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    ter._run_to_completion(cmd(ref, 0.0))
    _kill_and_resume(run, cmd(run, ter.SLEEP), run / "losses.jsonl", 23)
    assert _losses(run / "losses.jsonl") == _losses(ref / "losses.jsonl")
    _same_params(ref / "params.safetensors", run / "params.safetensors")


@pytest.mark.parametrize(
    "framework",
    [
        "lightning",
        "lightning-fsdp1",
        "lightning-fsdp2",
        "transformers",
        "transformers-fsdp1",
        "transformers-fsdp2",
        "lightning-deepspeed2",
        "lightning-deepspeed3",
    ],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlapped"])
def test_framework_sigkill_resume_on_cuda_is_bit_exact(tmp_path, framework, overlap):
    framework, _, variant = framework.partition("-")
    pytest.importorskip(framework)
    if variant.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    kind = variant.rstrip("0123456789")  # "fsdp2" -> --fsdp 2, "deepspeed3" -> --deepspeed 3
    number = variant[len(kind) :]

    def cmd(workdir: Path, sleep: float) -> list[str]:
        c = [
            sys.executable,
            str(HERE / "gpu_frameworks.py"),
            framework,
            str(workdir / "ckpt"),
            "--out-jsonl",
            str(workdir / "losses.jsonl"),
            "--out-params",
            str(workdir / "params.safetensors"),
            "--sleep",
            str(sleep),
        ]
        c += [f"--{kind}", number] if variant else []
        return c + (["--overlap"] if overlap else [])

    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    p = subprocess.run(cmd(ref, 0.0), capture_output=True, text=True, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    _kill_and_resume(run, cmd(run, 0.05), run / "losses.jsonl", 13)
    assert _losses(run / "losses.jsonl") == _losses(ref / "losses.jsonl")
    _same_params(ref / "params.safetensors", run / "params.safetensors")
