"""The preemption watcher of a Checkpointer: its signal handlers (and cloud notice poller)
installed from the config, the grace period from ``RESILIENT_GRACE_PERIOD_S``, and what a
failed construction does with them (:func:`watching`). The saves themselves:
:mod:`.emergency`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from .errors import RemoteWaitPreemptedError
from .preemption import MetadataPoller, PreemptionWatcher, exiting
from .preemption.signals import WatcherConfig
from .preemption.signals import _signal_name as signal_name

if TYPE_CHECKING:
    from .config import CheckpointerConfig

log = logging.getLogger("resilient_callbacks")

GRACE_ENV = "RESILIENT_GRACE_PERIOD_S"  # default grace period (s) when grace_period is None


def grace_from_env(value: str) -> float | dict[str, float] | None:
    """``RESILIENT_GRACE_PERIOD_S``, set by the job recipes from the scheduler's grace period:
    seconds for every source (``"120"``), or per source (``"SIGUSR1=120,SIGTERM=30"``: a Slurm
    job's ``--signal`` lead and its KillWait; the sources left out keep their defaults). None,
    with a warning, when it is neither (0 included: no time to save)."""
    try:
        if "=" not in value:
            grace = float(value)
            if not math.isfinite(grace) or grace <= 0:
                raise ValueError(value)
            return grace
        out: dict[str, float] = {}
        for part in value.split(","):
            key, _, seconds = (x.strip() for x in part.partition("="))
            source = key if key.startswith("metadata:") or key == "manual" else signal_name(key)
            out[source] = float(seconds)
        WatcherConfig(grace_period_s=out)  # known sources, seconds > 0
        return out
    except ValueError:  # (a ConfigError too)
        log.warning(
            "ignoring %s=%r: neither a number of seconds > 0 nor seconds per source like "
            "'SIGUSR1=120,SIGTERM=30' (the default grace periods apply)",
            GRACE_ENV,
            value,
        )
        return None


def start_watcher(
    config: CheckpointerConfig,
) -> tuple[PreemptionWatcher | None, MetadataPoller | None]:
    """Install the signal handlers (and start the cloud notice poller) of ``config``; none
    without ``preemption`` or with ``read_only``."""
    if not config.preemption or config.read_only:
        return None, None
    grace: float | Mapping[str, float] | None = config.grace_period
    if grace is None and os.environ.get(GRACE_ENV):
        grace = grace_from_env(os.environ[GRACE_ENV])
    watcher = PreemptionWatcher(
        signals=config.signals, handle_sigint=config.handle_sigint, grace_period_s=grace
    )
    watcher.install()
    poller = None
    if config.metadata_notices is not None:
        opts = config.metadata_notices
        opts = {"kind": opts} if isinstance(opts, str) else dict(opts)
        with watching(watcher, None):  # (a bad option: the handlers go back, not left behind)
            poller = MetadataPoller(watcher, **opts).start()
    return watcher, poller


@contextlib.contextmanager
def watching(
    watcher: PreemptionWatcher | None,
    poller: MetadataPoller | None,
    config: CheckpointerConfig | None = None,
) -> Iterator[None]:
    """The rest of a Checkpointer's construction, its watcher installed first: a signal while
    it opens its directory (the lock, sweeps, a remote, the ranks' collectives) killed the
    process (-15, a crash to the scheduler); now the first ``step()`` acts on it, after
    ``restore()``. Where the construction fails, the poller stops, the previous handlers
    are back, and the exception ends the process (a pending signal is said, not passed on:
    it would kill the process before the exception is shown). Where the request itself ended
    a wait on a stalled store (:class:`RemoteWaitPreemptedError`), ``config``'s
    ``exit_on_preemption`` has the process exit with the preemption code, said in one line
    (as at restore: :meth:`Emergency.exit_if_preempted`)."""
    try:
        yield
    except BaseException as e:
        if poller is not None:
            poller.stop()
        exits = config is not None and config.exit_on_preemption and watcher is not None
        if isinstance(e, RemoteWaitPreemptedError) and exits:
            assert config is not None and watcher is not None
            log.error(_exit_line(e, config.preemption_exit_code))
            watcher.exiting(config.preemption_exit_code)  # (before uninstall: a 2nd signal
            watcher.uninstall()  # keeps the code)
            exiting.exit_with(config.preemption_exit_code)
        if watcher is not None:
            if watcher.request is not None:
                log.warning(
                    "%s arrived while Checkpointer() failed with %s (nothing was saved for it)",
                    watcher.request.source,
                    type(e).__name__,
                )
            watcher.uninstall()
        raise


def _exit_line(e: RemoteWaitPreemptedError, code: int) -> str:
    return f"{type(e).__name__}: {e}; exiting with code {code} so the scheduler restarts the job"
