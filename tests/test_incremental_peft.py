"""A real PEFT LoRA model (a GPT-2 built from a config, LoRA adapters from peft) saved ten times
with ``incremental=True``: the frozen base model is stored once, each save writes about what
the adapters and their optimizer changed, and every checkpoint restores bit-exactly.
Slow: importing transformers and peft takes seconds."""

from __future__ import annotations

import os

import pytest
import torch

from resilient_callbacks import Checkpointer
from torch_needs import needs_transformers

pytestmark = [pytest.mark.slow, needs_transformers]


def _lora_model(seed: int):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=2000, n_positions=64, n_embd=256, n_layer=4, n_head=4
    )
    base = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return {"model": model, "opt": opt}


def _step(state, step: int) -> None:
    torch.manual_seed(step)
    ids = torch.randint(0, 2000, (2, 16))
    state["model"](input_ids=ids, labels=ids).loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()


def _snapshot(state) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["opt"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def _size(root) -> int:
    return sum(
        os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(root)
        for n in names
        if "/step_" in d or "/blobs" in d
    )


def test_lora_fine_tuning_stores_the_frozen_base_once(tmp_path):
    state = _lora_model(0)
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    changed: list[int] = []
    written: list[int] = []
    with Checkpointer(tmp_path / "inc", incremental=True, async_save=True) as ck:
        for step in range(1, 11):
            _step(state, step)
            ck.save(step, state)
            ck._saver.wait_background()
            written.append(ck.last_save.written)
            snaps[step] = _snapshot(state)
            if step > 1:
                prev = snaps[step - 1]
                changed.append(
                    sum(
                        t.numel() * t.element_size()
                        for k, t in snaps[step].items()
                        if k not in prev or not torch.equal(prev[k], t)
                    )
                )
    with Checkpointer(tmp_path / "full", async_save=False) as full:
        full.save(10, state)
    full_bytes = _size(tmp_path / "full")
    assert max(changed) < 0.1 * full_bytes  # LoRA: the adapters are a small part
    assert _size(tmp_path / "inc") <= 1.1 * (full_bytes + sum(changed[:9]))
    assert all(w < 0.2 * written[0] for w in written[1:]), written
    for step in (1, 6, 10):
        fresh = _lora_model(seed=42)
        with Checkpointer(tmp_path / "inc", resume=step, async_save=False) as ck:
            assert ck.restore(fresh) == step
        got = _snapshot(fresh)
        assert got.keys() == snaps[step].keys()
        for k, t in snaps[step].items():
            assert torch.equal(got[k], t), (step, k)
