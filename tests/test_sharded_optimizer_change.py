"""``dcp.Sharded`` restored with another optimizer than the one it saved (FSDP2, one gloo
rank): another class, or the same parameters in other parameter groups, is refused before
anything is loaded, naming what changed. Found 2026-12-05: an AdamW checkpoint restored into
an AdamW whose parameters were split into two groups "restored" and left the first group
without ``lr``/``betas`` (the next ``step()`` raised ``KeyError: 'betas'``); into an ``Adam``
(the same state keys) it loaded AdamW's hyper-parameters silently."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import spawn_ranks
from torch_needs import needs_dcp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300), needs_dcp]


def test_another_optimizer_or_other_groups_are_refused_before_loading(tmp_path):
    argv = [sys.executable, __file__, str(tmp_path / "ck")]
    spawn_ranks.run(argv, 1, tmp_path, "change", zygote=spawn_ranks.shared_zygote())
    res = json.loads((tmp_path / "result.json").read_text())
    assert "torch.optim.adamw.AdamW in the checkpoint" in res["sgd"]["refused"], res["sgd"]
    assert "torch.optim.sgd.SGD here" in res["sgd"]["refused"]
    assert "torch.optim.adam.Adam here" in res["adam"]["refused"], res["adam"]
    assert "parameter groups" in res["groups"]["refused"], res["groups"]
    assert "[4] in the checkpoint" in res["groups"]["refused"], res["groups"]
    assert "[2, 2] here" in res["groups"]["refused"], res["groups"]
    assert "optimizer(s)" in res["two"]["refused"], res["two"]
    for case in ("sgd", "adam", "groups", "two"):
        assert res[case]["changed"] == [], case  # refused before anything was loaded
    assert res["same"] == {"refused": None, "changed": ["0.bias", "0.weight", "1.bias", "1.weight"]}


def test_groups_of_the_same_sizes_holding_other_parameters_differ():
    from torch import nn

    from resilient_callbacks.dcp.flat import Names
    from resilient_callbacks.dcp.optim_fit import Fingerprints, problems

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    (a0, a1), (b0, b1) = m[0].parameters(), m[1].parameters()
    kinds = Fingerprints(m, Names(m))
    by_layer = kinds([torch.optim.AdamW([{"params": [a0, a1]}, {"params": [b0, b1]}])])
    by_kind = kinds([torch.optim.AdamW([{"params": [a0, b0]}, {"params": [a1, b1]}])])
    reordered = kinds([torch.optim.AdamW([{"params": [a1, a0]}, {"params": [b0, b1]}])])
    assert by_layer[0]["groups"][0][0] == 2
    assert problems(by_layer, by_kind) == [
        "optimizer 0: parameter groups of [2, 2] in the checkpoint, of [2, 2] here "
        "(the same sizes, other parameters)"
    ]
    assert problems(by_layer, reordered) == []  # DCP matches a group's parameters by name
    assert problems(None, by_kind) == []  # written before it was recorded


def worker(root: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from resilient_callbacks import Checkpointer
    from resilient_callbacks.dcp import Sharded

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 1))
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with Checkpointer(root, every_n_steps=1, preemption=False) as ck:
        for step in (1, 2):
            m(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ck.step(step, {"train": Sharded(m, opt)})
    a, b = list(m[0].parameters()), list(m[1].parameters())
    variants = {
        "sgd": lambda: [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)],
        "adam": lambda: [torch.optim.Adam(m.parameters(), lr=1e-2)],
        "groups": lambda: [torch.optim.AdamW([{"params": a}, {"params": b, "lr": 1e-3}])],
        "swapped": lambda: [
            torch.optim.AdamW([{"params": [a[0], b[0]]}, {"params": [a[1], b[1]]}])
        ],
        "two": lambda: [torch.optim.AdamW(a), torch.optim.AdamW(b)],
        "same": lambda: [torch.optim.AdamW(m.parameters(), lr=1e-2)],
    }
    res: dict = {}
    for name, make in variants.items():
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        optims = make()
        refused = None
        with Checkpointer(root, preemption=False) as ck:
            try:
                ck.restore({"train": Sharded(m, optims)})
            except Exception as e:
                refused = f"{type(e).__name__}: {e}"
        changed = sorted(n for n, p in m.named_parameters() if bool(p.full_tensor().ne(0).any()))
        res[name] = {"refused": refused, "changed": changed}
    (Path(root).parent / "result.json").write_text(json.dumps(res, indent=1))
    spawn_ranks.leave_group()


if __name__ == "__main__":
    worker(sys.argv[1])
