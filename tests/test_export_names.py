"""``resilient-ckpt export`` writes the names the user's model has uncompiled: a submodule
compiled on its own (``model.enc = torch.compile(model.enc)``) has ``_orig_mod.`` inside its
state dict's keys (``enc._orig_mod.0.weight``), which the model loaded for inference or for
another run does not; ``load_state_dict(strict=True)`` of the export failed. (The model
compiled as a whole is saved unwrapped already.) Dtypes and buffers are kept as trained."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

from resilient_callbacks import Checkpointer
from test_cli import cli


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)


def test_a_submodule_compiled_on_its_own_exports_by_its_plain_names(tmp_path):
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    model.enc = torch.compile(model.enc)  # (compiled lazily: nothing runs here)
    model.enc._orig_mod[1].running_mean.add_(3)  # a buffer with a value of its own
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    out = tmp_path / "out"
    r = cli("export", str(tmp_path / "ck"), str(out))
    assert r.returncode == 0, r.stderr
    got = load_file(out / "model.safetensors")
    fresh = Net().to(torch.bfloat16)
    fresh.load_state_dict(got, strict=True)
    want = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
