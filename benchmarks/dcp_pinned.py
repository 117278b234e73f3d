"""DCP ``async_save`` with its fastest staging here, for benchmarks/bench_gpu.py: pinned host
buffers kept between saves, copied by a background thread with non-blocking device-to-host
copies. Needs a torch whose DCP has ``DefaultStager``/``StagingOptions`` (else an error in the
results, not a failure)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

# DCP's own failures: its CheckpointException derives from BaseException, not Exception
try:
    from torch.distributed.checkpoint.api import CheckpointException

    DCP_FAILURES: tuple[type[BaseException], ...] = (Exception, CheckpointException)
except ImportError:
    DCP_FAILURES = (Exception,)


def pinned_stager(out: dict[str, Any]) -> Any:
    """DCP's fastest async staging here: pinned host buffers it keeps between saves, the copies
    made by a background thread with ``non_blocking`` device-to-host copies (``DefaultStager``
    with ``StagingOptions(pinned, no shared memory, async, non-blocking)``); None (and the
    reason in ``out``) where this torch has no such stager."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(True, False, True, True))
    except Exception as e:
        out["dcp_pinned.error"] = [f"{type(e).__name__}: {e}"]
        return None


class PinnedStagers:
    """The stager of :func:`pinned_stager`, kept between saves as its documentation asks (its
    pinned buffers are reused). Where this torch's ``async_save`` closes the stager it is given
    (torch 2.11 on an H200: the next save's staging failed with ``KeyError: <class 'type'>``,
    the closed stager's copy table being empty), a new one for each save, said in ``out``."""

    NOTE = (
        "the stager that served a save failed the next, as a closed one does: a new pinned "
        "stager per save (its buffers allocated and pinned inside each save)"
    )

    def __init__(self, out: dict[str, Any], make: Any = pinned_stager) -> None:
        self.out, self.make = out, make
        self.stager = make(out)
        self.renew = False
        self.used = False  # whether it has served a save

    def next(self) -> Any:
        if self.renew:
            self.close()
            self.stager = self.make(self.out)
        return self.stager

    def closed_by_dcp(self, error: BaseException) -> None:
        self.renew = True
        self.out["dcp_pinned.note"] = [
            f"{self.NOTE} (reused, it failed: {type(error).__name__}: {error})"
        ]

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def dcp_pinned(
    work: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    stagers: PinnedStagers,
    add: Any,
    out: dict[str, Any],
) -> None:
    """``dcp.async_save`` with :func:`pinned_stager`: *blocking* = until it returns; *staged* =
    until ``staging_completion`` (what the optimizer step must wait for before it changes the
    parameters: the comparable figure to our *stream*); *total* = ``upload_completion``."""
    if stagers.stager is None:  # no such stager in this torch (the reason is in ``out``)
        return
    for _ in range(2):  # a second try only with a new stager (closed_by_dcp)
        try:
            _dcp_pinned_once(work, model, opt, stagers.next(), add)
            stagers.used = True
            return
        except DCP_FAILURES as e:  # reported, not fatal, as for the default stager
            if stagers.renew or not stagers.used:
                out["dcp_pinned.error"] = [f"{type(e).__name__}: {e}"]
                return
            # a stager that served a save fails the next: closed by that save (PinnedStagers)
            stagers.closed_by_dcp(e)


def _dcp_pinned_once(
    work: str, model: torch.nn.Module, opt: torch.optim.Optimizer, stager: Any, add: Any
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    d = os.path.join(work, "dcp_pinned")
    shutil.rmtree(d, ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    resp = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=d, async_stager=stager)
    blocking = time.perf_counter() - t0
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:
        staging.result()
    staged = time.perf_counter() - t0
    upload = getattr(resp, "upload_completion", resp)
    upload.result()
    add("dcp_pinned.blocking", blocking)
    add("dcp_pinned.staged", staged)
    add("dcp_pinned.total", time.perf_counter() - t0)
    shutil.rmtree(d, ignore_errors=True)
