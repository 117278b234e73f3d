"""The option check every adapter shares (resilient_callbacks.adapter)."""

from __future__ import annotations

import pytest

from resilient_callbacks import ConfigError, UnknownOptionError
from resilient_callbacks.adapter import check_options, checkpointer_options


def test_known_options_pass():
    check_options("X", ["every_n_steps", "keep_last", "mine"], own=["mine"])


def test_an_unknown_option_is_one_error_with_the_closest_name():
    with pytest.raises(UnknownOptionError, match=r"every_n_step \(did you mean every_n_steps\?\)"):
        check_options("X", ["every_n_step"], own=["mine"])
    with pytest.raises(TypeError):  # as Python says for an unexpected keyword argument
        check_options("X", ["zzz"], own=[])
    with pytest.raises(ConfigError, match="X got unknown option"):
        check_options("X", ["zzz"], own=[])


def test_checkpointer_options_are_its_keywords():
    opts = checkpointer_options()
    assert {"every_n_steps", "keep_last", "remote", "overlap_snapshot"} <= opts
    assert "dirpath" not in opts


def test_a_misspelt_checkpointer_option_names_the_closest_one(tmp_path):
    # Python's own TypeError ("got an unexpected keyword argument 'every_n_step'") named no
    # option to use instead, where the framework callbacks did.
    from resilient_callbacks import Checkpointer

    with pytest.raises(UnknownOptionError, match=r"every_n_step \(did you mean every_n_steps\?\)"):
        Checkpointer(tmp_path / "c", every_n_step=10)
    with pytest.raises(TypeError, match=r"keep_lats \(did you mean keep_last\?\)"):
        Checkpointer(tmp_path / "c", keep_lats=3)
    with pytest.raises(UnknownOptionError, match=r"Checkpointer got unknown option\(s\): zzz\. It"):
        Checkpointer(tmp_path / "c", zzz=1)
    assert not (tmp_path / "c").exists()  # refused before anything was made
    with Checkpointer(dirpath=tmp_path / "c", every_n_steps=2, read_only=False) as ck:
        assert ck.config.every_n_steps == 2


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("save_top_k", "save_top_k (keep_best here, with monitor)"),  # Lightning's ModelCheckpoint
        ("save_total_limit", "save_total_limit (keep_last here)"),  # TrainingArguments
        ("save_steps", "save_steps (every_n_steps here)"),
        ("every_n_train_steps", "every_n_train_steps (every_n_steps here)"),
        ("train_time_interval", "train_time_interval (every_seconds here, in seconds)"),
        ("save_last", "save_last (not needed here: the newest checkpoint is always kept)"),
    ],
)
def test_a_frameworks_own_name_for_an_option_names_ours(name, said):
    """A Lightning or Trainer user reaches for the names of ModelCheckpoint and
    TrainingArguments; save_top_k and save_total_limit got no hint at all (nothing close)."""
    with pytest.raises(UnknownOptionError) as ei:
        check_options("X", [name], own=["mine"])
    assert said in str(ei.value), str(ei.value)


def test_the_list_of_options_names_each_once():
    """An adapter option that is also a Checkpointer option (the Lightning callback's
    save_on_exception) was listed twice."""
    with pytest.raises(UnknownOptionError) as ei:
        check_options("X", ["zzz"], own=["mine", "save_on_exception"])
    assert str(ei.value).count("save_on_exception") == 1, str(ei.value)
