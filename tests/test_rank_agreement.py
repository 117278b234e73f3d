"""What one rank finds, every rank raises (or none does): no rank raises alone while the others
wait for it in their next collective until the process group's timeout.

Two gloo ranks, one spawn running the cases in turn (this file is the worker: ``python
test_rank_agreement.py worker DIR OUT CASE...``), each case in its own directory, each outcome
(an error's type and message, or what the call returned) written per rank; a barrier after each
case. The process group's timeout (900 s) is far above the spawn deadline: a rank left waiting
in a collective fails the test by the deadline.

- ``retention-sync``, ``retention-background``: rank 0's retention pass after the commit of
  step 2 fails (its directory cannot be listed: ``chmod 0o300``, as root with the capabilities
  that bypass permission bits dropped, tests/permissions.py). It raised on rank 0 alone (a
  synchronous save; ``flush()`` after a background one), then on every rank, which stopped
  the run over a checkpoint that was committed and valid. Now no rank raises: rank 0 says it
  once, every rank counts the save as committed and keeps the failure (``after_commit_error``,
  the metric ``after_commit_failures_total``), and learns it from the commit's outcome
  broadcast (no collective of its own): after_commit_work.py.
- ``restore-held``: a background save's failure that rank 1 alone holds (its account of the
  committed save failed) was raised by rank 1's ``restore()`` before restore's collectives,
  while rank 0 went on into them. Now every rank raises, rank 0 naming rank 1.
- ``final-held``: the same failure, held by rank 1 alone at a final save of the step saved last
  (``save(2, final=True)``, as the DeepSpeed launcher's end): rank 1 raised it while rank 0
  returned and went on into what follows (an adapter's collectives, close's). Now every rank
  raises, rank 0 naming rank 1.
- ``listing-no-manifest``, ``listing-subdir``: with ``filterwarnings("error")`` on every rank, a
  restore's notice about what rank 0 listed (a ``step_*`` folder without a manifest; nothing to
  resume from where a subdirectory holds checkpoints) raised on rank 0 alone, before restore's
  collectives, while rank 1 waited in them. Now every rank raises it.
- ``load-notice``: an adapter's notice about what rank 1 alone loaded (``load_notices``: the
  Transformers Trainer's best checkpoint gone from that node's disk), with
  ``filterwarnings("error")`` on every rank: said after the restore, it raised on rank 1 alone
  while rank 0 went on. Now it is rank 1's failure in restore's outcome exchange: rank 1
  raises it, rank 0 a ``CheckpointMismatchError`` naming rank 1.
- ``foreign-restore``, ``foreign-save``: with ``filterwarnings("error")`` on every rank, rank 0's
  ``ForeignCheckpointsWarning`` (another run's checkpoints in the directory) at a restore (before
  its last broadcast) and at a new run's first save (before the save's collectives) raised on
  rank 0 alone while rank 1 waited. Now the restore's is said by every rank, and the save's is
  rank 0's failure of that save, which every rank raises. ``foreign-sync``: the same save,
  synchronous (its commit's message read "...what it would delete).. Nothing was committed").
- ``continued-new``, ``continued-same-run``, ``continued-restored``: with
  ``filterwarnings("error")`` on every rank, ``continued_from(2, ...)`` where dirpath holds a
  newer checkpoint (step 5): its warning raised on rank 0 alone, while rank 1 went on into the
  new run's broadcast (``continued-new``; ``continued-same-run``: ``same_run=True``) or, after a
  ``restore()`` that returned 0 (``continued-restored``), returned and went on into its first
  save's collectives. Now every rank raises it.
- ``unlistable-continued``: rank 0 cannot list dirpath (``chmod 0o300``, tests/permissions.py)
  when ``continued_from(2, ...)`` is called: its listing for a newer checkpoint raised on rank 0
  alone, before the broadcast that tells every rank the new run's id, and rank 1 waited there
  (then paired it with rank 0's next collective). Now every rank raises, rank 1 naming rank 0's
  error.
- ``shared-store``: with ``filterwarnings("error")`` on every rank, under torchrun's variables
  of a restarting job over a shared rendezvous store, the Checkpointer's warning about it
  raised in rank 0's constructor alone, while rank 1 went on into ``restore()``'s broadcast.
  Now every rank raises it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import permissions
import spawn_ranks
from resilient_callbacks import Checkpointer, catalog
from resilient_callbacks.metrics import PREFIX

WORLD = 2
RNG_NOTICE = "the checkpoint was saved without RNG states"
STEP_NOTICE = "step\\(\\) went back from step 5 to 3"


def _outcome(call: Any) -> Any:
    try:
        return {"returned": call()}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}


def _two_saves_rank_1_fails_the_second(ck: Checkpointer, state: Any, rank: int) -> None:
    """Background saves of steps 1 and 2, rank 1's account of step 2 failing (held)."""
    real = ck._recorder.committed

    def committed(step: int, *args: Any) -> None:
        if rank == 1 and step == 2:
            raise OSError(5, "Input/output error")
        real(step, *args)

    ck._recorder.committed = committed  # type: ignore[method-assign]
    ck.save(1, state)
    ck.save(2, state)


def _final_held(root: Path, rank: int) -> dict[str, Any]:
    state = {"model": nn.Linear(4, 4)}
    with Checkpointer(root, async_save=True) as ck:
        _two_saves_rank_1_fails_the_second(ck, state, rank)
        out = {"final": _outcome(lambda: ck.save(2, state, final=True))}
        out["again"] = _outcome(lambda: ck.save(2, state, final=True))  # (raised once)
    return out


class _Errors(logging.Handler):
    """The ERROR lines of the library, as said."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _retention(root: Path, rank: int, background: bool) -> dict[str, Any]:
    """Rank 0's directory cannot be listed (chmod 0o300) while step 2 commits: the retention
    pass after that commit fails, really. ``denied``: whether it could be made so (rank 0)."""
    res: dict[str, Any] = {"denied": False}
    state = {"model": nn.Linear(4, 4)}
    errors = _Errors()
    logging.getLogger("resilient_callbacks").addHandler(errors)
    # (its threads, started in it, obey permission bits too: the background save's)
    with permissions.honoured() as ok, Checkpointer(root, async_save=background, keep_last=1) as ck:
        ck.save(1, state)
        ck.flush()  # (step 1's pass is done)
        if rank == 0:
            res["denied"] = ok and permissions.unlistable(root)
        res["save2"] = _outcome(lambda: ck.save(2, state))
        res["flush"] = _outcome(ck.flush)
        if rank == 0:
            os.chmod(root, 0o755)
        res["error2"] = ck.after_commit_error
        res["failures"] = ck.metrics()[PREFIX + "after_commit_failures_total"]
        res["save3"] = _outcome(lambda: ck.save(3, state))
        res["flush3"] = _outcome(ck.flush)
        res["error3"] = ck.after_commit_error
        res["committed_saves"] = ck._saver.committed_saves
    logging.getLogger("resilient_callbacks").removeHandler(errors)
    res["said"] = [m for m in errors.said if "work after the commit failed" in m]
    res["steps"] = [e.step for e in catalog.committed(catalog.scan(str(root), catalog.Depth.FULL))]
    return res


def _restore_held(root: Path, rank: int) -> dict[str, Any]:
    state = {"model": nn.Linear(4, 4)}
    with Checkpointer(root, async_save=True) as ck:
        _two_saves_rank_1_fails_the_second(ck, state, rank)
        out = {"restore": _outcome(lambda: ck.restore(state))}
        out["again"] = _outcome(lambda: ck.restore(state))  # (raised once: the next one loads)
    return out


def _werror(root: Path, rank: int, on: int) -> dict[str, Any]:
    with Checkpointer(root, capture_rng=False, async_save=False) as ck:
        ck.save(1, {"model": nn.Linear(2, 2)})
    with warnings.catch_warnings():
        if rank == on:
            warnings.filterwarnings("error", message=RNG_NOTICE)
        with Checkpointer(root) as ck:
            return {"restore": _outcome(lambda: ck.restore({"model": nn.Linear(2, 2)}))}


def _werror_step(root: Path, rank: int, on: int) -> dict[str, Any]:
    state = {"w": torch.zeros(2)}
    with warnings.catch_warnings(), Checkpointer(root, every_n_steps=100) as ck:
        if rank == on:
            warnings.filterwarnings("error", message=STEP_NOTICE)
        ck.step(5, state)
        return {"step": _outcome(lambda: ck.step(3, state))}


def _werror_listing(root: Path) -> dict[str, Any]:
    with warnings.catch_warnings(), Checkpointer(root) as ck:
        warnings.filterwarnings("error")  # (the same on every rank)
        return {"restore": _outcome(lambda: ck.restore({"model": nn.Linear(2, 2)}))}


def _load_notice(root: Path, rank: int) -> dict[str, Any]:
    state = {"model": nn.Linear(2, 2)}
    with Checkpointer(root, async_save=False) as ck:
        ck.save(1, state)
    with warnings.catch_warnings(), Checkpointer(root) as ck:
        ck.load_notices = lambda: ["rank 1: its own notice"] if rank == 1 else []
        warnings.filterwarnings("error")  # (the same on every rank)
        return {"restore": _outcome(lambda: ck.restore(state))}


def _werror_foreign(root: Path, restore: bool, background: bool = True) -> dict[str, Any]:
    state = {"model": nn.Linear(2, 2)}
    resume = "auto" if restore else "never"  # (no RNG states: the checkpoints are of one rank)
    kw = {"resume": resume, "capture_rng": False, "async_save": background}
    with warnings.catch_warnings(), Checkpointer(root, **kw) as ck:
        warnings.filterwarnings("error")  # (the same on every rank)
        call = (lambda: ck.restore(state)) if restore else (lambda: ck.save(3, state))
        return {"call": _outcome(call)}


def _werror_continued(root: Path, case: str) -> dict[str, Any]:
    resume = "never" if case == "continued-restored" else "auto"
    with warnings.catch_warnings(), Checkpointer(root, resume=resume, capture_rng=False) as ck:
        if case == "continued-restored":
            ck.restore({"model": nn.Linear(2, 2)})  # (returns 0: resume="never")
        warnings.filterwarnings("error")  # (the same on every rank)
        same_run = case == "continued-same-run"
        return {"call": _outcome(lambda: ck.continued_from(2, "elsewhere", same_run=same_run))}


def _unlistable_continued(root: Path, rank: int) -> dict[str, Any]:
    """Rank 0's dirpath cannot be listed at ``continued_from``. ``denied``: whether it could
    be made so (rank 0)."""
    res: dict[str, Any] = {"denied": False}
    with permissions.honoured() as ok, Checkpointer(root, capture_rng=False) as ck:
        if rank == 0:
            res["denied"] = ok and permissions.unlistable(root)
        try:
            res["call"] = _outcome(lambda: ck.continued_from(2, "elsewhere"))
        finally:
            if rank == 0:
                os.chmod(root, 0o755)
    return res


def _werror_shared_store(root: Path) -> dict[str, Any]:
    store = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}
    os.environ.update(store)  # (as torchrun sets them on every worker)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error")  # (the same on every rank)

            def made_and_restored() -> int:
                with Checkpointer(root) as ck:
                    return ck.restore({"model": nn.Linear(2, 2)})

            return {"call": _outcome(made_and_restored)}
    finally:
        for k in store:
            del os.environ[k]


def worker(root: str, out: str, cases: list[str]) -> None:
    import torch.distributed as dist

    # far above the spawn deadline: a rank left waiting in a collective fails the test
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    torch.manual_seed(0)
    res: dict[str, Any] = {}
    for case in cases:
        where = Path(root) / case
        if case.startswith("retention-"):
            res[case] = _retention(where, rank, case.endswith("background"))
        elif case == "restore-held":
            res[case] = _restore_held(where, rank)
        elif case == "final-held":
            res[case] = _final_held(where, rank)
        elif case == "mixed-once":
            with Checkpointer(where) as ck:
                res[case] = _outcome(lambda: ck.restore({"model": nn.Linear(2, 2)}))
        elif case.startswith("foreign-"):
            res[case] = _werror_foreign(where, case == "foreign-restore", case != "foreign-sync")
        elif case == "load-notice":
            res[case] = _load_notice(where, rank)
        elif case.startswith("listing-"):
            res[case] = _werror_listing(where)
        elif case == "shared-store":
            res[case] = _werror_shared_store(where)
        elif case == "unlistable-continued":
            res[case] = _unlistable_continued(where, rank)
        elif case.startswith("continued-"):
            res[case] = _werror_continued(where, case)
        elif case.startswith("werror-step-"):
            res[case] = _werror_step(where, rank, int(case[-1]))
        elif case.startswith("werror-"):
            res[case] = _werror(where, rank, int(case[-1]))
        dist.barrier()  # a rank that went on alone waits here (or in the next case)
        print(f"CASE {case}: done", file=sys.stderr, flush=True)
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

CASES = [
    "retention-sync",
    "retention-background",
    "restore-held",
    "final-held",
    "listing-no-manifest",
    "listing-subdir",
    "load-notice",
    "foreign-restore",
    "foreign-save",
    "foreign-sync",
    "continued-new",
    "continued-same-run",
    "continued-restored",
    "shared-store",
    "unlistable-continued",
]
CONTINUED = [c for c in CASES if c.startswith("continued-")]


def _run(tmp_path: Path, cases: list[str]) -> list[dict[str, Any]]:
    if "mixed-once" in cases:  # a checkpoint of one rank, without RNG states
        with Checkpointer(tmp_path / "ckpt" / "mixed-once", capture_rng=False) as ck:
            ck.save(1, {"model": nn.Linear(2, 2)})
    if "listing-no-manifest" in cases:  # a step_* folder without a manifest
        (tmp_path / "ckpt" / "listing-no-manifest" / "step_000000005").mkdir(parents=True)
    if "listing-subdir" in cases:  # nothing to resume from; a subdirectory holds checkpoints
        with Checkpointer(tmp_path / "ckpt" / "listing-subdir" / "run1") as ck:
            ck.save(1, {"model": nn.Linear(2, 2)})
    for case in ("foreign-restore", "foreign-save", "foreign-sync"):  # two runs' checkpoints
        if case in cases:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the second run's save says the first's)
                for step in (1, 2):
                    with Checkpointer(tmp_path / "ckpt" / case, resume="never") as ck:
                        ck.save(step, {"model": nn.Linear(2, 2)})
    for case in CONTINUED:  # a newer checkpoint than the step the run continues from
        if case in cases:
            with Checkpointer(tmp_path / "ckpt" / case, capture_rng=False) as ck:
                ck.save(5, {"model": nn.Linear(2, 2)})
    out = tmp_path / "result"
    argv = [sys.executable, __file__, "worker", str(tmp_path / "ckpt"), str(out), *cases]
    spawn_ranks.run(
        argv, WORLD, tmp_path, "agree", deadline=90.0, zygote=spawn_ranks.shared_zygote()
    )
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORLD)]


def _check_retention(res: dict[str, Any], rank: int) -> None:
    """Training goes on: no rank raised; every rank kept and counted rank 0's failure, which
    rank 0 alone said, once; the next save's pass deleted what was kept and cleared it."""
    assert res["save2"] == {"returned": True} and res["flush"] == {"returned": None}, res
    error = res["error2"]
    assert error is not None and error.startswith("checkpoint for step 2 was committed ("), res
    assert "then rank 0's work after the commit failed: PermissionError" in error, res
    assert res["failures"] == 1, res
    assert len(res["said"]) == (1 if rank == 0 else 0), res["said"]
    assert res["save3"] == {"returned": True} and res["flush3"] == {"returned": None}, res
    assert res["error3"] is None and res["committed_saves"] == 3, res
    assert res["steps"] == [3], res  # (the next save's retention deleted what was kept)


def _check_restore_held(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    assert r1["restore"]["error"] == "OSError", r1
    assert "Input/output error" in r1["restore"]["message"], r1
    assert r0["restore"]["error"] == "CheckpointWriteError", r0
    assert "an earlier background save failed on rank(s) 1" in r0["restore"]["message"], r0
    assert "restore() was not attempted on any rank" in r0["restore"]["message"], r0
    assert r0["again"] == r1["again"] == {"returned": 2}, (r0, r1)


def _check_final_held(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    assert r1["final"]["error"] == "OSError", r1
    assert "Input/output error" in r1["final"]["message"], r1
    assert r0["final"].get("error") == "CheckpointWriteError", r0
    said = r0["final"]["message"]
    assert "the final save of step 2 was not attempted on any rank" in said, said
    assert "an earlier background save failed on rank(s) 1" in said, said
    assert r0["again"] == r1["again"] == {"returned": False}, (r0, r1)


def test_what_one_rank_finds_is_raised_on_every_rank(tmp_path):
    r0, r1 = _run(tmp_path, CASES)
    denied = r0["retention-sync"]["denied"] and r0["retention-background"]["denied"]
    for rank, res in enumerate((r0, r1) if denied else ()):  # (else skipped below)
        _check_retention(res["retention-sync"], rank)
        _check_retention(res["retention-background"], rank)
    _check_restore_held(r0["restore-held"], r1["restore-held"])
    _check_final_held(r0["final-held"], r1["final-held"])
    for case, said in (
        ("listing-no-manifest", "step_000000005 has no manifest.json, so it is not a checkpoint"),
        ("listing-subdir", "these subdirectories hold checkpoints: run1 (1)"),
    ):
        assert r0[case] == r1[case], (r0[case], r1[case])  # (the same text, on every rank)
        assert r0[case]["restore"]["error"] == "UserWarning", r0[case]
        assert said in r0[case]["restore"]["message"], r0[case]
    for r in (r0, r1):
        assert r["foreign-restore"]["call"]["error"] == "ForeignCheckpointsWarning", r
        assert "holds 1 checkpoint(s) of 1 other run(s)" in r["foreign-restore"]["call"]["message"]
        for case in ("foreign-save", "foreign-sync"):  # (a background save, a synchronous)
            assert r[case]["call"]["error"] == "CheckpointWriteError", r
            said = r[case]["call"]["message"]
            assert "failed on rank(s) 0: rank 0: ForeignCheckpointsWarning:" in said, said
            # (the warning's own full stop ends the sentence: it read "...delete).. Nothing")
            assert "would delete). Nothing was committed and older checkpoints" in said, said
    assert r0["foreign-restore"] == r1["foreign-restore"]
    assert r1["load-notice"]["restore"] == {
        "error": "UserWarning",
        "message": "rank 1: its own notice",
    }
    assert r0["load-notice"]["restore"] == {
        "error": "CheckpointMismatchError",
        "message": "restore failed on rank 1: UserWarning: rank 1: its own notice",
    }
    for case in CONTINUED:
        assert r0[case] == r1[case], (case, r0[case], r1[case])  # (every rank raises)
        assert r0[case]["call"]["error"] == "UserWarning", (case, r0[case])
        said = r0[case]["call"]["message"]
        assert "elsewhere continues this run from step 2, but" in said, said
        assert "holds a newer checkpoint" in said and "(step 5)" in said, said
    assert r0["shared-store"] == r1["shared-store"], (r0["shared-store"], r1["shared-store"])
    assert r0["shared-store"]["call"]["error"] == "UserWarning", r0["shared-store"]
    assert "rendezvous store, which outlives a restart" in r0["shared-store"]["call"]["message"]
    if r0["unlistable-continued"]["denied"]:
        call0, call1 = r0["unlistable-continued"]["call"], r1["unlistable-continued"]["call"]
        assert call0["error"] == "PermissionError", call0
        assert call1["error"] == "CheckpointError", call1
        said = call1["message"]
        assert said.startswith("continued_from() stopped on every rank: rank 0 could not"), said
        assert "(PermissionError: [Errno 13] Permission denied" in said, said
    if not denied:  # (every other case checked)
        pytest.skip("rank 0 could not make its directory unlistable (permission bits ignored)")
