"""What ``pull`` and ``push`` say on stderr when they put one run's checkpoint beside another
run's: a directory or remote store holding two runs resumes from whichever was committed last
(by commit number), not from the run the user meant. Nothing here refuses: the copy was asked
for; it is said."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from . import catalog
from .catalog import Depth, Entry
from .redact import command
from .remote import RemoteEntry


def pulled_beside_other_runs(dirpath: str, run_id: str) -> None:
    """After ``pull`` put a checkpoint of run ``run_id`` into ``dirpath``: name the other runs
    whose checkpoints ``dirpath`` holds, and the commit a run resumed there tries first."""
    from .reader import by_commit

    entries = catalog.committed(catalog.scan(dirpath, Depth.NONE))
    others = sorted({e.manifest.run_id for e in entries if e.manifest} - {run_id})
    if others:
        newest = by_commit(entries)[0]
        print(
            f"resilient-ckpt pull: note: {dirpath} also holds checkpoints of another run "
            f"({', '.join(others)}); the newest commit there, which a run resumed in it tries "
            f"first, is {newest.name} (run {newest.manifest.run_id if newest.manifest else '?'}"
            f"). {command('ls', dirpath)} shows them; pull into an empty directory to keep "
            "runs apart",
            file=sys.stderr,
        )


def pushing_beside_other_runs(url: str, remote: Iterable[RemoteEntry], local: list[Entry]) -> None:
    """Before ``push`` uploads ``local`` to ``url``: name the runs of the checkpoints the store
    holds (``remote``) that none of ``local`` is of."""
    mine = {e.manifest.run_id for e in local if e.manifest is not None}
    others = sorted({e.manifest.run_id for e in remote if e.manifest is not None} - mine)
    if others and mine:
        print(
            f"resilient-ckpt push: note: {url} holds checkpoints of another run "
            f"({', '.join(others)}) than those pushed ({', '.join(sorted(mine))}); a run "
            f"resuming from {url} tries the newest commit of any of them first. "
            f"{command('ls', 'DIR', '--remote', url)} shows them; give each run its own URL",
            file=sys.stderr,
        )
