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
