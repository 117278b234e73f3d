"""The Trainer under DeepSpeed ZeRO STAGE (CPU), 14 steps, with or without ResilientCheckpoint
(its options in the config's section, a save every 2 steps); writes the per-step log history,
train()'s metrics and the final fp32 weights to OUT.pt (tests/test_deepspeed.py compares the
two runs).

    python tests/hf_ds_transparent.py with|without OUTDIR STAGE
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint


def main(mode: str, out: str, stage: int) -> None:
    opts = argparse.Namespace(
        deepspeed=stage, every_n_steps=2, keep_last=3, outdir=out, overlap=False
    )
    config = hf_train.deepspeed_config(opts)
    if mode == "without":
        del config["resilient_checkpoint"]
    torch.set_num_threads(1)
    trainer = hf_train.build_trainer(out, 14, deepspeed=config)
    if mode == "with":
        trainer.add_callback(ResilientCheckpoint())
    result = trainer.train()
    from deepspeed.utils import safe_get_full_fp32_param

    engine = trainer.model_wrapped
    params = {
        k: safe_get_full_fp32_param(p).detach().clone().contiguous()
        for k, p in engine.module.named_parameters()
    }
    logged = [e for e in trainer.state.log_history if "loss" in e or "eval_loss" in e]
    torch.save(
        {
            "params": params,
            "history": hf_train.clean_history(logged),
            "metrics": hf_train.without_timings(result.metrics),
            "counters": [engine.global_steps, engine.micro_steps, engine.global_samples],
        },
        out + ".pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
