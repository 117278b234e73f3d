"""What a Trainer run ends with besides its weights and log (helper for the tests, not a test
module): the optimizer's and scheduler's states, every global RNG, the ``TrainerState``
counters and the exportable callbacks' states, written by ``hf_train.py --out-state PATH`` (the
tensors as safetensors at PATH, the rest as JSON at PATH + ".json") so that a resumed run's
end can be compared with the uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

COUNTERS = ("global_step", "epoch", "num_input_tokens_seen", "total_flos", "best_metric",
            "best_global_step")  # fmt: skip


def _plain(value: Any, tensors: dict[str, torch.Tensor], name: str) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` (named by their path)."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().clone().contiguous()
        return f"<tensor {name}>"
    if isinstance(value, dict):
        return {str(k): _plain(v, tensors, f"{name}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, tensors, f"{name}.{i}") for i, v in enumerate(value)]
    if isinstance(value, float):
        return value.hex()  # bit for bit, inf and nan included
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def write(trainer: Any, path: str) -> None:
    from transformers.trainer_callback import ExportableState

    tensors: dict[str, torch.Tensor] = {}
    st = trainer.state
    best = st.best_model_checkpoint
    doc = {
        "optimizer": _plain(trainer.optimizer.state_dict(), tensors, "optimizer"),
        "scheduler": _plain(trainer.lr_scheduler.state_dict(), tensors, "scheduler"),
        "state": _plain({k: getattr(st, k) for k in COUNTERS}, tensors, "state"),
        # the directory's name: the runs compared write into different output directories
        "best_model_checkpoint": os.path.basename(best) if best else None,
        "callbacks": [
            [type(cb).__name__, _plain(cb.state(), tensors, "callback")]
            for cb in trainer.callback_handler.callbacks
            if isinstance(cb, ExportableState)
        ],
        "trainer_checkpoints": sorted(
            p for p in os.listdir(trainer.args.output_dir) if p.startswith("checkpoint-")
        ),
        "python_rng": _plain(random.getstate(), tensors, "python_rng"),
        "numpy_rng": _plain(np.random.get_state()[1].tolist(), tensors, "numpy_rng"),
    }
    tensors["torch_rng"] = torch.get_rng_state()
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)
    with open(path + ".json", "w") as f:
        json.dump(doc, f)
