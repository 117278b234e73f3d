"""Remote names that are not free: a remote checkpoint whose manifest cannot be read here
(damaged, written by a newer version of the library, or a GET the store did not answer) is
never replaced by an upload; only ``gc --remote --remove-corrupt`` deletes a damaged one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.remote import RemoteStore


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def _fresh() -> dict:
    return {"w": torch.zeros(64)}


@pytest.mark.parametrize("how", ["garbled", "newer format"])
def test_a_resave_after_a_fallback_never_overwrites_the_unreadable_remote_copy(
    tmp_path, s3_remote, caplog, how
):
    """The newest remote checkpoint's manifest cannot be read on a new node (empty dirpath):
    restore falls back to the one before, the run saves that step again, and its upload took
    the unreadable copy's name: it uncommitted and overwrote it (its manifest may have been
    unreadable only briefly, or only to this older library). Now the re-save is uploaded under
    another name and the unreadable copy stays, byte for byte. A newer format's commit number
    is still read, so the re-save numbers after it; a garbled one's is unknown: said."""
    url, opts = s3_remote
    local = tmp_path / "local"
    kw = {"remote": url, "remote_options": opts, "keep_last": 5, "async_save": False}
    with Checkpointer(local, **kw) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    st = RemoteStore(url, opts)
    where = f"{st.root}/step_000000020/manifest.json"
    good = st.fs.cat_file(where)
    bad = b"{torn" if how == "garbled" else _newer(good)
    st.fs.pipe_file(where, bad)
    shutil.rmtree(local)
    with (
        pytest.warns(ResumeFallbackWarning, match="step_000000020"),
        Checkpointer(local, **kw) as ck,
    ):
        assert ck.restore(_fresh()) == 10
        ck.save(20, _state(-20))  # the run goes on: step 20 again, other values
    st.fs.invalidate_cache()
    assert st.fs.cat_file(where) == bad, "the unreadable copy was replaced"
    st.fs.pipe_file(where, good)  # it was readable after all: the run's step 20 is whole
    found = {e.name: e for e in RemoteStore(url, opts).scan()}
    assert sorted(found) == ["step_000000010", "step_000000020", "step_000000020-r1"]
    assert all(e.problem is None for e in found.values()), found
    old, new = found["step_000000020"].manifest, found["step_000000020-r1"].manifest
    assert (old.step, new.step) == (20, 20)
    if how == "newer format":
        assert new.seq > old.seq  # numbered after it: a restore takes the re-save
    else:
        assert "commit order of step_000000020" in caplog.text


def _newer(raw: bytes) -> bytes:
    return json.dumps({**json.loads(raw), "format_version": 99}).encode()
