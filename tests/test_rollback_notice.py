"""A roll-back its process did not keep: ``resume="auto"`` names it when it restores the newest.

A run saves 20..60; a process resumes from 40 (``resume=40``) and is killed before its first
save. The next ``resume="auto"`` restores 60, the newest committed checkpoint (the resume rule),
but said nothing, though the user had rolled back to 40: now a ``ResumeFallbackWarning`` says
so and how to roll back again. A plain crash-resume (a restart at the newest step) or a
roll-back that saved is not named.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

import spawn_ranks
from resilient_callbacks import Checkpointer, ResumeFallbackWarning

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _st(v: float) -> dict:
    return {"w": torch.full((8,), float(v)), "extra": {"tag": v}}


def _saved(root) -> None:
    with Checkpointer(root) as ck:
        ck.restore(_st(0))
        for s in (20, 30, 40, 50, 60):
            ck.save(s, _st(s))


def _killed_after(root, resume, saves=()) -> None:
    """A real process: restore with ``resume``, save ``saves``, then die (no close, no end).
    Forked from the test session's zygote that imported torch and the library once
    (spawn_ranks.Zygote): a fresh process, its imports paid already."""
    code = (
        "import os, sys, torch\n"
        "from resilient_callbacks import Checkpointer\n"
        "st = {'w': torch.zeros(8), 'extra': {'tag': 0}}\n"
        f"ck = Checkpointer({str(root)!r}, resume={resume!r})\n"
        "print(ck.restore(st), flush=True)\n"
        f"for s in {list(saves)!r}:\n"
        "    ck.save(s, {'w': torch.full((8,), 1000.0 + s), 'extra': {'tag': 1000 + s}})\n"
        "ck.flush()\n"
        "os._exit(9)\n"
    )
    script, log = root.parent / "killed.py", root.parent / "killed.log"
    script.write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONHASHSEED": "0",  # (the zygote's: else a fresh interpreter)
    }
    p = spawn_ranks.shared_zygote().spawn([sys.executable, str(script)], env, log)
    assert p.wait(timeout=120) == 9, log.read_text()[-2000:]


def _auto(root) -> tuple[int, object, list[str]]:
    st = _st(0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with Checkpointer(root) as ck:
            step = ck.restore(st)
    said = [str(w.message) for w in rec if issubclass(w.category, ResumeFallbackWarning)]
    return step, st["extra"]["tag"], said


def test_a_roll_back_killed_before_its_first_save_is_named_by_the_next_auto_resume(tmp_path):
    root = tmp_path / "ck"
    _saved(root)
    _killed_after(root, 40)
    step, tag, said = _auto(root)
    assert (step, tag) == (60, 60)  # the newest committed, as the resume rules say
    assert len(said) == 1, said
    assert "rolled back to step 40 (resume=40)" in said[0]
    assert "stopped before its first save" in said[0] and "pass resume=40" in said[0]
    # said once: that restore was a restart at the newest step, a plain resume from then on
    assert _auto(root)[2] == []


def test_a_plain_crash_resume_is_not_named(tmp_path):
    root = tmp_path / "ck"
    _saved(root)
    _killed_after(root, "auto")
    assert _auto(root) == (60, 60, [])


def test_a_roll_back_that_saved_is_not_named_even_without_its_save_record(tmp_path):
    root = tmp_path / "ck"
    _saved(root)
    _killed_after(root, 40, saves=(50,))
    # its save record lost (the history is best effort): the commit number the restart
    # recorded as the newest then still tells that 50-1 was committed after it
    hist = root / "history.jsonl"
    kept = [ln for ln in hist.read_text().splitlines() if json.loads(ln)["event"] != "save"]
    hist.write_text("\n".join(kept) + "\n")
    assert _auto(root) == (50, 1050, [])


def test_a_restart_before_any_checkpoint_is_no_roll_back(tmp_path):
    """A run whose first process died before its first save: the next process starts it
    again from step 0 (a ``restart`` record of step 0, nothing restored), saves step 1 and is
    killed before its save record is written. The next auto-resume restored step 1 with
    "rolled back to step 0 (a fallback) ...: pass resume=0", though nothing was rolled back
    (seen as a crash-safety trial's failure)."""
    root = tmp_path / "ck"
    _killed_after(root, "auto")  # the run's start, no checkpoint
    _killed_after(root, "auto", saves=(1,))  # its restart from nothing, then step 1
    hist = root / "history.jsonl"
    kept = [ln for ln in hist.read_text().splitlines() if json.loads(ln)["event"] != "save"]
    hist.write_text("\n".join(kept) + "\n")
    assert _auto(root) == (1, 1001, [])
