"""Preemption detection: notice that this process is about to be killed, and do nothing else.

Two sources feed one flag:

- :class:`PreemptionWatcher` installs signal handlers (SIGTERM, SIGUSR1, optionally SIGINT) that
  only *record* the request. Saving inside a signal handler interrupts arbitrary code, which may
  hold the locks a save needs, and hangs; so the handler does no I/O, takes no lock, logs nothing.
- :class:`MetadataPoller` polls a cloud metadata endpoint (AWS spot, GCP preemption, Azure
  scheduled events, or any URL) in a daemon thread and calls :meth:`PreemptionWatcher.trigger`
  when a notice appears.

The training loop checks :attr:`PreemptionWatcher.requested` at each step boundary, and there (in
the training thread, between two steps) takes the emergency checkpoint and stops::

    watcher = PreemptionWatcher()                      # main thread, on every rank
    with watcher, MetadataPoller(watcher, kind="aws"):
        for step in range(start, total):
            train_step()
            if watcher.requested:                      # a step boundary
                ckpt.save(step + 1, state)             # emergency save, in this thread
                raise SystemExit(143)                  # or let the framework stop

The package: :mod:`.request` (the request, its sources and default grace periods),
:mod:`.signals` (the watcher and its signal handlers), :mod:`.cloud` (the metadata pollers).
"""

# The cloud constants are not in __all__ but stay importable from here, as before the split.
from .cloud import (  # noqa: F401
    AWS_TOKEN_PATH,
    AWS_TOKEN_TTL_S,
    AZURE_EVENT_TYPES,
    DEFAULT_AZURE_EVENT_TYPES,
    DEFAULT_URLS,
    GCP_MAINTENANCE_NAME,
    MetadataPoller,
    PollerConfig,
)
from .request import DEFAULT_GRACE_S, DEFAULT_SIGNALS, MetadataKind, PreemptionRequest
from .signals import PreemptionWatcher
from .watcher_config import WatcherConfig

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_SIGNALS",
    "DEFAULT_URLS",
    "MetadataKind",
    "MetadataPoller",
    "PollerConfig",
    "PreemptionRequest",
    "PreemptionWatcher",
    "WatcherConfig",
]
