"""The Trainer under DeepSpeed ZeRO STAGE (CPU) training a plain torch module (no
``PreTrainedModel``), 4 steps, ResilientCheckpoint saving every 2; writes the engine's gathered
fp32 weights at the end to OUTDIR/final.safetensors (tests/test_deepspeed.py exports the
checkpoint and compares).

    python tests/hf_ds_plain.py OUTDIR STAGE
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers
from safetensors.torch import save_file

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint


class PlainLM(torch.nn.Module):
    """A plain torch module the Trainer trains: there is no config to record."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(hf_train.VOCAB, 8)
        self.head = torch.nn.Linear(8, hf_train.VOCAB)

    def forward(self, input_ids, labels=None):  # type: ignore[no-untyped-def]
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def main(out: str, stage: int) -> None:
    opts = argparse.Namespace(
        deepspeed=stage, every_n_steps=2, keep_last=3, outdir=out, overlap=False
    )
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=PlainLM(),
        args=hf_train.training_args(
            out, 4, eval_strategy="no", deepspeed=hf_train.deepspeed_config(opts)
        ),
        train_dataset=hf_train.TokenDataset(hf_train.NUM_SAMPLES, 1),
        callbacks=[ResilientCheckpoint()],
    )
    trainer.train()
    from deepspeed.utils import safe_get_full_fp32_param

    module = trainer.model_wrapped.module
    final = {
        k: (safe_get_full_fp32_param(p) if stage else p).detach().clone().contiguous()
        for k, p in module.named_parameters()
    }
    save_file(final, f"{out}/final.safetensors")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
