"""Unusual content of a training state, against what ``torch.save``/``torch.load`` keeps: views
that share bytes but not values, tensor subclasses, arrays in another byte order, and tensors
restored into placeholders. Each comes back exactly or is refused at save, naming its key."""

from __future__ import annotations

import torch

from resilient_callbacks import Checkpointer


def _save(dirpath, state, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        assert ck.save(1, state) is True
        ck.flush()


def _restore(dirpath, state, **kw):
    with Checkpointer(dirpath, **kw) as ck:
        return ck.restore(state)


def test_a_conjugate_or_negative_view_is_not_taken_for_its_base(tmp_path):
    """``c.conj()`` and ``x._neg_view()`` view the same bytes as ``c`` and ``x`` with the same
    shape and strides, but read other values (a lazy conjugate/negative bit): they were stored
    as aliases of their base, and came back as the base's values, with no error."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    state = {"c": c, "cc": c.conj(), "x": x, "nx": x._neg_view()}
    _save(tmp_path / "ck", state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    _restore(tmp_path / "ck", live)
    for k, v in state.items():
        assert torch.equal(live[k], v.resolve_conj().resolve_neg()), k
