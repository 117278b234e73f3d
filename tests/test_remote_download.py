"""Shared-mode restore from the remote tier over a link that is cut part-way through a
download (a reset connection): what the next try fetches, what it still verifies, and that
no staging folder outlives the restore. A real ``file://`` remote; its filesystem's ``get``
wrapped to count the files each call fetches and to cut the first calls."""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
from pathlib import Path

import pytest
import torch

from resilient_callbacks import Checkpointer, ResumeFallbackWarning
from resilient_callbacks.commit import STAGING_PREFIX


def _state(v: float) -> dict:
    return {"w": torch.full((256,), float(v)), "b": torch.full((64,), float(v))}


def _wiped_after_two_saves(tmp_path: Path) -> tuple[Path, str]:
    local, url = tmp_path / "local", f"file://{tmp_path}/remote"
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        for s in (10, 20):
            ck.save(s, _state(s))
    shutil.rmtree(local)  # a wiped disk: both checkpoints come from the remote
    return local, url


def _cut(monkeypatch, ck: Checkpointer, cuts: int, rot: bool = False) -> list[list[str]]:
    """``ck``'s store's ``get`` of several files: the first ``cuts`` calls copy the first half
    of their files whole (``rot``: one of them with a byte flipped, its size kept), then the
    connection is reset; each call's file names recorded. The next try goes at once (its
    backoff, 1 s then 2 s, waits for nothing here: the cuts end by count)."""
    from resilient_callbacks import stall

    monkeypatch.setattr(stall, "backoff_s", lambda *a, **k: 0.0)
    fs = ck._dir.remote.fs  # type: ignore[union-attr]
    real, gets = fs.get, []

    def get(rpath, lpath, *args, **kw):
        if not isinstance(rpath, list):  # (a blob: none here)
            return real(rpath, lpath, *args, **kw)
        gets.append([posixpath.basename(r) for r in rpath])
        if len(gets) > cuts:
            return real(rpath, lpath, *args, **kw)
        half = max(len(rpath) // 2, 1)
        real(rpath[:half], lpath[:half], *args, **kw)
        if rot:
            data = bytearray(Path(lpath[0]).read_bytes())
            data[len(data) // 2] ^= 0xFF
            Path(lpath[0]).write_bytes(bytes(data))
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(fs, "get", get)  # (fsspec caches the instance: undone after the test)
    return gets


def _stagings(local: Path) -> list[str]:
    return [n for n in os.listdir(local) if n.startswith(STAGING_PREFIX)]


def test_a_download_cut_part_way_fetches_only_what_did_not_arrive(tmp_path, monkeypatch, caplog):
    """The restore's download of step 20 is cut by a reset connection after half of its files
    arrived whole: the next try made a new staging folder and fetched every file again (a
    multi-GB checkpoint over a flaky link fetched up to three times). It now fetches only the
    files that did not arrive; every checksum is still verified, and the run resumes from 20."""
    local, url = _wiped_after_two_saves(tmp_path)
    state = _state(0)
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        gets = _cut(monkeypatch, ck, cuts=1)
        with caplog.at_level(logging.WARNING, "resilient_callbacks"):
            assert ck.restore(state) == 20
        assert _stagings(local) == []
    assert torch.equal(state["w"], torch.full((256,), 20.0))
    first, again = gets
    assert len(first) >= 2, first
    arrived = first[: len(first) // 2]
    assert sorted(again) == sorted(set(first) - set(arrived)), (first, again)
    said = caplog.text
    assert "try 1 of 3" in said and "ConnectionResetError" in said, said
    n = len(first)
    assert f"{len(arrived)} of {n} file(s)" in said and f"the other {n - len(arrived)}" in said


def test_a_file_kept_from_a_cut_try_that_fails_its_checksum_is_fetched_again(
    tmp_path, monkeypatch, caplog
):
    """As above, but a file that arrived in the cut try has its size and a wrong byte (a
    transfer of that try still writing it, a torn write): it is not fetched again at once, the
    checksum verification after the download catches it, and it is then fetched again, loudly:
    the run resumes from step 20 (it skipped step 20 for step 10, where a try with a staging
    folder of its own fetched it whole), never loaded with the wrong byte, and the staging
    folder is removed."""
    local, url = _wiped_after_two_saves(tmp_path)
    state = _state(0)
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        gets = _cut(monkeypatch, ck, cuts=1, rot=True)
        with caplog.at_level(logging.WARNING, "resilient_callbacks"):
            assert ck.restore(state) == 20
        assert _stagings(local) == []
    assert torch.equal(state["w"], torch.full((256,), 20.0))
    first, _again, rotten = gets  # step 20 cut, its second try, the rotten file again
    assert rotten == first[:1], gets
    assert "fail their checksum: fetching them again" in caplog.text, caplog.text


def test_a_rotten_remote_file_kept_from_a_cut_try_still_falls_back(tmp_path, monkeypatch):
    """The remote's own copy of a file is damaged: fetched again after the checksum check, it
    fails again, and step 20 is skipped, loudly, for step 10 (never loaded)."""
    local, url = _wiped_after_two_saves(tmp_path)
    remote20 = tmp_path / "remote" / "step_000000020"
    victim = sorted(p for p in remote20.rglob("*.safetensors*"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    state = _state(0)
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        _cut(monkeypatch, ck, cuts=1)
        with pytest.warns(ResumeFallbackWarning, match="step_000000020") as w:
            assert ck.restore(state) == 10
        assert _stagings(local) == []
    assert any("checksum" in str(x.message) for x in w), [str(x.message) for x in w]
    assert torch.equal(state["w"], torch.full((256,), 10.0))


def test_a_download_cut_on_every_try_leaves_no_staging_folder(tmp_path, monkeypatch):
    """Every try of step 20's download is cut part-way: the restore gives it up after the
    last try, loudly, for step 10, and the staging folder the tries shared is removed."""
    local, url = _wiped_after_two_saves(tmp_path)
    state = _state(0)
    with Checkpointer(local, remote=url, keep_last=2) as ck:
        gets = _cut(monkeypatch, ck, cuts=3)
        with pytest.warns(ResumeFallbackWarning, match="step_000000020"):
            assert ck.restore(state) == 10
        assert _stagings(local) == []
    assert torch.equal(state["w"], torch.full((256,), 10.0))
    assert len(gets) == 4, gets  # three tries of step 20, then step 10
