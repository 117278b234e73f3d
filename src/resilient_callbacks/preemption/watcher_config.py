"""The options of a :class:`~.signals.PreemptionWatcher`: :class:`WatcherConfig` (which signals,
``handle_sigint``, ``grace_period_s`` overall or per source), validated when it is made, the
signals normalised to their names (``"USR1"``, ``10`` -> ``"SIGUSR1"``), each source's grace
period looked up with :meth:`WatcherConfig.grace_for`. Moved from :mod:`.signals`, which
re-exports the names. Not distributed: every rank builds its own from the same options.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError
from .request import DEFAULT_GRACE_S, DEFAULT_SIGNALS, MetadataKind, _check_seconds

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def _signal_name(s: Any) -> str:
    if isinstance(s, signal.Signals) or (isinstance(s, int) and not isinstance(s, bool)):
        try:
            return signal.Signals(s).name
        except ValueError:
            raise ConfigError(f"signals: {s!r} is not a signal number on this platform") from None
    if isinstance(s, str):
        name = s.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if isinstance(getattr(signal, name, None), signal.Signals):
            return name
    raise ConfigError(
        f"signals: {s!r} is not a signal; use names like 'SIGTERM' or 'USR1', or signal numbers"
    )


def _valid_source_key(key: str) -> bool:
    if key == "manual":
        return True
    if key.startswith("metadata:"):
        return key[len("metadata:") :] in set(MetadataKind)
    return key.startswith("SIG") and isinstance(getattr(signal, key, None), signal.Signals)


@dataclass(frozen=True, kw_only=True)
class WatcherConfig:
    """Options of a :class:`PreemptionWatcher`; ``signals`` is normalised to names."""

    signals: tuple[str, ...] | Iterable[str | int] = DEFAULT_SIGNALS
    handle_sigint: bool = False
    grace_period_s: float | Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.signals, (str, int)) or not isinstance(self.signals, Iterable):
            raise ConfigError(
                f"signals={self.signals!r}: must be a list of signals, e.g. ['SIGTERM', 'SIGUSR1']"
            )
        if not isinstance(self.handle_sigint, bool):
            raise ConfigError(f"handle_sigint={self.handle_sigint!r}: must be True or False")
        names = [_signal_name(s) for s in self.signals]
        if self.handle_sigint:
            names.append("SIGINT")
        for n in names:
            if n in _UNCATCHABLE:
                raise ConfigError(f"signals: {n} cannot be caught by any process; remove it")
        object.__setattr__(self, "signals", tuple(dict.fromkeys(names)))
        g = self.grace_period_s
        if isinstance(g, Mapping):
            for key, value in g.items():
                if not isinstance(key, str) or not _valid_source_key(key):
                    raise ConfigError(
                        f"grace_period_s: unknown source {key!r}; keys are signal names "
                        "('SIGTERM', 'SIGUSR1', ...), 'metadata:aws', 'metadata:gcp', "
                        "'metadata:azure', 'metadata:custom' or 'manual'"
                    )
                _check_seconds(f"grace_period_s[{key!r}]", value)
            object.__setattr__(self, "grace_period_s", MappingProxyType(dict(g)))
        elif g is not None:
            _check_seconds("grace_period_s", g)

    def grace_for(self, source: str) -> float | None:
        """The grace period of a request from ``source``: configured, else the default."""
        g = self.grace_period_s
        if isinstance(g, Mapping):
            if source in g:
                return float(g[source])
        elif g is not None:
            return float(g)
        return DEFAULT_GRACE_S.get(source)
