"""One DeepSpeed rank (CPU) training a model with a tied weight (an embedding shared with its
output layer, as GPT-2's ``lm_head``/``wte``) for 2 steps, saved by resilient_callbacks.deepspeed;
writes the module's state dict at the end (``live.pt``) and DeepSpeed's own checkpoint
(``ds/``) for tests/test_export_tied.py.

    python ds_tied_worker.py DIR STAGE
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch import nn

import resilient_callbacks.deepspeed as rcds


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(12, 6)
        self.norm = nn.BatchNorm1d(6)
        self.lm_head = nn.Linear(6, 12, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(self.wte(x)))
        return nn.functional.cross_entropy(logits, x)


def main() -> None:
    d, stage = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = Tied()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "resilient_checkpoint": {"dirpath": os.path.join(d, "ck"), "every_n_steps": 100},
    }
    engine, *_ = rcds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):
        loss = engine(torch.randint(0, 12, (4,)))
        engine.backward(loss)
        engine.step()
    engine.resilient_checkpoint.save(final=True)
    engine.save_checkpoint(os.path.join(d, "ds"))  # DeepSpeed's own, for zero_to_fp32
    params = list(engine.module.parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            live = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    else:
        live = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    torch.save(live, os.path.join(d, "live.pt"))


if __name__ == "__main__":
    main()
