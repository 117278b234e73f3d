"""Worker script of the drop-in DCP writer/reader tests: one rank (FSDP2 on gloo, CPU; FSDP1 with
``RC_SHARDING=fsdp1``, see ``dcp_helpers.build``).

``python dcp_storage_worker.py MODE ROOT OUT [REMOTE_URL]``:

- ``save``: 3 training steps, ``dcp.save`` after each through one ``ResilientStorageWriter``
  (``keep_last=2``, the remote tier if given); the full tensors of the last save go to
  ``OUT.saved.safetensors``.
- ``async``: the same with ``dcp.async_save`` (each future waited for before the next).
- ``load``: a fresh model; ``dcp.load`` through ``ResilientStorageReader`` with ``pickle`` and
  ``torch.load`` patched to raise; the full tensors go to ``OUT.loaded.safetensors`` and the
  chosen step and the extra objects to ``OUT.rank<r>.json``.
- ``crash``: ``dcp.save`` whose ``finish`` (rank 0) SIGKILLs the process: every rank's files
  are written, the manifest is not.
- ``groups``: process groups and ``no_dist`` (see :func:`groups`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import spawn_ranks
from dcp_helpers import build, full_tensors, train_step
from dcp_train import allow_unpickling, forbid_unpickling
from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

# DCP cannot load a nested dict of plain values beside ShardedTensors (FSDP1 without a device
# mesh): "Missing key in checkpoint state_dict: extra", with its own FileSystemWriter/Reader too.
EXTRA = os.environ.get("RC_SHARDING", "fsdp2") != "fsdp1"


def main() -> None:
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    remote = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model, opt = build()
    torch.manual_seed(7 + rank)
    res: dict[str, object] = {"rank": rank}
    if mode in ("save", "async", "crash"):
        options = json.loads(os.environ["RC_REMOTE_OPTIONS"]) if remote else None
        with ResilientStorageWriter(
            root, keep_last=2, remote=remote, remote_options=options
        ) as writer:
            for step in (1, 2, 3):
                train_step(model, opt)
                msd, osd = get_state_dict(model, opt)
                sd = {"model": msd, "optim": osd}
                if EXTRA:
                    sd["extra"] = {"epoch": step, "tag": (1, "a")}
                writer.step = step
                if mode == "crash" and step == 3 and rank == 0:
                    writer.finish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
                if mode == "async":
                    dcp.async_save(sd, storage_writer=writer).result()
                else:
                    dcp.save(sd, storage_writer=writer)
        full = full_tensors(model, opt)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, f"{out}.saved.safetensors")
    elif mode == "load":
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        if EXTRA:
            sd["extra"] = {"epoch": 0, "tag": None}
        reader = ResilientStorageReader(root)
        forbidden = forbid_unpickling()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(sd, storage_reader=reader)
        allow_unpickling(forbidden)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        full = full_tensors(model, opt)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, f"{out}.loaded.safetensors")
        res.update(
            step=reader.loaded_step,
            extra=sd.get("extra"),
            tag_is_tuple=isinstance(sd.get("extra", {}).get("tag"), tuple),
            warnings=[str(w.message) for w in caught],
        )
        train_step(model, opt)  # and training goes on
    elif mode == "groups":
        res.update(groups(root, rank))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(res, f)
    spawn_ranks.leave_group()


def groups(root: str, rank: int) -> dict[str, object]:
    """Each rank in a group of its own (2 ranks): ``dcp.save`` and ``dcp.load`` with
    ``process_group=``, each group in its own directory, the reader given the group; then rank
    0 alone loads with ``no_dist=True`` (rank 1 waits); then a ``use_collectives=False`` save,
    which the writer refuses."""
    mine = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    where = os.path.join(root, f"group{rank}")
    sd = {"t": torch.full((4,), float(rank + 1))}
    dcp.save(sd, storage_writer=ResilientStorageWriter(where), process_group=mine)
    back = {"t": torch.zeros(4)}
    reader = ResilientStorageReader(where, process_group=mine)
    dcp.load(back, storage_reader=reader, process_group=mine)
    out: dict[str, object] = {"group_loaded": back["t"].tolist()}
    dist.barrier()
    if rank == 0:  # one process of the job loads alone
        alone = {"t": torch.zeros(4)}
        dcp.load(alone, storage_reader=ResilientStorageReader(where, no_dist=True), no_dist=True)
        out["alone_loaded"] = alone["t"].tolist()
    dist.barrier()
    try:
        dcp.save(sd, storage_writer=ResilientStorageWriter(where), use_collectives=False)
        out["rank_local_save"] = "saved"
    except Exception as e:  # the error itself is what the test checks
        out["rank_local_save"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    main()
