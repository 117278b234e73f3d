"""Which retention policy ``gc`` (and ``ls``) applies, and where it came from: the one the
newest manifest records, ``--keep-last`` overriding its ``keep_last``. One rule for DIR and for
a remote store (:mod:`.cli_local`, :mod:`.cli_remote`).

A manifest records the policy its run saved with: ``retention`` (the local tier's) and, from a
run with a remote tier, ``remote_retention``. A run without one (its checkpoints copied by
``resilient-ckpt push``) records no ``remote_retention``, and could set no ``remote_keep_last``
or ``remote_keep_best`` (they need ``remote=``): a remote tier with those defaults keeps what
its ``retention`` keeps (``keep_last``, ``keep_best`` by its metric, ``keep_every_n_steps``),
so that is the remote policy ``gc --remote`` applies to such a store."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .manifest import Manifest
from .retention import RetentionPolicy


@dataclass(frozen=True)
class Recorded:
    """A policy and where it came from (said by ``gc --remote``); ``policy`` None: none is
    recorded and no ``--keep-last`` was given, so ``gc`` cannot tell what the store keeps
    (``source`` says why)."""

    policy: RetentionPolicy | None
    source: str


def recorded_policy(
    name: str | None, m: Manifest | None, keep_last: int | None, remote: bool = False
) -> Recorded:
    """The policy recorded in ``m`` (the newest valid checkpoint's manifest, named ``name``),
    ``keep_last`` overriding its ``keep_last``: its ``retention`` for the local tier; for the
    remote one (``remote``) its ``remote_retention``, else its ``retention`` (a run without a
    remote tier: see the module's docstring), where ``m`` was written by a version that records
    ``remote_retention`` (:func:`older_writer`). Locally, nothing recorded keeps every checkpoint
    (``RetentionPolicy()``); remotely it is no policy unless ``keep_last`` is given."""
    recorded, source, none = {}, "", NONE_RECORDED
    if m is not None and remote and m.remote_retention:
        recorded = m.remote_retention
        source = f"recorded as remote_retention in {name}'s manifest"
    elif m is not None and remote and m.retention and not m.sealed:
        none = older_writer(name)  # (its retention may be a remote tier's local one)
    elif m is not None and m.retention:
        recorded = m.retention
        source = f"recorded in {name}'s manifest"
        if remote:
            source = (
                f"the run's own retention, recorded in {name}'s manifest: it had no remote tier "
                "(its checkpoints pushed), and a remote tier keeps by default what the run keeps"
            )
    policy = RetentionPolicy.from_json(recorded)
    if keep_last is not None:
        policy = dataclasses.replace(policy, keep_last=keep_last)
        if not recorded and none is not NONE_RECORDED:  # (the run's own not taken: why)
            return Recorded(policy, f"--keep-last {keep_last}; the rest none: {none}")
        if not recorded:
            return Recorded(policy, f"--keep-last {keep_last}; no retention recorded")
        return Recorded(policy, f"--keep-last {keep_last}; the rest {source}")
    if not recorded:
        if remote:
            return Recorded(None, none)
        return Recorded(policy, "none recorded: every checkpoint is kept")
    return Recorded(policy, source)


#: why ``gc --remote`` has no policy for a store whose newest manifest records none at all
NONE_RECORDED = (
    "its newest checkpoint records no retention policy (neither remote_retention nor the run's "
    "retention: written by an older version, or by another tool)"
)


def older_writer(name: str | None) -> str:
    """Why ``gc --remote`` does not take the run's own retention for the store's policy where
    the newest manifest, ``name``'s, was written before manifests recorded ``remote_retention``
    (it carries no checksum of itself, recorded from 2026-11-25): a run with a remote tier then
    recorded only its local tier's policy (``keep_last`` alone), its best and archive
    checkpoints being the remote's to keep; taken for the store's, gc deleted them."""
    return (
        f"its newest checkpoint, {name}, records no remote_retention and was written by a "
        "version before 2026-11-25 (its manifest carries no checksum of itself), which recorded "
        "only the local tier's retention for a run with a remote tier (keep_last alone: the "
        "remote kept the best and archive checkpoints), so the retention it records may not be "
        "what the store keeps"
    )


def policy_text(policy: RetentionPolicy) -> str:
    """``policy`` in a few words: ``keep_last=3, keep_best=1 by val_loss (min),
    keep_every_n_steps=100``."""
    parts = [f"keep_last={'all' if policy.keep_last is None else policy.keep_last}"]
    if policy.keep_best:
        parts.append(f"keep_best={policy.keep_best} by {policy.monitor} ({policy.mode})")
    if policy.keep_every_n_steps:
        parts.append(f"keep_every_n_steps={policy.keep_every_n_steps}")
    return ", ".join(parts)
