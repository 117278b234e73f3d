"""Incremental checkpoints of a 90%-frozen model: bytes on disk and save time over 10 saves,
``incremental=True`` against full saves, with a raw write+fsync of the whole state as the
disk's limit, all in one run.

The model: a frozen trunk (90% of the parameters, ``requires_grad=False``) and a trained head
with Adam. Each save follows an optimizer step. Synchronous saves (``async_save=False``) time
the whole save; background saves time what the training loop waits for (the snapshot).

``--sharded``: the same model under FSDP2 (``fully_shard`` of every Linear, a gloo world of one
process) saved as ``Sharded(model, optimizer)``, whose shards are a FilePart: the frozen trunk's
shards become blobs of the part (``part_blobs.py``). Results go to ``bench_incremental_sharded``.

    python benchmarks/bench_incremental.py --mb 256 [--sharded]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time

import torch
from common import library_version, med, write_results
from torch import nn

from resilient_callbacks import Checkpointer


def make(mb: int) -> dict:
    torch.manual_seed(0)
    width = 1024
    n_frozen = max(1, int(mb * 0.9 * (1 << 20) / 4 / (width * width)))
    trunk = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_frozen)])
    trunk.requires_grad_(False)
    head_out = max(1, int(mb * 0.1 * (1 << 20) / 4 / width) // 3)  # Adam: 3x the head
    head = nn.Linear(width, head_out)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    return {"trunk": trunk, "head": head, "opt": opt}


def sharded(plain: dict) -> dict:
    """``plain``'s trunk and head under FSDP2 in a gloo world of one, as one Sharded part, with
    a fresh Adam on the head (the module keys stay for :func:`train_step`)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks.dcp import Sharded

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = nn.Sequential(plain["trunk"], plain["head"])
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-3)
    return {
        "train": Sharded(model, opt),
        "trunk": model[0],
        "head": model[1],
        "opt": opt,
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def checkpointed(state: dict) -> dict:
    """What goes into the Checkpointer: the Sharded part, or the plain modules and optimizer."""
    return {"train": state["train"]} if "train" in state else state


def train_step(state: dict) -> None:
    x = torch.randn(8, 1024)
    with torch.no_grad():
        x = state["trunk"](x)
    state["head"](x).square().mean().backward()
    state["opt"].step()
    state["opt"].zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def state_bytes(state: dict) -> int:
    n = sum(_local(t).numel() * t.element_size() for t in state["trunk"].state_dict().values())
    n += sum(_local(t).numel() * t.element_size() for t in state["head"].state_dict().values())
    for st in state["opt"].state.values():
        n += sum(_local(t).numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return n


def disk_bytes(root: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(root)
        for n in names
        if "step_" in d or "blobs" in d
    )


def run(root: str, state: dict, incremental: bool, async_save: bool, saves: int) -> dict:
    times, written = [], []
    with Checkpointer(root, incremental=incremental, async_save=async_save) as ck:
        for step in range(1, saves + 1):
            train_step(state)
            t0 = time.perf_counter()
            ck.save(step, checkpointed(state))
            times.append(time.perf_counter() - t0)
            ck._saver.wait_background()
            written.append(ck.last_save.written if ck.last_save else -1)
    return {"times": times, "written": written, "disk": disk_bytes(root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    ap.add_argument("--sharded", action="store_true", help="FSDP2 + Sharded (a FilePart)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-inc-", dir=args.dir)
    state = make(args.mb)
    if args.sharded:
        state = sharded(state)
    train_step(state)
    total = state_bytes(state)
    report: dict = {"state_bytes": total, "sharded": args.sharded}
    try:
        blob = os.urandom(1 << 20) * (total >> 20)
        t0 = time.perf_counter()
        with open(os.path.join(base, "raw"), "wb", buffering=0) as f:
            f.write(blob)
            os.fsync(f.fileno())
        report["raw_write_fsync_s"] = time.perf_counter() - t0
        del blob
        os.unlink(os.path.join(base, "raw"))
        for name, inc, bg in (
            ("full_sync", False, False),
            ("incremental_sync", True, False),
            ("full_async", False, True),
            ("incremental_async", True, True),
        ):
            root = os.path.join(base, name)
            report[name] = run(root, state, inc, bg, args.saves)
            shutil.rmtree(root)
            print(name, {k: v for k, v in report[name].items() if k != "times"})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fs, inc = report["full_sync"], report["incremental_sync"]
    changed = med(inc["written"][1:])
    bound = inc["written"][0] + (args.saves - 1) * changed
    lines = [
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs; library {library_version()}; "
        f"state {total / 2**20:.0f} MiB (90% frozen), {args.saves} saves"
        + (", FSDP2 + Sharded (gloo, one process)." if args.sharded else "."),
        "",
        "| | full saves | incremental | incremental / full |",
        "|---|---|---|---|",
        f"| bytes on disk after {args.saves} saves | {fs['disk'] / 2**20:.0f} MiB | "
        f"{inc['disk'] / 2**20:.0f} MiB | {inc['disk'] / fs['disk']:.2f} |",
        f"| first save, s (sync) | {fs['times'][0]:.3f} | {inc['times'][0]:.3f} | "
        f"{inc['times'][0] / fs['times'][0]:.2f} |",
        f"| later saves, median s (sync) | {med(fs['times'][1:]):.3f} | "
        f"{med(inc['times'][1:]):.3f} | {med(inc['times'][1:]) / med(fs['times'][1:]):.2f} |",
        f"| later saves, median blocking s (async) | {med(report['full_async']['times'][1:]):.3f}"
        f" | {med(report['incremental_async']['times'][1:]):.3f} | "
        f"{med(report['incremental_async']['times'][1:]) / med(report['full_async']['times'][1:]):.2f} |",
        f"| bytes written by a later save | {med(fs['written'][1:]) / 2**20:.1f} MiB | "
        f"{changed / 2**20:.1f} MiB | {changed / med(fs['written'][1:]):.3f} |",
        "",
        f"Raw write+fsync of the whole state (the disk's limit): "
        f"{report['raw_write_fsync_s']:.3f} s. Incremental bytes on disk / (first save + "
        f"{args.saves - 1} x written by a later save): {inc['disk'] / bound:.3f}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    name = "bench_incremental_sharded" if args.sharded else "bench_incremental"
    write_results(args.out, name, report, text)


if __name__ == "__main__":
    main()
