"""A data collator that draws from the global RNGs (masked-LM masking): a run resumed inside an
epoch ends as the run not interrupted, bit for bit.

With ``dataloader_num_workers=0`` the main process collates, and accelerate's ``DataLoaderShard``
fetches one batch ahead: the first batch after a checkpoint was collated (its masks drawn)
before the save. The resumed run collates that batch again; it must draw from the RNG states
the uninterrupted run drew it from, and train on from the states restored.

``DataCollatorForLanguageModeling(..., seed=s)`` draws from a ``torch.Generator`` of its own
instead, which no snapshot of the global streams holds (found 2026-12-06: after a resume every
batch was masked otherwise than in the uninterrupted run); it is saved with each checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
)

import hf_train
from resilient_callbacks.transformers import ResilientCheckpoint

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(5, len(VOCAB), (n, hf_train.SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i]}


def _trainer(out: Path, tokenizer: Any, seed: int | None = None, **overrides: Any) -> Trainer:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=hf_train.SEQ, pad_token_id=0,
    )  # fmt: skip
    return Trainer(
        model=BertForMaskedLM(config),
        args=hf_train.training_args(
            str(out), 10, **{"eval_strategy": "no", "metric_for_best_model": None, **overrides}
        ),
        train_dataset=_Tokens(hf_train.NUM_SAMPLES),
        eval_dataset=_Tokens(8),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=seed),
    )


def _train(out: Path, tokenizer: Any, cb: ResilientCheckpoint | None, **kw: Any) -> tuple:
    trainer = _trainer(out, tokenizer, **kw)
    if cb is not None:
        trainer.add_callback(cb)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return hf_train.clean_history(trainer.state.log_history), weights


@pytest.fixture
def tokenizer(tmp_path: Path) -> Any:
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return BertTokenizer(str(tmp_path / "vocab.txt"))


def test_the_collator_draws_from_the_global_torch_rng(tokenizer):
    """(What the test below relies on: without a ``seed`` the masking draws from it.)"""
    before = torch.get_rng_state()
    DataCollatorForLanguageModeling(tokenizer)([{"input_ids": torch.arange(5, 21)}])
    assert not torch.equal(before, torch.get_rng_state())


@pytest.mark.slow  # four Trainer runs
def test_a_masking_collator_resumes_exactly_inside_an_epoch(tmp_path, tokenizer):
    """10 steps, epochs of 5 (accumulation 3), a checkpoint at every step; resumed inside the
    first epoch (3), at its end (5) and inside the second (7)."""
    ck = tmp_path / "ck"
    without = _train(tmp_path / "a", tokenizer, None)
    with_cb = _train(tmp_path / "b", tokenizer, ResilientCheckpoint(ck, every_n_steps=1))
    assert with_cb[0] == without[0]
    assert [k for k in without[1] if not torch.equal(without[1][k], with_cb[1][k])] == []
    for step in (3, 5, 7):
        cb = ResilientCheckpoint(ck, every_n_steps=100, resume=step, save_on_train_end=False)
        got = _train(tmp_path / f"r{step}", tokenizer, cb)
        assert cb.restored_step == step
        assert got[0] == without[0], step
        assert [k for k in without[1] if not torch.equal(without[1][k], got[1][k])] == [], step


@pytest.mark.slow  # three Trainer runs
def test_a_checkpoint_written_before_the_collated_batch_states_resumes_as_before(
    tmp_path, monkeypatch
):
    """Checkpoints written before 2026-12-06 have no ``next_batch_rng`` among each rank's
    values: they restore (it is optional), and a run whose collator draws nothing resumes
    exactly inside an epoch, as it did."""
    from resilient_callbacks.transformers.trainer_state import SavedState

    def run(out: Path, cb: ResilientCheckpoint | None) -> tuple:
        trainer = hf_train.build_trainer(str(out), 10)
        if cb is not None:
            trainer.add_callback(cb)
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return hf_train.clean_history(trainer.state.log_history), weights

    build, refresh = SavedState.build, SavedState.refresh

    def old_build(self: Any, trainer: Any, batches: Any) -> dict[str, Any]:
        tree = build(self, trainer, batches)
        self.rank_values = tree["rank"] = dict(self.rank_values)  # the old per-rank values
        self.rank_values.pop("next_batch_rng", None)
        self.rank_values.pop("collator_rng", None)
        return tree

    def old_refresh(self: Any, *args: Any) -> None:
        refresh(self, *args)
        self.rank_values.pop("next_batch_rng", None)
        self.rank_values.pop("collator_rng", None)

    ck = tmp_path / "ck"
    without = run(tmp_path / "a", None)
    with monkeypatch.context() as m:
        m.setattr(SavedState, "build", old_build)
        m.setattr(SavedState, "refresh", old_refresh)
        run(tmp_path / "b", ResilientCheckpoint(ck, every_n_steps=1))
    cb = ResilientCheckpoint(ck, every_n_steps=100, resume=3, save_on_train_end=False)
    got = run(tmp_path / "r", cb)
    assert cb.restored_step == 3
    assert got[0] == without[0]
    assert [k for k in without[1] if not torch.equal(without[1][k], got[1][k])] == []


def test_a_collator_with_its_own_generator_resumes_exactly(tmp_path, tokenizer):
    """``seed=5``: the masks come from the collator's own generator, which the evaluations
    (every 4 steps, through the same collator) draw from too. Resumed after an evaluation
    inside the first epoch (4) and at its end (5)."""
    kw: dict[str, Any] = {"seed": 5, "eval_strategy": "steps"}
    ck = tmp_path / "ck"
    without = _train(tmp_path / "a", tokenizer, None, **kw)
    with_cb = _train(tmp_path / "b", tokenizer, ResilientCheckpoint(ck, every_n_steps=1), **kw)
    assert with_cb[0] == without[0]
    for step in (4, 5):
        cb = ResilientCheckpoint(ck, every_n_steps=100, resume=step, save_on_train_end=False)
        got = _train(tmp_path / f"r{step}", tokenizer, cb, **kw)
        assert cb.restored_step == step
        assert got[0] == without[0], step
        assert [k for k in without[1] if not torch.equal(without[1][k], got[1][k])] == [], step


def test_a_numpy_collator_generator_is_saved_and_given_back(tokenizer):
    """``return_tensors="np"``: the collator's generator is a NumPy ``Generator``; its state goes
    through the checkpoint's JSON and back (also into a collator that has not created it)."""
    from resilient_callbacks.transformers import collator_rng

    batch = [{"input_ids": list(range(5, 21))}]
    a = DataCollatorForLanguageModeling(tokenizer, seed=3, return_tensors="np")
    a(batch)
    assert collator_rng.holder(a) is a
    saved = collator_rng.encode(collator_rng.get(a))
    b = DataCollatorForLanguageModeling(tokenizer, seed=3, return_tensors="np")
    collator_rng.put(b, collator_rng.decode(saved))
    assert (a(batch)["labels"] == b(batch)["labels"]).all()
    assert collator_rng.encode(collator_rng.get(a)) == collator_rng.encode(collator_rng.get(b))
