"""The options of a :class:`~resilient_callbacks.Checkpointer`, validated in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .adaptive import AdaptiveSchedule
from .config_remote import _apply, _them, check_remote
from .errors import ConfigError
from .policy import SavePolicy
from .retention import Mode, RetentionPolicy
from .sinks import SinkSpec
from .sinks import parse as parse_sinks


def missing_resume_hint(resume: str, dirpath: str) -> str:
    """What ``resume=<a path that does not exist>`` was probably meant as (a sentence, or "")."""
    if resume.isdigit():
        return f"; a step number is an int: resume={int(resume)}"
    if resume.lower() in ("latest", "last", "newest"):
        return "; the newest valid checkpoint is resume='auto' (the default)"
    beside = os.path.join(dirpath, resume)
    if not os.path.isabs(resume) and os.path.isdir(beside):
        return (
            "; a path is relative to the working directory, not to dirpath: "
            f"resume={beside!r} (or a step number)"
        )
    return ""


def local_dirpath(dirpath: Any, what: str = "dirpath") -> str:
    """``dirpath`` (a path, ``~`` expanded, or a ``file://`` URL) as an absolute local path; an
    object-store URL is refused: checkpoints are written and committed on a filesystem, and
    reach a store through ``remote=`` (``os.path.abspath("s3://b/x")`` is ``./s3:/b/x``)."""
    d = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath
    if not isinstance(d, str) or not d:
        raise ConfigError(f"{what}={dirpath!r}: must be a non-empty path")
    if "://" in d:
        if not d.startswith("file://"):
            raise ConfigError(
                f"{what}={d!r}: the checkpoint directory must be a local (or shared, "
                "mounted) filesystem path; object-store URLs are not supported as dirpath. "
                f"To keep checkpoints there, save to a local dirpath and pass remote={d!r}: "
                "each checkpoint is uploaded in the background, and resumed from there"
            )
        d = d[len("file://") :]
    return os.path.abspath(os.path.expanduser(d))


class ResumeMode(StrEnum):
    AUTO = "auto"  # newest valid checkpoint in dirpath, falling back loudly; fresh start if none
    NEVER = "never"  # start fresh; checkpoints already in dirpath are kept and not counted


#: the options :meth:`CheckpointerConfig.agreed` compares across ranks
AGREED = (
    "every_n_steps",
    "every_seconds",
    "keep_last",
    "keep_best",
    "monitor",
    "mode",
    "keep_every_n_steps",
    "resume",
    "capture_rng",
    "async_save",
    "max_in_flight",
    "if_busy",
    "overlap_snapshot",
    "adaptive",
    "mtbf_hours",
    "max_overhead",
    "min_interval",
    "max_interval",
    "loss_jump",
    "loss_key",
    "preemption",
    "exit_on_preemption",
    "save_on_exception",
    "remote_every_n_saves",
    "shared_dirpath",
    "replicas",
    "incremental",
    "compression",
    "read_only",
)


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    dirpath: str
    every_n_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    keep_best: int = 0
    monitor: str | None = None
    mode: Mode | str = Mode.MIN
    keep_every_n_steps: int | None = None
    resume: Any = ResumeMode.AUTO  # "auto" | "never" | int step | path of a checkpoint directory
    capture_rng: bool = True
    async_save: bool = True
    max_in_flight: int = 1
    if_busy: str = "wait"  # "wait" | "skip": a periodic save due while max_in_flight are pending
    overlap_snapshot: bool = False
    adaptive: bool = False
    mtbf_hours: float | None = None
    max_overhead: float | None = None
    min_interval: float | None = None  # seconds
    max_interval: float | None = None  # seconds
    loss_jump: float | None = None
    loss_key: str = "loss"
    preemption: bool = True
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    handle_sigint: bool = False
    grace_period: float | None = None
    exit_on_preemption: bool = True
    preemption_exit_code: int = 75
    metadata_notices: Any = (
        None  # a kind ("aws", "gcp", "azure", "custom") or MetadataPoller options
    )
    save_on_exception: bool = False
    remote: str | None = None  # fsspec URL of the durable tier
    remote_options: Any = None  # passed to fsspec (endpoint_url, key, secret, ...)
    remote_keep_last: int | str | None = None  # None: as keep_last; "all": keep every one
    remote_keep_best: int | None = None  # None: as keep_best
    remote_timeout: float = 30.0  # seconds the construction-time preflight may take
    remote_every_n_saves: int | None = None  # upload every Nth commit (None: every one)
    shared_dirpath: bool | None = None  # None: detect; False: node-local disks (docs/multinode.md)
    replicas: int = 0  # node-local mode: copies of each node's files kept on other nodes (0 or 1)
    telemetry: Any = None  # metrics sinks (sinks.parse): a spec, a dict, a callable, a list
    #: ``resume`` given as a path: absolute, resolved when the config is made, as ``dirpath`` is
    #: (a relative one and an ``os.chdir`` before restore(), Hydra's job folder, find the same)
    resume_path: str | None = field(default=None, init=False, repr=False, compare=False)

    def sinks(self) -> tuple[SinkSpec, ...]:
        """The metrics sinks ``telemetry`` names, validated (no extra imported)."""
        return parse_sinks(self.telemetry)

    incremental: bool | str = False  # True | "hash": store unchanged tensors once
    compression: str = "none"  # "none" | "zstd" | "auto"
    compression_level: int = 1
    compression_shuffle: bool = True  # byte-shuffle multi-byte dtypes before zstd
    read_only: bool = False  # restore only: no lock, no writes (an evaluation job)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dirpath", local_dirpath(self.dirpath))
        r = self.resume
        if isinstance(r, bool):
            raise ConfigError(f"resume={r!r}: use 'auto', 'never', a step number or a path")
        if isinstance(r, int):
            if r < 0:
                raise ConfigError(f"resume={r}: a step number must be >= 0")
        elif isinstance(r, os.PathLike):
            object.__setattr__(self, "resume", os.fspath(r))
        elif isinstance(r, str):
            if r in ("auto", "never"):
                object.__setattr__(self, "resume", ResumeMode(r))
        else:
            raise ConfigError(
                f"resume={r!r}: use 'auto' (default), 'never', a step number or the path of a "
                "checkpoint directory"
            )
        if isinstance(self.resume, str) and not isinstance(self.resume, ResumeMode):
            path = os.path.abspath(os.path.expanduser(self.resume))
            object.__setattr__(self, "resume_path", path)
        for flag in (
            "capture_rng",
            "async_save",
            "overlap_snapshot",
            "adaptive",
            "preemption",
            "handle_sigint",
            "exit_on_preemption",
            "save_on_exception",
            "read_only",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}={getattr(self, flag)!r}: must be True or False")
        if isinstance(self.max_in_flight, bool) or self.max_in_flight != 1:
            # Saves in flight share one set of host buffers: a second save would copy into
            # them while the first still writes (and hashes) them, committing torn checkpoints.
            raise ConfigError(
                f"max_in_flight={self.max_in_flight!r}: one save is written at a time (1, the "
                "default); more in flight is not supported yet. To keep training from waiting "
                "for a slow save, pass if_busy='skip' (a periodic save due while one is being "
                "written is skipped)"
            )
        if self.if_busy not in ("wait", "skip"):
            raise ConfigError(
                f"if_busy={self.if_busy!r}: use 'wait' (block until the previous save is "
                "written) or 'skip' (skip a periodic save that is due meanwhile)"
            )
        if self.overlap_snapshot and not self.async_save:
            raise ConfigError(
                "overlap_snapshot=True needs async_save=True: the snapshot overlaps training "
                "only when the write happens in the background"
            )
        if self.if_busy == "skip" and not self.async_save:
            raise ConfigError(
                "if_busy='skip' needs async_save=True: a synchronous save is written before "
                "step() returns, so no save is ever being written when the next is due"
            )
        adaptive_opts = ("mtbf_hours", "max_overhead", "min_interval", "max_interval")
        if not self.adaptive and any(getattr(self, k) is not None for k in adaptive_opts):
            given = [k for k in adaptive_opts if getattr(self, k) is not None]
            raise ConfigError(
                f"{', '.join(given)} {_apply(given)} only to the adaptive schedule: pass adaptive=True "
                f"(or drop {_them(given)})"
            )
        if self.loss_jump is not None and not (
            isinstance(self.loss_jump, (int, float)) and self.loss_jump > 0
        ):
            raise ConfigError(
                f"loss_jump={self.loss_jump!r}: a relative threshold > 0 (e.g. 0.5 saves when "
                "the loss exceeds its recent median by 50%), or None"
            )
        if (
            isinstance(self.preemption_exit_code, bool)
            or not isinstance(self.preemption_exit_code, int)
            or not 0 <= self.preemption_exit_code <= 255
        ):
            raise ConfigError(
                f"preemption_exit_code={self.preemption_exit_code!r}: an exit status 0..255"
            )
        if self.metadata_notices is not None and not self.preemption:
            raise ConfigError(
                "metadata_notices needs preemption=True: a cloud notice triggers the same "
                "emergency save as SIGTERM"
            )
        if self.preemption:
            _check_watcher_options(self)
        check_remote(self)
        self._check_nodes()
        self._check_read_only()
        self.sinks()
        if not (isinstance(self.incremental, bool) or self.incremental == "hash"):
            raise ConfigError(
                f"incremental={self.incremental!r}: True (tensors known unchanged are neither "
                "copied nor hashed), 'hash' (every tensor hashed at every save) or False"
            )
        from .compression import check_options

        check_options(self.compression, self.compression_level, self.compression_shuffle)
        # Constructing these validates the options with their own messages.
        self.save_policy()
        self.retention_policy()
        self.adaptive_schedule()
        if self.remote is not None:
            self.remote_retention_policy()

    def _check_nodes(self) -> None:
        if self.shared_dirpath not in (None, True, False):
            raise ConfigError(
                f"shared_dirpath={self.shared_dirpath!r}: None (default: detect whether every "
                "rank sees the same dirpath), True (a shared filesystem) or False (node-local "
                "disks, see docs/multinode.md)"
            )
        if self.replicas not in (0, 1) or isinstance(self.replicas, bool):
            raise ConfigError(
                f"replicas={self.replicas!r}: 0 (default) or 1 (each node also keeps a copy of "
                "another node's files, so a replaced node restores from its peer)"
            )
        if self.replicas and self.shared_dirpath is True:
            raise ConfigError(
                "replicas=1 applies to node-local disks only (shared_dirpath=True was given): "
                "on a shared filesystem every node already reads every file"
            )
        k = self.remote_every_n_saves
        if k is not None:
            if self.remote is None:
                raise ConfigError(
                    "remote_every_n_saves only applies with remote=<URL>: pass remote (or drop it)"
                )
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ConfigError(
                    f"remote_every_n_saves={k!r}: an int >= 1 (e.g. 10: every checkpoint is "
                    "committed locally, every 10th is also uploaded), or None for every one"
                )

    # what only a writer uses, and the value that leaves it unused
    _WRITING = (
        ("every_n_steps", None),
        ("every_seconds", None),
        ("keep_last", None),
        ("keep_best", 0),
        ("keep_every_n_steps", None),
        ("adaptive", False),
        ("loss_jump", None),
        ("save_on_exception", False),
        ("metadata_notices", None),
        ("remote", None),
        ("replicas", 0),
        ("incremental", False),
        ("compression", "none"),
    )

    def _check_read_only(self) -> None:
        if not self.read_only:
            return
        given = [k for k, unused in self._WRITING if getattr(self, k) != unused]
        if self.shared_dirpath is False:  # node-local mode: each node uploads its own files
            given.append("shared_dirpath=False")
        if given:
            raise ConfigError(
                f"read_only=True restores and never saves: {', '.join(given)} {_apply(given)} only to a "
                f"Checkpointer that writes (drop {_them(given)}). A read-only Checkpointer reads dirpath "
                "alone: to restore from the remote tier, give a writable dirpath and remote=..."
            )
        if self.resume == ResumeMode.NEVER:
            raise ConfigError(
                "read_only=True with resume='never' would restore nothing: use resume='auto' "
                "(the newest valid checkpoint), a step number or a checkpoint's path"
            )

    def agreed(self) -> dict[str, Any]:
        """The options every rank must be given alike, as JSON values: those that decide
        together when and how the ranks save, restore and keep checkpoints (a rank with another
        ``every_n_steps`` or ``adaptive`` waited in a save the others never reached). Left out:
        what may differ per rank or node (``dirpath`` in node-local mode, telemetry, remote
        credentials, signals, compression level)."""
        out: dict[str, Any] = {}
        for name in AGREED:
            v = getattr(self, name)
            out[name] = v if v is None or isinstance(v, (bool, int, float)) else str(v)
        out["remote"] = self.remote is not None
        return out

    def remote_due(self, seq: int, reason: str) -> bool:
        """Is the checkpoint of commit number ``seq`` uploaded? Every ``remote_every_n_saves``-th
        one, and always a final, emergency or exception save (the last state of a run). The
        writer uploads an archive point and one of the run's best too (:mod:`.remote_best`)."""
        k = self.remote_every_n_saves
        return k is None or seq % k == 0 or reason in ("final", "emergency", "close", "exception")

    def local_retention_policy(self) -> RetentionPolicy:
        """With a remote tier, the local disk keeps only the ``keep_last`` newest (plus what is
        not uploaded yet); best and archive checkpoints are kept remotely. Unless only every
        ``remote_every_n_saves``-th is uploaded: the local disk then keeps the best ones, which
        the next saves are ranked against to tell whether one of them is uploaded as a best
        (:mod:`.remote_best`), and its archive points too (uploaded as they are saved: a
        restart uploads one the store lacks from these copies, :mod:`.node_recovery`)."""
        if self.remote is None or self.remote_every_n_saves not in (None, 1):
            return self.retention_policy()
        return RetentionPolicy(keep_last=self.keep_last)

    def remote_retention_if_any(self) -> RetentionPolicy | None:
        """The remote tier's retention policy, None without a remote (what a manifest records)."""
        return self.remote_retention_policy() if self.remote is not None else None

    def remote_retention_policy(self) -> RetentionPolicy:
        keep_last: int | None
        if self.remote_keep_last is None:
            keep_last = self.keep_last
        elif self.remote_keep_last == "all":
            keep_last = None
        else:
            keep_last = int(self.remote_keep_last)
        keep_best = self.keep_best if self.remote_keep_best is None else self.remote_keep_best
        return RetentionPolicy(
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=self.monitor if keep_best else None,
            mode=self.mode,  # type: ignore[arg-type]
            keep_every_n_steps=self.keep_every_n_steps,
        )

    def save_policy(self) -> SavePolicy:
        return SavePolicy(
            every_n_steps=self.every_n_steps,
            every_seconds=self.every_seconds,
            archive_every_n_steps=self.keep_every_n_steps,
        )

    def adaptive_schedule(self) -> AdaptiveSchedule | None:
        if not self.adaptive:
            return None
        return AdaptiveSchedule(
            mtbf_hours=self.mtbf_hours,
            max_overhead=self.max_overhead,
            min_interval_s=self.min_interval,
            max_interval_s=self.max_interval,
        )

    def retention_policy(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            monitor=self.monitor,
            mode=self.mode,  # type: ignore[arg-type]
            keep_every_n_steps=self.keep_every_n_steps,
        )


def _check_watcher_options(config: CheckpointerConfig) -> None:
    """The signal handler's and the cloud poller's options, named as the Checkpointer's, before
    anything is created (the watcher is made after the directory)."""
    import inspect

    from .preemption import MetadataPoller
    from .preemption.signals import WatcherConfig

    try:
        WatcherConfig(
            signals=config.signals,
            handle_sigint=config.handle_sigint,
            grace_period_s=config.grace_period,
        )
    except ConfigError as e:  # the watcher's option is grace_period_s
        raise ConfigError(str(e).replace("grace_period_s", "grace_period")) from None
    opts = config.metadata_notices
    if isinstance(opts, Mapping):
        known = set(inspect.signature(MetadataPoller).parameters) - {"watcher"}
        unknown = sorted(set(map(str, opts)) - known)
        if unknown:
            raise ConfigError(
                f"metadata_notices: unknown option(s) {', '.join(map(repr, unknown))}; the "
                f"options are {', '.join(sorted(known))}"
            )
