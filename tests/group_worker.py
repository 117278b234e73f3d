"""Worker script of the background-group test: one rank of 2.

``python group_worker.py ROOT OUT``: counts the process groups the Checkpointer makes
(``torch.distributed.new_group``) in four uses and writes ``OUT.rank<r>.json``:

1. open, restore (nothing to restore), close: none;
2. three background saves, then close: one, made at the first save;
3. open, restore (step 3), close: none;
4. ``async_save=False``, two saves: none (no background collectives);
5. node-local mode (a directory per rank, a ``file://`` remote): the groups of its protocol.

It also writes the timeout every group was made with (``OUT.timeouts.rank<r>.json``): the
world's (60 s here), never gloo's 30-minute default.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch
import torch.distributed as tdist

from resilient_callbacks import Checkpointer


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    made = [0]
    timeouts: list[Any] = []
    inner = tdist.new_group

    def counted(*a: Any, **k: Any) -> Any:
        made[0] += 1
        group = inner(*a, **k)
        if isinstance(group, tdist.ProcessGroup):  # not for a group without this rank
            backend = group._get_backend(torch.device("cpu"))
            timeouts.append(backend.options._timeout.total_seconds())
        return group

    tdist.new_group = counted  # type: ignore[assignment]
    state = {"w": torch.arange(4.0) + tdist.get_rank()}
    counts: list[Any] = []

    def use(fn: Any, **kw: Any) -> None:
        made[0] = 0
        with Checkpointer(root, preemption=False, **kw) as ck:
            counts.append([fn(ck), made[0]])

    use(lambda ck: ck.restore(state))
    use(lambda ck: [ck.save(s, state) for s in (1, 2, 3)] and made[0])
    use(lambda ck: ck.restore(state))
    use(lambda ck: [ck.save(s, state) for s in (4, 5)] and made[0], async_save=False)
    rank = tdist.get_rank()
    made[0] = 0
    with Checkpointer(
        f"{root}-node{rank}", remote=f"file://{root}-remote", preemption=False, async_save=False
    ) as ck:
        ck.save(1, state)
        counts.append([ck.topology.node_local, made[0]])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(counts, f)
    with open(f"{out}.timeouts.rank{rank}.json", "w") as f:
        json.dump(timeouts, f)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
