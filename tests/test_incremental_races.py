"""Orders of events in which a kept incremental checkpoint could lose a blob it needs: a
collection of the blob store by the uploader's retention (another thread) while a save commits,
and the like. Each test runs the real code and forces the interleaving at the moment it matters
(no sleeps)."""

from __future__ import annotations

import threading

import torch

from resilient_callbacks import Checkpointer, catalog, session
from test_part_blobs import FrozenAndTrained, _train


def _in_another_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_collection_while_a_save_commits_keeps_the_part_blobs_it_promoted(tmp_path, monkeypatch):
    """With a remote tier, the uploader's retention collects the blob store in its own thread
    whenever an upload lets it delete a checkpoint, while the persist thread commits the next
    save. The blobs the ranks of that save staged are moved into the store before its manifest
    is written; a collection between the two must not take them (the committed checkpoint
    would name a deleted blob, found only at restore)."""
    root = tmp_path / "ck"
    part = FrozenAndTrained()
    real = session.promote_staged
    with Checkpointer(root, keep_last=1, incremental=True, preemption=False) as ck:

        def promote_then_collect(staging, dirpath, manifest):
            real(staging, dirpath, manifest)
            _in_another_thread(ck._dir.blobs.collect)  # the uploader's retention, now

        _train(part, 1)
        ck.save(1, {"engine": part})
        ck.flush()
        monkeypatch.setattr(session, "promote_staged", promote_then_collect)
        _train(part, 2)
        ck.save(2, {"engine": part})
        ck.flush()
    found = catalog.committed(catalog.scan(str(root), catalog.Depth.FULL))
    assert [(e.name, e.status, e.problem) for e in found] == [
        ("step_000000002", catalog.Status.VALID, None)
    ]
    fresh = FrozenAndTrained()
    with Checkpointer(root, preemption=False) as ck:
        assert ck.restore({"engine": fresh}) == 2
    assert torch.equal(fresh.trained, part.trained)
