"""The Hugging Face Trainer adapter under the Trainer's FSDP2 (``fsdp=True``; accelerate's
``fully_shard``) on 2 CPU processes (torchrun, gloo): every rank saves its own shards of the
model and the optimizer state; a run killed with SIGKILL mid-epoch and re-run gives both ranks
the same per-step losses, final weights and log history as an uninterrupted run, bit for bit;
and ``export`` lays the shards together into a ``from_pretrained`` directory.

accelerate turns FSDP on only where it finds an accelerator; tests/accelerate_fsdp_cpu.py makes
that one decision for CPU processes, the rest is accelerate's and the Trainer's own FSDP code.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from resilient_callbacks.transformers import export_pretrained
from test_transformers import _cmd, _committed, _restored
from test_transformers_ddp import TORCHRUN, _killed_after, _run, kill_and_rerun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.mark.slow  # suite time budget (FSDP2 kill/resume runs by default in test_dcp_sharded.py)
def test_fsdp2_sigkill_mid_epoch_then_rerun_is_bit_exact_and_exports(tmp_path):
    work = kill_and_rerun(tmp_path, extra=("--fsdp",))
    entries = _committed(work / "out" / "ckpt")
    assert entries
    for e in entries:
        paths = {f.path for f in e.manifest.files}
        # each rank wrote its own shards of the model and of the optimizer state
        assert {
            "parts/sharded/rank_00000.safetensors",
            "parts/sharded/rank_00001.safetensors",
        } <= paths
        described = e.manifest.extra["parts"]["sharded"]
        assert described["world_size"] == 2 and described["optim"] is True
        wte = described["tensors"]["model/transformer.wte.weight"]
        assert [c[0] for c in wte["chunks"]] == [0, 1], wte  # a piece per rank, not gathered

    # the last checkpoint holds the final weights; export names the model's own class (not
    # FSDP2's FSDPGPT2LMHeadModel) and from_pretrained loads them
    out = export_pretrained(work / "out" / "ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    final = load_file(str(work / "final.safetensors.rank0"))
    got = model.state_dict()
    assert sorted(got) == sorted(final)
    for k, v in final.items():
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_fsdp2_overlapped_snapshot_sigkill_then_rerun_is_bit_exact(tmp_path):
    """The same with ``overlap_snapshot=True``: the shards are copied while the next
    forward/backward runs, and the optimizer's step (the torch optimizer inside accelerate's
    wrapper) waits for the copy."""
    kill_and_rerun(tmp_path, extra=("--fsdp", "--overlap"))


@pytest.mark.slow
def test_fsdp2_frozen_base_incremental_sigkill_then_rerun_is_bit_exact(tmp_path):
    """An adapter-style fine-tune (only the last block's MLP trained) with ``incremental=True``:
    each rank's shards of the frozen base are blobs written by the first save only; a kill and
    re-run is bit-exact, and export lays the blobs' shards together like any others."""
    work = kill_and_rerun(tmp_path, extra=("--fsdp", "--frozen-base"))
    entries = _committed(work / "out" / "ckpt")
    first, newest = entries[0].manifest, entries[-1].manifest
    assert {b.rank for b in newest.blobs} == {0, 1}
    shared = {b.path for b in first.blobs} & {b.path for b in newest.blobs}
    kept_bytes = sum(b.size for b in newest.blobs if b.path in shared)
    # the frozen weights (those whose shards are blobs) are the very blobs the first save
    # wrote; the trained ones are new
    from hf_train import build_model

    frozen = [p for p in build_model(frozen_base=True).parameters() if not p.requires_grad]
    big = sum(p.numel() * 4 for p in frozen if p.numel() * 4 // 2 >= 16 << 10)
    assert big <= kept_bytes < big + (64 << 10), (big, kept_bytes)
    assert {b.path for b in newest.blobs} - shared
    out = export_pretrained(work / "out" / "ckpt", tmp_path / "hf")
    final = load_file(str(work / "final.safetensors.rank0"))
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for k, v in final.items():
        assert torch.equal(got[k], v), k


@pytest.mark.benchmark
def test_bench_transformers_fsdp_quick(tmp_path):
    """benchmarks/bench_transformers_fsdp.py --quick runs end to end (every mode a 2-rank
    torchrun) and reports every mode. Deselected by default (``-m benchmark``); the full run
    takes about 9 minutes on 2 cores."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_transformers import _env

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transformers_fsdp.py"
    cmd = [sys.executable, str(script), "--quick", "--out", str(tmp_path), "--dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "bench_transformers_fsdp.json").read_text())
    assert set(report["summary"]) == {"none", "hold", "trainer", "ours"}
    saves = report["meta"]["steps"] // report["meta"]["every"]
    for mode in ("trainer", "ours"):
        assert report["summary"][mode]["saves_per_run"] == saves
        assert report["summary"][mode]["blocking_per_save_s"] > 0
    assert report["summary"]["hold"]["saves_per_run"] == 0
    md = (tmp_path / "bench_transformers_fsdp.md").read_text()
    assert md.startswith("# Trainer under FSDP2")


@pytest.mark.slow
def test_fsdp2_killed_on_two_processes_resumes_on_one_with_the_same_global_batch(tmp_path):
    """Killed on 2 processes (batch 4, accumulation 3), resumed on 1 (torchrun: the Trainer's
    FSDP needs a process group) with accumulation 6: the 2 ranks' shards reshard onto 1, the
    layout change is said, and the run trains to the end."""
    import json

    from spawn_ranks import free_port

    work = tmp_path / "run"
    _, newest = _killed_after(work, 5, extra=("--fsdp",))
    one = [*TORCHRUN[:-1], "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    err = _run([*one, *_cmd(work)[1:], "--ddp", "--fsdp", "--accumulation", "6"])
    assert _restored(err) == newest > 0
    assert "on 1 process(es) x 4 x 6 accumulated: the same global batch of 24" in err, err[-3000:]
    final = json.loads((work / "final.safetensors.rank0.json").read_text())
    assert final["global_step"] == 14
