"""A roll-back's branches: retention and fallback follow the run's current lineage.

The run saves 20..60, resumes from 40 on purpose (``resume=40``) and saves ``step_000000050-1``:
50 and 60 are abandoned. Retention counted by commit order, kept the abandoned 60 and
deleted 40, the new branch's parent; when ``50-1`` was then found damaged, the fallback
restored the abandoned 60 (a timeline the user threw away) with only a "skipping" warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_callbacks import Checkpointer, ResumeFallbackWarning, branches
from resilient_callbacks.cli import main
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from resilient_callbacks.reader import abandoned, committed
from resilient_callbacks.retention import Candidate, RetentionPolicy, plan


def _st(v: float) -> dict:
    return {"w": torch.full((8,), float(v)), "extra": {"tag": v}}


def _names(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def _flip(path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _rolled_back(root, keep_last=3, then=(50,)) -> None:
    """20..60 saved; resumed from 40; ``then`` saved on the new branch (tag 1000 + step)."""
    with Checkpointer(root, keep_last=keep_last) as ck:
        ck.restore(_st(0))
        for s in (20, 30, 40, 50, 60):
            ck.save(s, _st(s))
    with Checkpointer(root, keep_last=keep_last, resume=40) as ck:
        assert ck.restore(_st(0)) == 40
        for s in then:
            ck.save(s, _st(1000 + s))


def _restore(root) -> tuple[int, object, list[str]]:
    st = _st(0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with Checkpointer(root, keep_last=3) as ck:
            step = ck.restore(st)
    said = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    return step, st["extra"]["tag"], said


def test_after_a_roll_back_retention_keeps_the_parent_and_a_fallback_never_takes_60(tmp_path):
    """The reported gap: keep_last=3 kept 50, 60 (abandoned) and 50-1, deleted 40; a damaged
    50-1 then restored the abandoned 60. Now 40 (the parent) is kept and restored."""
    root = tmp_path / "ck"
    _rolled_back(root)
    assert "step_000000040" in _names(root)  # the new branch's parent
    _flip(root / "step_000000050-1" / "shared.safetensors")
    step, tag, said = _restore(root)
    assert (step, tag) == (40, 40)
    assert len(said) == 1 and "step_000000050-1" in said[0]


def test_the_abandoned_branch_is_deleted_before_the_current_lineage(tmp_path):
    root = tmp_path / "ck"
    _rolled_back(root, then=(50, 60))
    assert _names(root) == ["step_000000040", "step_000000050-1", "step_000000060-1"]
    m = json.loads((root / "step_000000060-1" / "manifest.json").read_text())
    parent = json.loads((root / "step_000000050-1" / "manifest.json").read_text())
    assert m["lineage"]["parent"] == parent["seq"]
    assert m["lineage"]["abandoned"] == parent["lineage"]["abandoned"] != []


def test_only_the_abandoned_branch_left_valid_is_restored_loudly(tmp_path):
    """No valid checkpoint of the current lineage: the abandoned one is used (never a silent
    fresh start), with a warning that says the timeline changes and how to choose."""
    root = tmp_path / "ck"
    _rolled_back(root)
    _flip(root / "step_000000050-1" / "shared.safetensors")
    _flip(root / "step_000000040" / "shared.safetensors")
    step, tag, said = _restore(root)
    assert (step, tag) == (60, 60)
    loud = [s for s in said if "a branch this run abandoned" in s]
    assert len(loud) == 1 and "step_000000060" in loud[0] and "resume=" in loud[0]


def _strip_lineage(root, names: list[str] | None = None) -> None:
    """Make every manifest (of ``names``) one written before the ``lineage`` field existed."""
    for n in _names(root) if names is None else names:
        p = root / n / "manifest.json"
        d = json.loads(p.read_text())
        d.pop("lineage", None)
        d[SELF_CHECKSUM] = self_checksum(d)
        p.write_text(json.dumps(d))


def test_checkpoints_without_the_field_keep_commit_order(tmp_path):
    """Format compatibility: manifests without ``lineage`` read as before (commit order), and
    a save continuing one of them records its lineage from there."""
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)
    _strip_lineage(root)
    _flip(root / "step_000000050-1" / "shared.safetensors")
    step, tag, said = _restore(root)  # the old rule: the next commit, 60
    assert (step, tag) == (60, 60) and not any("a branch this run abandoned" in s for s in said)
    with Checkpointer(root, resume=40) as ck:
        ck.restore(_st(0))
        ck.save(50, _st(2050))  # step_000000050-2: 50, 60 and 50-1 abandoned
    _flip(root / "step_000000050-2" / "shared.safetensors")
    assert _restore(root)[:2] == (40, 40)


def test_a_save_of_a_version_without_the_field_keeps_the_abandoned_branch_abandoned(tmp_path):
    """Downgrade after a roll-back, then upgrade again: an older version resumes the newest
    (50-1) and saves 60-1 without ``lineage`` (as it writes it). Read by commit order, that head
    put 50 and 60 back on the lineage: retention kept 60 over 40, a fallback past 60-1 and 50-1
    restored the abandoned 60, and a save of this version continuing 60-1 recorded nothing
    abandoned, for good. Its save continues the lineage recorded before it."""
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)  # 20..60; resumed from 40; 50-1
    with Checkpointer(root) as ck:  # (the older version's save, stripped below)
        assert ck.restore(_st(0)) == 50
        ck.save(60, _st(1060))
    _strip_lineage(root, ["step_000000060-1"])
    gone = abandoned(committed(str(root)))
    assert gone == {"step_000000050", "step_000000060"}
    policy = RetentionPolicy(keep_last=5)
    cands = [
        Candidate(e.name, e.step, e.seq, e.manifest.run_id, {}, lineage=e.manifest.lineage)
        for e in committed(str(root))
    ]
    assert set(plan(cands, policy, None).delete) == {"step_000000050", "step_000000060"}
    with Checkpointer(root) as ck:  # back on this version
        assert ck.restore(_st(0)) == 60
        ck.save(70, _st(1070))
    m = json.loads((root / "step_000000070" / "manifest.json").read_text())
    assert m["lineage"]["abandoned"] != []
    for n in ("step_000000070", "step_000000060-1", "step_000000050-1"):
        _flip(root / n / "shared.safetensors")
    step, tag, said = _restore(root)
    assert (step, tag) == (40, 40)  # not the abandoned 60
    assert not any("a branch this run abandoned" in s for s in said)


def test_tip_and_off_lineage():
    t = branches.Tip()
    t.rebase(3, {"parent": 2, "abandoned": [[1, 1]]})
    t.planned(7)
    t.planned(9)  # (8: a save that failed, or another run's)
    assert t.child(7) == branches.Lineage(3, ((1, 1), (4, 6)))
    assert t.child(9) == branches.Lineage(7, ((1, 1), (4, 6), (8, 8)))
    fresh = branches.Tip()
    fresh.planned(5)
    assert fresh.child(5) == branches.Lineage(None, ())
    head = t.child(9).to_json()
    items = [("r", s, None) for s in range(1, 9)] + [("r", 9, head), ("o", 5, None)]
    assert branches.off_lineage(items) == {("r", s) for s in (1, 4, 5, 6, 8)}
    with pytest.raises(TypeError):
        branches.Lineage.from_json({"abandoned": [[1, "2"]]})


def test_plan_counts_the_abandoned_as_older():
    line = {"parent": 3, "abandoned": [[4, 5]]}
    cands = [
        Candidate("s20", 20, 1, "r"),
        Candidate("s30", 30, 2, "r"),
        Candidate("s40", 40, 3, "r"),
        Candidate("s50", 50, 4, "r"),
        Candidate("s60", 60, 5, "r"),
        Candidate("s50-1", 50, 6, "r", lineage=line),
    ]
    p = plan(cands, RetentionPolicy(keep_last=2), "r")
    assert sorted(p.keep) == ["s40", "s50-1"] and p.abandoned == {"s50", "s60"}
    p = plan(cands, RetentionPolicy(keep_last=5), "r")  # the lineage's 4, then 60
    assert sorted(p.keep) == ["s20", "s30", "s40", "s50-1", "s60"]
    assert any("abandoned" in why for why in p.keep["s60"])


def test_cli_ls_gc_and_latest_follow_the_lineage(tmp_path):
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)

    def cli(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(list(args)) == 0
        return out.getvalue()

    rows = {r["name"]: r for r in json.loads(cli("ls", str(root), "--json", "--fast"))}
    assert rows["step_000000060"]["abandoned"] and not rows["step_000000040"]["abandoned"]
    cli("gc", str(root), "--keep-last", "2")
    assert _names(root) == ["step_000000040", "step_000000050-1"]


def test_dcp_writer_after_a_load_of_an_older_step(tmp_path):
    """The DCP StorageWriter after a dcp.load of step 3 (4 exists), keep_last=2: it kept the
    abandoned 4 and deleted 3, and a damaged 4-1 then loaded the abandoned 4."""
    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

    root = tmp_path / "ck"
    with ResilientStorageWriter(root, keep_last=2) as w:
        for s in (1, 2, 3, 4):
            dcp.save({"w": torch.full((2,), float(s))}, storage_writer=w, checkpoint_id=s)
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=ResilientStorageReader(root, step=3))
    with ResilientStorageWriter(root, keep_last=2) as w:
        dcp.save({"w": torch.full((2,), 40.0)}, storage_writer=w)  # 4-1: 4 abandoned
    assert _names(root) == ["step_000000003", "step_000000004-1"]
    _flip(root / "step_000000004-1" / "dcp" / "rank_00000.safetensors")
    reader = ResilientStorageReader(root)
    with pytest.warns(ResumeFallbackWarning, match="step_000000004-1"):
        dcp.load(got, storage_reader=reader)
    assert reader.loaded_step == 3 and torch.equal(got["w"], torch.full((2,), 3.0))


def test_dcp_writer_after_a_load_of_a_save_without_the_field(tmp_path):
    """DCP: after a roll-back to 3 (4-1 abandons 4), an older version's save of 5 (no
    ``lineage``), loaded and continued by this version: 4 stays abandoned."""
    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for s in (1, 2, 3, 4):
            dcp.save({"w": torch.full((2,), float(s))}, storage_writer=w, checkpoint_id=s)
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=ResilientStorageReader(root, step=3))
    with ResilientStorageWriter(root) as w:
        dcp.save({"w": torch.full((2,), 40.0)}, storage_writer=w)  # 4-1: 4 abandoned
        dcp.save({"w": torch.full((2,), 50.0)}, storage_writer=w)  # 5 (the older version's)
    _strip_lineage(root, ["step_000000005"])
    dcp.load(got, storage_reader=ResilientStorageReader(root))
    with ResilientStorageWriter(root) as w:
        dcp.save({"w": torch.full((2,), 60.0)}, storage_writer=w)  # 6
    for n in ("step_000000006", "step_000000005", "step_000000004-1"):
        _flip(root / n / "dcp" / "rank_00000.safetensors")
    reader = ResilientStorageReader(root)
    with pytest.warns(ResumeFallbackWarning):
        dcp.load(got, storage_reader=reader)
    assert reader.loaded_step == 3 and torch.equal(got["w"], torch.full((2,), 3.0))


def test_remote_tier_keeps_the_parent_and_falls_back_along_the_lineage(tmp_path):
    """remote_keep_last=3 after a roll-back: the remote kept 50, 60 (abandoned) and 50-1 and
    deleted 40; with the local disk lost and the remote 50-1 damaged, 60 was restored."""
    local, durable = tmp_path / "local", tmp_path / "durable"
    opts = {"keep_last": 1, "remote": str(durable), "remote_keep_last": 3}
    with Checkpointer(local, **opts) as ck:
        ck.restore(_st(0))
        for s in (20, 30, 40, 50, 60):
            ck.save(s, _st(s))
    with Checkpointer(local, resume=40, **opts) as ck:
        assert ck.restore(_st(0)) == 40
        ck.save(50, _st(1050))
    assert "step_000000040" in _names(durable)
    _flip(durable / "step_000000050-r1" / "shared.safetensors")  # (the remote's name)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        main(["pull", str(durable), str(tmp_path / "pulled")])  # skips 50-r1: 40, not 60
    assert _names(tmp_path / "pulled") == ["step_000000040"], err.getvalue()
    for n in _names(local):  # the node's disk is lost
        for f in os.listdir(local / n):
            os.remove(local / n / f)
        os.rmdir(local / n)
    st = _st(0)
    with Checkpointer(local, **opts) as ck, pytest.warns(ResumeFallbackWarning) as rec:
        assert ck.restore(st) == 40
    assert st["extra"]["tag"] == 40
    assert not any("a branch this run abandoned" in str(w.message) for w in rec)


def test_dcp_reader_loads_an_abandoned_checkpoint_only_loudly(tmp_path):
    from resilient_callbacks.dcp import ResilientStorageReader, ResilientStorageWriter

    root = tmp_path / "ck"
    with ResilientStorageWriter(root) as w:
        for s in (1, 2, 3):
            dcp.save({"w": torch.full((2,), float(s))}, storage_writer=w, checkpoint_id=s)
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=ResilientStorageReader(root, step=1))
    with ResilientStorageWriter(root) as w:
        dcp.save({"w": torch.full((2,), 20.0)}, storage_writer=w)  # 2-1: 2 and 3 abandoned
    for n in ("step_000000002-1", "step_000000001"):
        _flip(root / n / "dcp" / "rank_00000.safetensors")
    reader = ResilientStorageReader(root)
    with pytest.warns(ResumeFallbackWarning) as rec:
        dcp.load(got, storage_reader=reader)
    assert reader.loaded_step == 3 and torch.equal(got["w"], torch.full((2,), 3.0))
    loud = [str(w.message) for w in rec if "a branch abandoned" in str(w.message)]
    assert len(loud) == 1 and "step_000000003" in loud[0]


def test_sharded_saves_follow_the_lineage(tmp_path):
    """A Sharded (FSDP/DCP) state in a Checkpointer, one process: resumed from 3 while 4
    exists, keep_last=2 kept the abandoned 4 and deleted 3; a damaged 4-1 then loaded 4."""
    from resilient_callbacks.dcp import Sharded

    root = tmp_path / "ck"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(root, keep_last=2) as ck:
        ck.restore({"train": Sharded(model, opt)})
        for s in (1, 2, 3, 4):
            with torch.no_grad():
                model.weight.fill_(s)
            ck.save(s, {"train": Sharded(model, opt)})
    with Checkpointer(root, keep_last=2, resume=3) as ck:
        assert ck.restore({"train": Sharded(model, opt)}) == 3
        with torch.no_grad():
            model.weight.fill_(40)
        ck.save(4, {"train": Sharded(model, opt)})
    assert _names(root) == ["step_000000003", "step_000000004-1"]
    _flip(root / "step_000000004-1" / "parts" / "train" / "rank_00000.safetensors")
    with Checkpointer(root, keep_last=2) as ck, pytest.warns(ResumeFallbackWarning):
        assert ck.restore({"train": Sharded(model, opt)}) == 3
    assert float(model.weight[0, 0]) == 3.0


def test_keep_best_ranks_the_current_lineage_first():
    """keep_best=1 after a roll-back from 50 (loss 0.1, abandoned) to 40: the abandoned 50 took
    the one "best" slot and the lineage's best, 70 (0.15), was deleted."""
    line = {"parent": 3, "abandoned": [[4, 5]]}
    losses = [(20, 0.5), (30, 0.4), (40, 0.3), (50, 0.1), (60, 0.2)]
    cands = [Candidate(f"s{s}", s, i, "r", {"loss": v}) for i, (s, v) in enumerate(losses, 1)]
    more = [(50, 0.25), (60, 0.2), (70, 0.15), (80, 0.3), (90, 0.3), (100, 0.3)]
    cands += [
        Candidate(f"s{s}-1", s, i, "r", {"loss": v}, lineage=line)
        for i, (s, v) in enumerate(more, 6)
    ]
    policy = RetentionPolicy(keep_last=3, keep_best=1, monitor="loss")
    p = plan(cands, policy, "r")
    assert sorted(p.keep) == ["s100-1", "s70-1", "s80-1", "s90-1"]
    # with the lineage scoring nothing, an abandoned best still fills the slot
    bare = [c if c.name in ("s50", "s60") else dataclasses.replace(c, metrics={}) for c in cands]
    assert "s50" in plan(bare, policy, "r").keep


def test_a_run_going_on_live_keeps_its_lineage(tmp_path):
    """continued_from(same_run=True) (Lightning's fit() again after a fit() that rolled back):
    its saves recorded no parent and abandoned nothing, so the abandoned 50 and 60 rejoined the
    lineage; keep_last=5 then kept them and deleted 40, and damaged new saves restored 60."""
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)
    with Checkpointer(root, keep_last=5) as ck:
        ck.continued_from(50, "fit() again", same_run=True)
        ck.save(60, _st(1060))
        ck.save(70, _st(1070))
    assert "step_000000040" in _names(root)
    for n in ("step_000000070", "step_000000060-1", "step_000000050-1"):
        _flip(root / n / "shared.safetensors")
    assert _restore(root)[:2] == (40, 40)


def test_latest_path_is_the_current_lineages(tmp_path):
    """Checkpointer.latest_path (the DeepSpeed adapter's, and the run continued_from(same_run)
    goes on) took the highest commit number: with 50-1 truncated, the abandoned 60."""
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)
    with open(root / "step_000000050-1" / "shared.safetensors", "r+b") as f:
        f.truncate(10)
    with Checkpointer(root, read_only=True) as ck:
        assert ck.latest_path is not None and ck.latest_path.endswith("step_000000040")


def test_gc_remove_corrupt_keeps_a_damaged_head_that_records_the_roll_back(tmp_path, capsys):
    """gc --remove-corrupt deleted the damaged 50-1, the only manifest saying 50 and 60 were
    abandoned: 60 was the run's newest again and the next resume took it silently, 40 valid."""
    root = tmp_path / "ck"
    _rolled_back(root, keep_last=None)
    with open(root / "step_000000050-1" / "shared.safetensors", "r+b") as f:
        f.truncate(10)
    assert main(["gc", str(root), "--remove-corrupt"]) == 0
    assert "records that a roll-back abandoned" in capsys.readouterr().err
    assert _restore(root)[:2] == (40, 40)
    # with the abandoned ones deleted first (they count as older), it goes too
    assert main(["gc", str(root), "--remove-corrupt", "--keep-last", "3"]) == 0
    assert _names(root) == ["step_000000020", "step_000000030", "step_000000040"]


def test_remote_gc_remove_corrupt_keeps_a_damaged_head_that_records_the_roll_back(tmp_path):
    """The same in the remote tier: gc --remote URL --remove-corrupt deleted the damaged 50-r1,
    and a resume from the remote (the local disk lost) took the abandoned 60 silently."""
    local, durable = tmp_path / "local", tmp_path / "durable"
    opts = {"keep_last": 1, "remote": str(durable), "remote_keep_last": "all"}
    with Checkpointer(local, **opts) as ck:
        ck.restore(_st(0))
        for s in (20, 30, 40, 50, 60):
            ck.save(s, _st(s))
    with Checkpointer(local, resume=40, **opts) as ck:
        ck.restore(_st(0))
        ck.save(50, _st(1050))
    with open(durable / "step_000000050-r1" / "shared.safetensors", "r+b") as f:
        f.truncate(10)
    shutil.rmtree(local)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["gc", str(local), "--remote", str(durable), "--remove-corrupt"]) == 0
    assert "step_000000050-r1" in _names(durable) and "records that a roll-back" in out.getvalue()
    st = _st(0)
    with Checkpointer(local, **opts) as ck, pytest.warns(ResumeFallbackWarning):
        assert ck.restore(st) == 40
