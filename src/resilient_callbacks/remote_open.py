"""The construction's checks of a ``remote=`` store, before any training: the preflight (write,
read back and delete a probe object) and the first listing (new commits number after the
store's). A store that cannot be reached while the local directory holds committed
checkpoints is a warning and the job goes on from them; otherwise an error, at once.

Which ranks call what: the coordinator (in node-local mode each node's leader) at open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import catalog
from .catalog import Depth
from .errors import RemoteUnavailableError, RemoteWaitPreemptedError
from .redact import url_text

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("resilient_callbacks")


def preflight(store: RemoteStore, timeout: float, dirpath: str, node: int | None = None) -> bool:
    """The construction's :meth:`RemoteStore.preflight`: True when the store answered. A
    store that cannot be reached (no answer, a connection refused or timed out) while
    ``dirpath`` holds committed checkpoints is a warning and False: a job requeued during an
    outage resumes from them (its restore warns that the remote may hold newer) and uploads
    once the store answers. Raised otherwise: with nothing local, a new node must not start
    from scratch beside the run's remote checkpoints; an answer that says the configuration
    is wrong (a missing bucket, credentials refused) is an error at once. ``node``: in
    node-local mode, the node whose leader asks (each says its own warning, naming its node:
    whether it reaches the store and what its disk holds are its own)."""
    try:
        store.preflight(timeout=timeout)
        return True
    except RemoteUnavailableError as e:
        if not _unreachable(e) or not catalog.committed(catalog.scan(dirpath, Depth.NONE)):
            raise
        log.warning(
            "%s%s. %s holds checkpoints: going on with them; uploads are retried with backoff "
            "until the store answers",
            "" if node is None else f"node {node}: ",
            str(e).rstrip("."),
            dirpath,
        )
        return False


def open_listing(max_seq: Callable[[], int], url: str, dirpath: str) -> int:
    """The construction's listing after a preflight that answered: ``max_seq()``, bounded as a
    restore's (:mod:`.stall`). Its failure is the store's :class:`RemoteUnavailableError` (not
    ``dirpath`` unusable); no answer while ``dirpath`` holds committed checkpoints is
    :func:`preflight`'s warning and 0 (the restore lists again); a preemption request while
    it waits ends it, :class:`RemoteWaitPreemptedError`."""
    from . import stall

    try:
        return stall.run(max_seq, f"listing {url}", who="the construction", preemptible=True)
    except RemoteWaitPreemptedError:
        raise
    except RemoteUnavailableError as e:
        err = e
    except Exception as e:
        err = RemoteUnavailableError(
            f"remote {url}: listing its checkpoints failed ({type(e).__name__}: "
            f"{url_text(str(e))}) after a probe object was written and read there. Check the "
            "right to list it (s3:ListBucket) and the endpoint"
        )
        err.__cause__ = e
    if not _unreachable(err) or not catalog.committed(catalog.scan(dirpath, Depth.NONE)):
        raise err
    log.warning("%s. %s holds checkpoints: going on with them", str(err).rstrip("."), dirpath)
    return 0


def _unreachable(e: RemoteUnavailableError) -> bool:
    """Whether the preflight's failure says the store could not be reached (no answer, a
    refused or timed-out connection: botocore's errors are no OSError, so by class name)."""
    cause = e.__cause__
    if cause is None:  # no answer within the preflight's timeout
        return True
    if isinstance(cause, (PermissionError, FileNotFoundError)):
        return False
    kinds = [k.__name__ for k in type(cause).__mro__]
    return isinstance(cause, (ConnectionError, TimeoutError)) or any(
        "Connection" in k or "Timeout" in k for k in kinds
    )
