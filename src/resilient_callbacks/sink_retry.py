"""How a metrics sink that fails is retried: with back-off, said when it stops and when it is
back, and switched off only when it keeps failing.

A weeks-long run meets transient failures of its monitoring (an MLflow tracking server
restarting, a Pushgateway blip, an exporter's port still held by the process before a restart):
one failure must not end its monitoring for the rest of the run. :class:`SinkHealth` is the
state of one sink: the sink's own thread (or, for the ``"logger"`` sink, the training thread)
asks :meth:`SinkHealth.due` before a send, which never waits, and reports each attempt's outcome
with :meth:`~SinkHealth.ok` or :meth:`~SinkHealth.failed`. Nothing here blocks training or a
save.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .errors import ConfigError
from .redact import url_text

log = logging.getLogger("resilient_callbacks")


@dataclass(frozen=True)
class RetryPolicy:
    """``first_s``: the wait after the first failure, doubled after each further one up to
    ``max_s``; a sink failing for ``give_up_s`` without a success is switched off for the rest
    of the run. A new outage less than ``quiet_s`` after the last warning about the same sink
    (a sink that flaps) is logged at INFO, not WARNING."""

    first_s: float = 5.0
    max_s: float = 300.0
    give_up_s: float = 3600.0
    quiet_s: float = 600.0


DEFAULT_POLICY = RetryPolicy()


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"


class SinkHealth:
    """One sink's failures: whether it may be tried now, and the messages about it (one when an
    outage starts, one when it ends or the sink is switched off; the retries in between at
    DEBUG). ``off``: switched off for good (it kept failing for ``policy.give_up_s``, or it
    raised a :class:`~.errors.ConfigError`: a mistake in its setup, which no retry mends)."""

    def __init__(self, name: str, policy: RetryPolicy | None = None) -> None:
        self.name = url_text(name)  # a URL's credentials are not shown
        self.policy = policy or DEFAULT_POLICY
        self.off = False
        self.failing_since: float | None = None
        self.attempts = 0  # failed attempts in a row
        self.next_try = 0.0  # time.monotonic() before which it is not tried again
        self.last_error = ""
        self._last_warned = -float("inf")
        self._loud = True  # the current outage was warned about (not a quiet flap)

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def due(self, now: float | None = None) -> bool:
        """May the sink be tried now (not switched off, and not waiting out a back-off)?"""
        now = time.monotonic() if now is None else now
        return not self.off and now >= self.next_try

    def ok(self) -> None:
        """An attempt succeeded: an outage, if one was under way, is over (and said)."""
        if self.failing_since is None:
            return
        down = time.monotonic() - self.failing_since
        log.log(
            logging.WARNING if self._loud else logging.INFO,
            "metrics sink %s is back after %d failed attempt(s) over %s: sending again",
            self.name,
            self.attempts,
            _span(down),
        )
        if self._loud:
            self._last_warned = time.monotonic()
        self.failing_since = None
        self.attempts = 0
        self.next_try = 0.0

    def failed(self, error: BaseException, *, final: bool = False) -> None:
        """An attempt failed with ``error``. ``final``: the last attempt, at close (no retry
        follows: a failing sink's last values are not sent, and that is said)."""
        now = time.monotonic()
        p = self.policy
        self.last_error = url_text(f"{type(error).__name__}: {error}")  # (a URL it quotes)
        self.attempts += 1
        first = self.failing_since is None
        if first:
            self.failing_since = now
            self._loud = now - self._last_warned >= p.quiet_s
        assert self.failing_since is not None
        down = now - self.failing_since
        if final:
            log.warning(
                "metrics sink %s failed at close (%s): its last values were not sent "
                "(training is not affected)%s",
                self.name,
                self.last_error,
                "" if first else f"; {self.attempts} failed attempts in a row over {_span(down)}",
            )
            self.off = True
            return
        if isinstance(error, ConfigError) or (not first and down >= p.give_up_s):
            self.off = True
            if first:  # a mistake in its setup: no retry would succeed
                log.warning(
                    "metrics sink %s failed and is switched off for the rest of this run "
                    "(training goes on): %s",
                    self.name,
                    self.last_error,
                )
                return
            log.warning(
                "metrics sink %s kept failing for %s (%d attempts; the last: %s) and is "
                "switched off for the rest of this run (training goes on)",
                self.name,
                _span(down),
                self.attempts,
                self.last_error,
            )
            return
        wait = min(p.max_s, p.first_s * 2 ** (self.attempts - 1))
        self.next_try = now + wait
        if first:
            log.log(
                logging.WARNING if self._loud else logging.INFO,
                "metrics sink %s failed (training goes on): %s; its metrics are not sent "
                "until it answers: retrying in %s, then with back-off up to %s; switched off "
                "if it keeps failing for %s",
                self.name,
                self.last_error,
                _span(wait),
                _span(p.max_s),
                _span(p.give_up_s),
            )
            if self._loud:
                self._last_warned = now
        else:
            log.debug(
                "metrics sink %s failed again (attempt %d, %s): retrying in %s",
                self.name,
                self.attempts,
                self.last_error,
                _span(wait),
            )
