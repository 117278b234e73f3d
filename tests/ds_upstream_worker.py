"""One rank of DeepSpeed's own checkpoint tests (``tests/upstream/deepspeed``, vendored) with
the save and the load going through resilient_callbacks.deepspeed.

Run by ``test_upstream_deepspeed.py`` through ``spawn_ranks`` (which sets RANK, WORLD_SIZE,
MASTER_ADDR/PORT). It does what DeepSpeed's ``DistributedExec._dist_run`` does for one rank
(``deepspeed.init_distributed`` over gloo, a barrier), replaces ``DeepSpeedEngine``'s
``save_checkpoint`` and ``load_checkpoint`` with :func:`save_ours` and :func:`load_ours`, and
calls the upstream test method's body, unchanged: it trains an engine, "saves", builds a fresh
engine, "loads" and compares model, fp32 master, optimizer, scheduler and engine counters.

    python ds_upstream_worker.py CASE STAGE TMPDIR

CASE: ``load_optimizer_state`` | ``not_load_optimizer_state`` | ``lr_scheduler`` |
``no_lr_scheduler``. Prints ``UPSTREAM-OK <case> <stage> files=<n>`` on success.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "upstream" / "deepspeed"))  # upstream's `unit` package

from ds_noshm import skip_shm_op  # noqa: E402

skip_shm_op()

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

import resilient_callbacks.deepspeed as rcds  # noqa: E402

SAVED: dict[str, int] = {}  # dirpath -> the step our save committed


def save_ours(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
    """``engine.save_checkpoint`` as our checkpoint: attach, save this step, flush, detach."""
    assert not client_state, "the upstream tests pass no client_state"
    handle = rcds.attach(self, dirpath=save_dir, restore=False)
    assert handle.save(final=True), "nothing was saved"
    handle.close()
    SAVED[str(save_dir)] = int(self.global_steps)
    return True


def _refuse(*args, **kwargs):
    raise AssertionError("the restore unpickled something")


def load_ours(self, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` as our restore (every state: the upstream flags
    ``load_optimizer_states``/``load_lr_scheduler_states``/``load_module_only`` only narrow
    what upstream then compares). torch.load and pickle are made to raise meanwhile."""
    if os.environ.get("DS_UPSTREAM_NO_RESTORE") == "1":  # the control: upstream must fail
        SAVED[str(load_dir)] = 0
        return load_dir, {}
    with (
        mock.patch.object(torch, "load", _refuse),
        mock.patch.object(pickle, "load", _refuse),
        mock.patch.object(pickle, "loads", _refuse),
    ):
        handle = rcds.attach(self, dirpath=load_dir)
    handle.close()
    assert handle.restored_step == SAVED[str(load_dir)], (handle.restored_step, SAVED)
    return load_dir, {}


def torch_adam(initialize):
    """``deepspeed.initialize`` with ``"torch_adam": true`` in the config's Adam params: on the
    CPU, DeepSpeed's FusedAdam is a C++ op compiled at first use (minutes); torch's Adam is the
    same algorithm. The one change to upstream's configs."""

    def init(*args, config=None, **kwargs):
        opt = (config or {}).get("optimizer")
        if opt is not None and opt.get("type") == "Adam":
            opt.setdefault("params", {})["torch_adam"] = True
        return initialize(*args, config=config, **kwargs)

    return init


def run_case(case: str, stage: int, tmpdir: str) -> None:
    if case in ("load_optimizer_state", "not_load_optimizer_state"):
        from unit.checkpoint.test_zero_optimizer import TestZeROCheckpoint

        test = getattr(TestZeROCheckpoint(), f"test_{case}")
        test(tmpdir, stage, False, "Adam")  # (zero_stage, use_cpu_offload, adam_optimizer)
    else:
        from unit.checkpoint.test_lr_scheduler import TestLRSchedulerCheckpoint

        name = {"lr_scheduler": "test_checkpoint_lr_scheduler"}.get(case, f"test_checkpoint_{case}")
        getattr(TestLRSchedulerCheckpoint(), name)(tmpdir, stage, False)


def main() -> None:
    case, stage, tmpdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    dist.barrier()
    deepspeed.initialize = torch_adam(deepspeed.initialize)
    # upstream's compare_deepspeed_states reads engine.sparse_tensor_module_names, which
    # DeepSpeed 0.19.8's engine no longer has (its own save/load fail there the same way)
    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()
    DeepSpeedEngine.save_checkpoint = save_ours
    DeepSpeedEngine.load_checkpoint = load_ours
    run_case(case, stage, tmpdir)
    folder = Path(tmpdir) / "saved_checkpoint"
    files = [p for p in folder.rglob("*") if p.is_file()]
    pt = [p for p in files if p.suffix in (".pt", ".pkl")]
    assert files and not pt, f"DeepSpeed's files or no files: {pt or 'none'}"
    dist.barrier()
    print(f"UPSTREAM-OK {case} {stage} files={len(files)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
