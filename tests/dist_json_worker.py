"""Worker script of the JSON collectives test: one rank of 2.

``python dist_json_worker.py OUT``: runs ``all_gather_json``, ``broadcast_json`` and
``gather_json`` on payloads that fit the first round's frame and payloads that do not (on one
rank, on both, on the source), on the default group and on a background gloo group, counting
the collectives each call issued. Writes ``OUT.rank<r>.json``: every result, in call order.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch.distributed as tdist

from resilient_callbacks import dist

LONG = "x" * (3 * dist.INLINE)


def main() -> None:
    out = sys.argv[1]
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = tdist.get_rank()
    calls = [0]
    for name in ("all_gather", "broadcast", "gather", "all_reduce"):
        inner = getattr(tdist, name)

        def counted(*a: Any, _inner: Any = inner, **k: Any) -> Any:
            calls[0] += 1
            return _inner(*a, **k)

        setattr(dist.torch.distributed, name, counted)
    group = dist.new_cpu_group()
    results: list[Any] = []

    def record(value: Any) -> None:
        results.append({"value": value, "collectives": calls[0]})
        calls[0] = 0

    record(dist.all_gather_json({"rank": rank, "ok": True}))  # both fit
    record(dist.all_gather_json({"rank": rank, "pad": LONG if rank == 1 else ""}))  # one does not
    record(dist.all_gather_json([rank, LONG * (rank + 1)], group=group))  # neither, lengths differ
    record(dist.all_gather_json(None))
    record(dist.broadcast_json({"from": rank, "key": (1, 2)}, src=1))  # a tuple arrives as a list
    record(dist.broadcast_json({"from": rank, "pad": LONG} if rank == 0 else None, group=group))
    record(dist.broadcast_json({1: "int keys arrive as strings"} if rank == 0 else None))
    record(dist.gather_json({"rank": rank, "pad": LONG if rank == 0 else ""}))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    tdist.destroy_process_group(group)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
