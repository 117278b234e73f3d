"""peers.exchange in pieces: whatever fails on one end in the middle of a file, both ends finish
the exchange together (no end waits in a receive the other never sends).

Two gloo ranks, each the leader of a node in a ring of two: each sends its own checkpoint
folder to the other and receives the other's, in pieces of 256 bytes (a file of 4 KiB is 16
pieces), one spawn running the cases in turn (this file is the worker: ``python
test_peers_pieces.py worker DIR OUT CASE...``); a barrier after each case. The process
group's timeout (900 s) is far above the spawn deadline: a rank left waiting in a receive fails
the test by the deadline.

- ``whole``: both copies arrive, bit-exact.
- ``shrinks``: rank 0's tensor file shrinks on its disk after its size was sent (its fourth
  piece ends early): rank 0 sends a marker in place of each piece left; both raise naming
  rank 0, rank 1 keeps nothing of it; rank 0 still stores rank 1's copy.
- ``store-fails``: rank 1's disk fails while it writes its third piece of a file: it receives
  the rest all the same; both raise naming rank 1.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, peers

WORLD = 2
PIECE = 256
TENSOR_FILE_MIN = 4096  # the state below: 1024 float32 (its tensor file holds 4 KiB at least)


def _outcome(call: Any) -> dict[str, Any]:
    try:
        return {"returned": call()}
    except Exception as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "ranks": list(getattr(e, "failed_ranks", ())),
        }


def _biggest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _case(root: Path, rank: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    mine = root / f"node{rank}" / "step_000000001"
    into = root / f"replicas{rank}"
    real_read, real_write = peers._read_piece, peers.write_all
    big = _biggest(mine)
    reads: list[int] = []
    writes: list[int] = []

    def read_piece(fh: Any, buf: memoryview) -> memoryview:
        reads.append(len(buf))
        if case == "shrinks" and rank == 0 and fh.name == str(big) and fh.tell() == 3 * PIECE:
            os.truncate(fh.name, fh.tell() + 10)  # the file on the disk shrinks: a real short read
        return real_read(fh, buf)

    def write_all(fh: Any, data: Any) -> None:
        writes.append(len(data))
        if case == "store-fails" and rank == 1 and len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fh, data)

    peers._read_piece, peers.write_all = read_piece, write_all  # type: ignore[assignment]
    try:
        other = 1 - rank
        res = _outcome(lambda: peers.exchange(str(mine), other, other, str(into), None))
    finally:
        peers._read_piece, peers.write_all = real_read, real_write  # type: ignore[assignment]
    res["pieces_read"] = len(reads)
    res["largest_piece"] = max(reads, default=0)
    kept = sorted(p.name for p in into.iterdir()) if into.exists() else []
    res["kept"] = kept
    if "step_000000001" in kept:  # what arrived is the other node's folder, byte for byte
        theirs = root / f"node{other}" / "step_000000001"
        got = into / "step_000000001"
        res["same"] = all(
            (got / p.relative_to(theirs)).read_bytes() == p.read_bytes()
            for p in theirs.rglob("*")
            if p.is_file()
        )
    dist.barrier()
    return res


def worker(root: str, out: str, cases: list[str]) -> None:
    import torch.distributed as dist

    # far above the spawn deadline: a rank left waiting in a receive fails the test
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    peers.CHUNK_BYTES = PIECE
    res = {case: _case(Path(root) / case, rank, case) for case in cases}
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    spawn_ranks.leave_group()


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "worker":
    try:
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

import pytest  # noqa: E402  (after the worker code, which does not need it)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES = ["whole", "shrinks", "store-fails"]


def _run(tmp_path: Path) -> list[dict[str, Any]]:
    root = tmp_path / "ckpt"
    for case in CASES:
        for node in range(WORLD):  # each node's own checkpoint, its values its own
            with Checkpointer(root / case / f"node{node}", async_save=False) as ck:
                ck.save(1, {"w": torch.arange(1024, dtype=torch.float32) + node})
            big = _biggest(root / case / f"node{node}" / "step_000000001")
            assert big.stat().st_size >= TENSOR_FILE_MIN, big  # many pieces of PIECE bytes
    out = tmp_path / "result"
    argv = [sys.executable, __file__, "worker", str(root), str(out), *CASES]
    spawn_ranks.run(
        argv, WORLD, tmp_path, "peers", deadline=90.0, zygote=spawn_ranks.shared_zygote()
    )
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]


def test_a_failure_in_the_middle_of_a_file_ends_the_exchange_on_both_ends(tmp_path):
    r0, r1 = _run(tmp_path)
    for res in (r0["whole"], r1["whole"]):
        assert res["returned"] and res["kept"] == ["step_000000001"] and res["same"], res
        assert res["largest_piece"] == PIECE and res["pieces_read"] > 16, res
    # rank 0's file shrank while it was sent: both raise naming rank 0; rank 1 keeps nothing
    for res in (r0["shrinks"], r1["shrinks"]):
        assert res.get("error") == "CheckpointWriteError" and res["ranks"] == [0], res
    assert "rank 0 could not send step_000000001" in r0["shrinks"]["message"], r0
    assert "while being sent (changed?)" in r0["shrinks"]["message"], r0
    assert r1["shrinks"]["kept"] == [], r1
    assert r0["shrinks"]["kept"] == ["step_000000001"] and r0["shrinks"]["same"], r0
    # rank 1's disk failed in the middle of a file: both raise naming rank 1
    for res in (r0["store-fails"], r1["store-fails"]):
        assert res.get("error") == "CheckpointWriteError" and res["ranks"] == [1], res
        assert "No space left on device" in res["message"], res
    assert r1["store-fails"]["kept"] == [], r1
    assert r0["store-fails"]["kept"] == ["step_000000001"] and r0["store-fails"]["same"], r0
