"""What a :class:`~.checkpointer.Checkpointer` tells its readers: the parts' state and the queries.

``CheckpointerQueries`` is the read side of the facade, a base class of ``Checkpointer``: the
properties and queries that adapters, metrics sinks, the CLI and tests read (``run_id``,
``remote``, ``save_waits``, ``committed_saves``, ``remote_status()``, ``metrics()``,
``checkpoints()``, ``latest_path``, ...), each delegated to the part that holds it (the
directory, the saver, the trigger, the recorder). Nothing here runs a collective, so any rank
may read at any time; what only one rank holds says so (``remote`` and ``remote_status()``:
the coordinator, in node-local mode each node leader; ``None`` elsewhere). Moved from
``checkpointer.py``, where ``Checkpointer`` wires the parts and decides when to save.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .nodelocal import NodeDirectory

if TYPE_CHECKING:
    from .background import BackgroundPersister
    from .catalog import Entry
    from .directory import Directory
    from .recorder import Recorder
    from .remote import RemoteStore
    from .saving import Saver
    from .snapshot import HostBuffers
    from .sync import RemoteSync, SyncStatus
    from .telemetry import Telemetry
    from .trigger import Trigger
    from .waits import SaveWaits

__all__ = ["CheckpointerQueries"]


class CheckpointerQueries:
    """The read side of a Checkpointer (its base class): the parts' state and the queries,
    delegated to the parts ``Checkpointer`` sets up. Any rank reads them; no collectives."""

    _dir: Directory
    _saver: Saver
    _trigger: Trigger
    _recorder: Recorder
    telemetry: Telemetry

    @property
    def run_id(self) -> str | None:
        """The run the checkpoints this Checkpointer writes belong to (set at the first save,
        or by a restore from this directory)."""
        return self._dir.run_id

    @run_id.setter
    def run_id(self, value: str | None) -> None:
        self._dir.run_id = value

    @property
    def run_start(self) -> float | None:
        """When the run (all its lives) began, as ``time.time()``: once a save or restore set it."""
        return self._recorder.run_start

    @property
    def remote(self) -> RemoteStore | None:
        """The remote tier (coordinator; None without ``remote`` or on other ranks)."""
        return self._dir.remote

    @property
    def _sync(self) -> RemoteSync | None:
        return self._dir.sync

    @property
    def _persister(self) -> BackgroundPersister | None:
        return self._saver.persister

    @property
    def _buffers(self) -> HostBuffers:
        return self._saver.buffers

    @property
    def _save_seconds(self) -> deque[float]:
        return self._saver.save_seconds

    @property
    def save_waits(self) -> SaveWaits:
        """How long background saves waited for the previous one (this rank)."""
        return self._saver.save_waits

    @property
    def blocking_seconds(self) -> deque[float]:
        """What each recent background save blocked the training loop, in seconds."""
        return self._saver.blocking_seconds

    @property
    def has_schedule(self) -> bool:
        """Whether :meth:`step` saves on a schedule (``every_n_steps``, ``every_seconds``,
        ``adaptive``, ``loss_jump``), not only final steps and preemptions."""
        return self._trigger.has_schedule

    def saves_on_caller_schedule(self, description: str) -> None:
        """Say that the caller saves with :meth:`save` on a schedule of its own (an adapter at
        every epoch end): :meth:`step` then no longer warns that no save schedule is configured."""
        self._trigger.caller_schedule = description

    @property
    def skipped_saves(self) -> int:
        """Periodic saves skipped with ``if_busy='skip'``."""
        return self._saver.skipped_saves

    @property
    def committed_saves(self) -> int:
        """Saves this Checkpointer committed."""
        return self._saver.committed_saves

    @property
    def waits_for_previous(self) -> int:
        """How many background saves of this rank waited for the previous one to be written."""
        return self._saver.save_waits.waits

    def remote_status(self) -> SyncStatus | None:
        """The upload backlog and counters (coordinator; in node-local mode each node leader,
        of its node's uploads; None without ``remote`` or on other ranks)."""
        if self._dir.sync is not None:
            return self._dir.sync.status()
        if isinstance(self._dir, NodeDirectory):
            return self._dir.upload_status()
        return None

    @property
    def after_commit_error(self) -> str | None:
        """Where the newest committed checkpoint's work after its commit (the retention pass,
        queueing its upload) failed, what was said then (the checkpoint is valid; what is kept
        or not done); None when it succeeded. Every rank of a shared directory (rank 0's);
        in node-local mode each node leader, of its node. Counted in the metric
        ``after_commit_failures_total``."""
        failed = self._recorder.after_commit_error
        return failed[1] if failed is not None else None

    def metrics(self) -> dict[str, float]:
        """The checkpoint metrics now (docs/monitoring.md has the names and units), as
        ``{name: value}``; a labelled metric also as ``name/label value``."""
        self._recorder.refresh()
        return self.telemetry.values()

    def checkpoints(self) -> list[Entry]:
        """Committed checkpoints in dirpath, oldest first (sizes checked, not checksums)."""
        return self._dir.checkpoints()

    @property
    def latest_path(self) -> str | None:
        return self._dir.latest_valid()
