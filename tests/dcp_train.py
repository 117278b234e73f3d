"""Worker script of the Sharded (FSDP2 on gloo, CPU) tests: one rank of a training run.

``python dcp_train.py ROOT OUT TOTAL EVERY [CRASH_AT]``: restore from ROOT (resharding to this
world size), write the full tensors right after a restore to ``OUT.restored.safetensors``
(rank 0), train up to step TOTAL saving every EVERY steps (``Sharded`` + ``PerRank``), append
each step's loss to ``OUT.rank<r>.jsonl``, and write the final full tensors to
``OUT.final.safetensors`` (rank 0); after every step, ``OUT.rank<r>.buffers.jsonl``: the host
buffers of the Sharded part (:func:`record_buffers`); after a restore, ``OUT.rank<r>.mapped``: how many of its
tensors view a mapped checkpoint file (:func:`viewing_files_under`). With CRASH_AT, every rank SIGKILLs itself right after
``ck.step(CRASH_AT)`` returns (a background save may be in flight). With the environment
variable ``RC_FORBID_PICKLE`` set, ``pickle.load``/``loads``/``Unpickler`` and ``torch.load`` raise
during the restore. ``RC_OVERLAP=1``: ``Checkpointer(overlap_snapshot=True)``; ``RC_OPTIM=sgd``: SGD with a
``StepLR`` schedule (saved too) in place of AdamW; with
``RC_SLOW_DEFERRED_COPY=1`` as well, every deferred (background) snapshot copy first sleeps
0.5 s and then appends a line to ``OUT.deferred`` -- an optimizer step that did not wait for the
copy would change the parameters before they are copied, and the checkpoint would be torn.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import spawn_ranks
from dcp_helpers import backend, build, full_tensors, train_step
from resilient_callbacks import Checkpointer, PerRank
from resilient_callbacks.dcp import Sharded


class Position:
    """A per-rank counter standing in for a data loader's position."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = sd["seen"]


def forbid_unpickling() -> dict[str, object]:
    """Make every way to unpickle raise: a restore that needed pickle would fail loudly, even
    through torch.distributed's object collectives (``all_gather_object``, which FSDP1's own
    optimizer state dict uses; a Sharded restore into FSDP1 does not call it). Returns the
    originals, for :func:`allow_unpickling`."""
    import pickle

    saved = {"load": pickle.load, "loads": pickle.loads, "Unpickler": pickle.Unpickler}
    saved["torch.load"] = torch.load

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("restore tried to unpickle")

    pickle.load = pickle.loads = refuse  # type: ignore[assignment]
    pickle.Unpickler = refuse  # type: ignore[assignment,misc]
    torch.load = refuse  # type: ignore[assignment]
    return saved


def allow_unpickling(saved: dict[str, object]) -> None:
    import pickle

    pickle.load, pickle.loads = saved["load"], saved["loads"]  # type: ignore[assignment]
    pickle.Unpickler = saved["Unpickler"]  # type: ignore[assignment,misc]
    torch.load = saved["torch.load"]  # type: ignore[assignment]


def slow_deferred_copies(out: str) -> None:
    """Delay every deferred snapshot copy (see the module docstring)."""
    import time

    from resilient_callbacks import snapshot

    real = snapshot.Snapshot._copy_later

    def slow(self: snapshot.Snapshot, items: list, stream: object) -> None:  # type: ignore[type-arg]
        time.sleep(0.5)
        real(self, items, stream)
        with open(f"{out}.deferred", "a") as f:
            f.write(f"{len(items)}\n")

    snapshot.Snapshot._copy_later = slow  # type: ignore[method-assign]


def viewing_files_under(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """How many of this rank's parameters and optimizer-state tensors (their local pieces)
    point into a memory mapping of a file under ``root`` (``/proc/self/maps``): a restore
    that hands over views of its mapped checkpoint files, not the live tensors written in
    place, leaves some."""
    where = os.path.realpath(root)
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(where):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    tensors = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    for st in opt.state.values():
        tensors += [getattr(v, "_local_tensor", v) for v in st.values() if torch.is_tensor(v)]
    return sum(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors if t.numel())


def flat_layout_refused(rank: int) -> None:
    """``RC_FLAT_REFUSED=none@R``: rank R cannot read FSDP1's layout directly; ``raises@R``:
    reading it raises there; ``RC_FLAT_REFUSED=differs@R``: on rank R, what it reads differs from FSDP1's state dict.
    Either way every rank must save through DCP's state dict."""
    how, _, where = os.environ.get("RC_FLAT_REFUSED", "").partition("@")
    if not how or int(where) != rank:
        return
    from resilient_callbacks.dcp import sharded

    if how == "none":
        sharded.FlatLayout.of = classmethod(lambda cls, *a: None)  # type: ignore[assignment]
    elif how == "raises":

        def fail(cls: object, *a: object) -> None:
            raise RuntimeError("made to fail by the test")

        sharded.FlatLayout.of = classmethod(fail)  # type: ignore[assignment]
    else:
        sharded.differences = lambda *a: "made to differ by the test"  # type: ignore[assignment]


def record_buffers(ck: Checkpointer, path: str, step: int, saved: bool) -> None:
    """Append the host buffers the Sharded part's saves copy into (name -> [address, number
    of elements]), once allocated: those made ahead of the first save must be the ones it uses."""
    bufs = ck._saver.part_buffers._by_id.get("train")
    if bufs is not None:
        bufs.wait_allocated()
    ptrs = {k: [b.data_ptr(), b.numel()] for k, b in bufs._bufs.items()} if bufs else {}
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "saved": saved, "buffers": ptrs}) + "\n")


def main() -> None:
    root, out, total, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    crash_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model, opt = build()
    flat_layout_refused(rank)
    torch.manual_seed(1000 + rank)  # each rank its own data stream
    pos = Position()
    state: dict[str, object] = {"train": Sharded(model, opt), "data": PerRank(pos)}
    sched = None
    if os.environ.get("RC_OPTIM") == "sgd":  # a chainable scheduler: it scales the group's lr
        sched = state["sched"] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    overlap = os.environ.get("RC_OVERLAP") == "1"
    if overlap and os.environ.get("RC_SLOW_DEFERRED_COPY") == "1":
        slow_deferred_copies(out)
    with Checkpointer(
        root, every_n_steps=every, keep_last=3, preemption=False, overlap_snapshot=overlap
    ) as ck:
        forbidden = forbid_unpickling() if os.environ.get("RC_FORBID_PICKLE") else None
        start = ck.restore(state)
        if forbidden is not None:
            allow_unpickling(forbidden)
        if start:
            assert pos.seen == start * 8, (pos.seen, start)
            with open(f"{out}.rank{rank}.mapped", "w") as f:
                f.write(str(viewing_files_under(root, model, opt)))
        # after a restore only: DCP's state dict gives an optimizer without state some (a zero
        # step), which would hide what a run whose optimizer has none yet does
        restored = full_tensors(model, opt) if start else None
        if rank == 0:
            if restored is not None:
                save_file(
                    {k: v.contiguous() for k, v in restored.items()},
                    f"{out}.restored.safetensors",
                )
            with open(f"{out}.start", "w") as f:
                f.write(str(start))
        with open(f"{out}.rank{rank}.jsonl", "a") as log:
            for step in range(start + 1, total + 1):
                loss = train_step(model, opt)
                if sched is not None:
                    sched.step()
                pos.seen += 8
                log.write(json.dumps({"step": step, "loss": loss}) + "\n")
                log.flush()
                saved = ck.step(step, state, {"loss": loss}, final=step == total)
                record_buffers(ck, f"{out}.rank{rank}.buffers.jsonl", step, saved)
                if step == crash_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    final = full_tensors(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in final.items()}, f"{out}.final.safetensors")
    spawn_ranks.leave_group()


if __name__ == "__main__":
    main()
