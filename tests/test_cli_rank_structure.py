"""``resilient-ckpt verify`` and ``ls`` over a real checkpoint of two gloo ranks whose per-rank
structure file (``rank_00001.json``) is damaged: none may call it valid.

The checkpoint directory is written once by two ranks (this file is the worker: ``python
test_cli_rank_structure.py worker DIR``), steps 1 and 2, each rank with its own ``PerRank``
state; each test damages a copy of step 2's ``rank_00001.json``. A structure file that every
checksum passes but that no restore of rank 1 can read (a writer's bug, a tool's edit: resealed
in the manifest) was reported healthy by both commands. ``ls --fast`` checks the per-rank files'
sizes only (it reads no file per rank): a damage of the same size is "not verified" there.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import spawn_ranks
from resilient_callbacks.manifest import SELF_CHECKSUM, self_checksum
from test_cli import cli

DAMAGED = "step_000000002"
RANK_FILE = "rank_00001.json"


def worker(root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from resilient_callbacks import Checkpointer, PerRank

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    state = {"model": nn.Linear(4, 4), "mine": PerRank({"r": rank, "t": torch.full((3,), rank)})}
    with Checkpointer(root, async_save=False, keep_last=None) as ck:
        for s in (1, 2):
            ck.save(s, state)
    spawn_ranks.leave_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("two_ranks")
    root = str(work / "ck")
    argv = [sys.executable, __file__, "worker", root]
    # each rank forked from the session's zygote: torch imported once, not twice per run
    spawn_ranks.run(argv, 2, work, "save", deadline=120, zygote=spawn_ranks.shared_zygote())
    assert os.path.exists(os.path.join(root, DAMAGED, RANK_FILE))
    return root


def _reseal(ckpt: str, content: bytes) -> None:
    """``rank_00001.json`` replaced by ``content``, its manifest entry and the manifest's own
    checksum made to match: every checksum passes."""
    import xxhash

    Path(ckpt, RANK_FILE).write_bytes(content)
    path = os.path.join(ckpt, "manifest.json")
    m = json.loads(Path(path).read_text())
    entry = next(e for e in m["files"] if e["path"] == RANK_FILE)
    entry.update(size=len(content), xxh3_64=xxhash.xxh3_64_hexdigest(content))
    m[SELF_CHECKSUM] = self_checksum(m)
    Path(path).write_text(json.dumps(m))


def _unlisted(ckpt: str) -> None:
    """The manifest lists no ``rank_00001.json`` (its entry dropped, the file gone, resealed):
    a world of 2 whose rank 1 no restore can load; every listed file passes every check."""
    os.remove(os.path.join(ckpt, RANK_FILE))
    path = os.path.join(ckpt, "manifest.json")
    m = json.loads(Path(path).read_text())
    m["files"] = [e for e in m["files"] if e["path"] != RANK_FILE]
    m[SELF_CHECKSUM] = self_checksum(m)
    Path(path).write_text(json.dumps(m))


def _rank0_as_rank1(ckpt: str) -> bytes:
    return Path(ckpt, "rank_00000.json").read_bytes()


def _same_size_garbage(ckpt: str) -> None:
    p = Path(ckpt, RANK_FILE)
    p.write_bytes(b"#" * p.stat().st_size)


DAMAGES = {
    # resealed: every checksum matches
    "list": (lambda c: _reseal(c, b"[1, 2]"), "not a structure file (a JSON list"),
    "not-json": (lambda c: _reseal(c, b"{not json"), "unreadable JSON"),
    "rank-0's": (
        lambda c: _reseal(c, _rank0_as_rank1(c)),
        "the structure of rank 0, not of rank 1",
    ),
    "per-rank": (lambda c: _reseal(c, b'{"rank": 1, "per_rank": [1]}'), "malformed per-rank"),
    "unlisted": (_unlisted, "lists no rank_00001.json although rank 1 of the 2"),
    # not resealed: found by the checks of every file the manifest lists
    "same-size": (_same_size_garbage, "checksum mismatch"),
    "missing": (lambda c: os.remove(os.path.join(c, RANK_FILE)), "listed in the manifest but"),
    "truncated": (lambda c: os.truncate(os.path.join(c, RANK_FILE), 10), "truncated"),
}


@pytest.mark.parametrize("how", list(DAMAGES))
def test_verify_and_ls_call_a_damaged_rank_structure_file_corrupt(two_ranks, tmp_path, how):
    root = str(tmp_path / "ck")
    shutil.copytree(two_ranks, root)
    assert cli("verify", root, "--all").returncode == 0
    damage, said = DAMAGES[how]
    damage(os.path.join(root, DAMAGED))
    r = cli("verify", root)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [x for x in r.stdout.splitlines() if DAMAGED in x]
    assert lines and all(x.startswith("CORRUPT") for x in lines), r.stdout
    assert RANK_FILE in r.stdout and said in r.stdout, r.stdout
    for flags in ([], ["--fast"]):
        rows = {x["name"]: x for x in json.loads(cli("ls", root, "--json", *flags).stdout)}
        assert rows["step_000000001"]["status"] != "corrupt", rows
        if flags and how not in ("missing", "truncated"):  # the sizes match
            assert rows[DAMAGED]["status"] == "unverified", rows[DAMAGED]
            continue
        assert rows[DAMAGED]["status"] == "corrupt", (flags, rows[DAMAGED])
        assert RANK_FILE in rows[DAMAGED]["problem"] and said in rows[DAMAGED]["problem"]
    r = cli("verify", root, "--step", "1")
    assert r.returncode == 0, r.stdout


if __name__ == "__main__" and sys.argv[1] == "worker":
    worker(sys.argv[2])
