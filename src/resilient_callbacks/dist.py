"""The few collectives the core needs, on JSON values, without pickle.

``torch.distributed``'s ``*_object`` collectives pickle their payload; these encode JSON into
uint8 tensors instead. With no process group initialized every function is the identity for a
single rank. Every rank must call each function in the same order.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._version import release
from .errors import AT_CALLER, CheckpointError, CollectiveError, ConfigError, warn_and_log

#: what every rank must do, said with every failed exchange
SAME_POINTS = (
    "every rank must call restore(), step() and save() at the same points, and close() at "
    "the end: a save called on one rank only (e.g. under `if rank == 0:`) waits for the others "
    "until the process group's timeout"
)

# how the backends say that the process at the other end is gone (gloo, the TCP store)
_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused")


def failed_exchange(e: BaseException) -> str:
    """Why an exchange with the other ranks failed, for the error that reports it on this rank
    (which only saw it fail): the backend's error ``e``, then the likely cause first. A peer
    whose connection closed is gone (killed, out of memory, crashed); a timeout is a rank that
    died, hung, or did not call the library where this one did."""
    raw = f"{type(e).__name__}: {str(e).strip()}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared_store and attempt not in ("", "0") and "connectfullmesh" in str(e).lower():
        # not a dead peer: a group made in a restarted worker dialled the last attempt's
        # addresses, which torchrun's shared rendezvous store still held
        cause = (
            f"this worker, restarted by torchrun (attempt {attempt}), read another attempt's "
            "process-group addresses from torchrun's rendezvous store, which outlives a "
            f"restart when the workers share it (pytorch/pytorch#135712): {unshared_store_fix()}"
        )
        return f"exchanging with the other ranks failed ({raw}); most likely {cause}"
    if any(m in str(e).lower() for m in _PEER_GONE):
        cause = (
            "another rank's process is gone (killed, out of memory, crashed): its own log and "
            "the launcher's (torchrun names the failed rank) say which and why"
        )
    else:
        cause = (
            "another rank died, hung, or did not call the library at this point (the other "
            "ranks' logs say which)"
        )
    return (
        f"exchanging with the other ranks failed ({raw}); most likely {cause}. "
        f"Otherwise: {SAME_POINTS}"
    )


#: torchrun's variable that gives each attempt of its workers a rendezvous store of its own
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_store_warned = False


def warn_if_restarts_share_a_store() -> None:
    """Every rank, once a process: warn where torchrun restarts its workers (``--max-restarts``)
    and they share its rendezvous store, which outlives a restart (torch >= 2.5): a restarted
    worker may dial the previous attempt's addresses and fail or hang (pytorch/pytorch#135712)
    in ``init_process_group`` or in a group made later (the library's, at the first save).
    torchrun gives every worker the same variables: rank 0 warns, the others log it at INFO
    and, where the warning filters make it an error, raise it too. Warned on rank 0 alone, it
    stopped rank 0's Checkpointer under ``-W error`` while the others went on into restore()'s
    collectives and waited there for it."""
    global _store_warned
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (
        _store_warned
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or not restarts.isdigit()
        or int(restarts) == 0
        or world_size() == 1
    ):
        return
    _store_warned = True
    warn_and_log(
        logging.getLogger("resilient_callbacks"),
        f"torchrun restarts these workers (--max-restarts {restarts}) and they share its "
        "rendezvous store, which outlives a restart: a restarted worker may read the previous "
        "attempt's process-group addresses, and its init_process_group (or the checkpointer's "
        "first save) fails with gloo's 'connectFullMesh ... Connection refused' or waits until "
        f"its timeout (pytorch/pytorch#135712). {unshared_store_fix()}",
        stacklevel=AT_CALLER,
        warn=rank() == 0,  # (said once: notices.py)
    )


def unshared_store_fix() -> str:
    """What gives each attempt of torchrun's workers a store of its own, here: the variable, or,
    where it is set and the store is shared all the same, the c10d rendezvous it applies to."""
    if os.environ.get(UNSHARED_STORE) == "1":
        # set, yet shared: torchrun's static rendezvous (its default), which ignores it (probed
        # 2026-12-06, torch 2.13: restarted workers still dialled the last attempt's addresses)
        return (
            f"{UNSHARED_STORE}=1 is set, but torchrun's static rendezvous (its default, and "
            "--master-addr/--master-port) shares its store all the same: start torchrun with "
            "--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT (--standalone on one node) and that "
            "variable, or restart the whole job from the scheduler instead (--max-restarts 0)"
        )
    return (
        f"Start torchrun with {UNSHARED_STORE}=1 in its environment (integrations/torchrun/): "
        "then every attempt has a store of its own"
    )


def is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_initialized() else 1


def group_size(group: Any = None) -> int:
    """The ranks of ``group`` (default: the world); 1 without a process group."""
    return torch.distributed.get_world_size(group) if is_initialized() else 1


def launched_world_size() -> int:
    """The number of ranks the launcher started (torchrun's ``WORLD_SIZE``; 1 where unset)."""
    value = os.environ.get("WORLD_SIZE", "1").strip()
    return int(value) if value.isdigit() else 1


#: how to create a Checkpointer on several ranks, said by the errors below
_AFTER_GROUP = (
    "Call torch.distributed.init_process_group(...) first, then create the Checkpointer "
    "(the Lightning, Transformers, Accelerate and DeepSpeed adapters do so: they create it "
    "once the framework has set up the group)"
)


def require_group(dirpath: str) -> None:
    """Every rank, when a Checkpointer is created: refuse a process launched as one of several
    ranks (``WORLD_SIZE`` > 1, as torchrun sets it) whose process group does not exist yet.
    Its rank and world size are read here; without a group every rank would take itself for
    the only one: take the directory's lock (the second rank was refused with a lock error
    that named no cause), write the history, and save into ``dirpath`` as if alone."""
    launched = launched_world_size()
    if launched <= 1 or is_initialized():
        return
    raise ConfigError(
        f"Checkpointer({dirpath!r}) was created before torch.distributed.init_process_group: "
        f"this process was launched as rank {os.environ.get('RANK', '?')} of "
        f"WORLD_SIZE={launched} but has no process group yet, so it would act as the only "
        "rank and every rank would write the same directory as if alone. "
        f"{_AFTER_GROUP}. If these processes are independent runs (no process group), "
        "set WORLD_SIZE=1 in their environment and give each its own dirpath."
    )


def check_same_world(created: int, dirpath: str) -> None:
    """Every rank, at each call of the Checkpointer of ``dirpath`` (each training step: the
    message is built only to raise): raise where the process group is not the one it was
    created in (``created`` ranks): a group created after it (``mp.spawn`` without
    ``WORLD_SIZE``, which :func:`require_group` cannot see) or destroyed before its call."""
    now = world_size()
    if now == created:
        return
    what = f"Checkpointer({dirpath!r})"
    if created == 1:
        raise ConfigError(
            f"{what}: this Checkpointer was created without a process group (as the only "
            f"rank), and the process group now has {now} ranks: each rank would save as if "
            f"it were alone. {_AFTER_GROUP}."
        )
    raise ConfigError(
        f"{what}: this Checkpointer was created on {created} ranks, and the process group "
        f"{'was destroyed' if now == 1 else f'now has {now} ranks'} since: call it only "
        "while its process group exists (close() it before destroy_process_group) and "
        "create a new Checkpointer for a new group."
    )


def check_same_options(options: dict[str, Any]) -> None:
    """Every rank, when a Checkpointer is created (one all-gather): raise the same
    :class:`ConfigError` on every rank where the ranks were given different ``options``
    (``{name: JSON value}``): they decide together when to save, and a rank with another
    schedule waited in a save the others never reached, until the process group's timeout."""
    if not is_initialized() or world_size() == 1:
        return
    # the first exchange of a Checkpointer: where one made on some ranks only stops
    with peer_errors("creating the Checkpointer (every rank creates it, at the same point)"):
        every = all_gather_json(options)
    differ = [k for k in options if any(o.get(k) != every[0].get(k) for o in every)]
    if not differ:
        return
    said = "; ".join(
        f"{k}: " + ", ".join(f"rank {r} {o.get(k)!r}" for r, o in enumerate(every)) for k in differ
    )
    raise ConfigError(
        f"the ranks created their Checkpointer with different options ({said}): every rank "
        "must pass the same arguments, since the ranks decide together when to save (ranks "
        "that differ wait for each other in a save until the process group's timeout)"
    )


def _device(group: Any = None) -> torch.device:
    """Where this rank's tensors for a collective on ``group`` live: the CPU, or under NCCL the
    GPU the group is bound to (``init_process_group(device_id=...)``), else the current one
    (``torch.cuda.set_device``), as torch's own object collectives assume."""
    backend = torch.distributed.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        pg = group if group is not None else torch.distributed.distributed_c10d._get_default_group()
        bound = getattr(pg, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode("utf-8"))


def new_cpu_group() -> Any:
    """A gloo group over all ranks, for collectives issued from a background thread (they must
    not interleave with the training loop's collectives on the default group). Every rank must
    call it, at the same point."""
    if not is_initialized():
        return None
    # the world's timeout, not the backend's 30-minute default: a rank whose peer hung during
    # a background save waited in close() for 30 minutes after its own collectives timed out
    return torch.distributed.new_group(backend="gloo", timeout=world_timeout())


def destroy_cpu_group(group: Any) -> bool:
    """Destroy a group made by :func:`new_cpu_group`, where torch can: returns whether it did.

    Before torch 2.8 a gloo group's destructor joins its worker threads while holding the GIL,
    and a worker freeing a tensor of a finished collective waits for the GIL: close() hung there
    about once in 25 runs of 2 ranks on torch 2.4.1 (fixed in torch by releasing the GIL first,
    pytorch#154976). There the group is left to the process's exit, which was clean."""
    if release(torch.__version__) < (2, 8):
        return False
    torch.distributed.destroy_process_group(group)
    return True


def from_collective(e: BaseException) -> bool:
    """True if ``e`` is the backend's error from a collective or a group's creation: a
    ``DistError``, or a ``RuntimeError`` raised in ``distributed_c10d`` (gloo raises those)."""
    if isinstance(e, torch.distributed.DistError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and last.replace(os.sep, "/").endswith(
        "distributed/distributed_c10d.py"
    )


def peer_error(
    e: Exception, what: str, error: type[CheckpointError] = CollectiveError
) -> CheckpointError | None:
    """The error to raise instead of ``e`` when ``e`` is the backend's raw error (gloo's
    "Connection closed by peer", a store's "wait timeout") from a collective of the library
    call ``what`` on several ranks: ``error``, saying which call stopped on which rank and what
    every rank must do. None for anything else (the library's own errors pass unchanged)."""
    if isinstance(e, CheckpointError) or not (
        is_initialized() and world_size() > 1 and from_collective(e)
    ):
        return None
    return error(f"{what} stopped on rank {rank()} (the rank reporting it): {failed_exchange(e)}")


@contextmanager
def peer_errors(what: str, error: type[CheckpointError] = CollectiveError) -> Iterator[None]:
    """:func:`peer_error` around a block (a call that is not on every step's path)."""
    try:
        yield
    except Exception as e:
        err = peer_error(e, what, error)
        if err is None:
            raise
        raise err from e


def world_timeout() -> Any:
    """The default process group's timeout, as ``init_process_group(timeout=...)`` set it
    (``None`` where it cannot be read: the backend's default then)."""
    pg = torch.distributed.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return None


def wait_before_collective(wanted_s: float) -> float:
    """How long one rank may block (``wanted_s`` at most) while the other ranks already wait for
    it in a collective: half the world's timeout, so they never time out first (600 s, the
    shorter NCCL default, where it cannot be read). ``wanted_s`` alone without other ranks."""
    if world_size() <= 1:
        return wanted_s
    timeout = world_timeout()
    seconds = timeout.total_seconds() if timeout is not None else 600.0
    return max(0.0, min(wanted_s, seconds / 2))


# Bytes of the first (and, for most payloads, the only) round of all_gather_json and
# broadcast_json: an 8-byte length, then the payload when it fits. Agreements, outcomes and
# timings fit, so they cost one collective, not two (a size round, then a payload round);
# longer payloads (a chunk index) take a second round sized to the longest.
INLINE = 1024


def _framed(payload: torch.Tensor, dev: torch.device) -> torch.Tensor:
    frame = torch.zeros(INLINE, dtype=torch.uint8, device=dev)
    n = payload.numel()
    frame[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8).to(dev)
    if n <= INLINE - 8:
        frame[8 : 8 + n] = payload
    return frame


def _length(frame: torch.Tensor) -> int:
    return int(frame[:8].cpu().view(torch.int64).item())


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not is_initialized():
        return [obj]
    dev = _device(group)
    payload = _encode(obj, dev)
    n = torch.distributed.get_world_size(group)
    frames = [torch.empty(INLINE, dtype=torch.uint8, device=dev) for _ in range(n)]
    torch.distributed.all_gather(frames, _framed(payload, dev), group=group)
    sizes = [_length(f) for f in frames]
    longest = max(sizes)
    if longest <= INLINE - 8:
        return [_decode(f[8 : 8 + s]) for f, s in zip(frames, sizes, strict=True)]
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(n)]
    torch.distributed.all_gather(bufs, padded, group=group)
    return [_decode(b[:s]) for b, s in zip(bufs, sizes, strict=True)]


def gather_json(obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` of ``group``, in group order, on rank ``dst`` (a global rank);
    ``None`` on the others. Each rank sends one message; only ``dst`` receives them all (what
    a coordinator needs, without the O(N) payload per rank of :func:`all_gather_json`)."""
    if not is_initialized():
        return [obj]
    dev = _device(group)
    payload = _encode(obj, dev)
    longest = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX, group=group)
    n = int(longest.item())
    padded = torch.zeros(n + 8, dtype=torch.uint8, device=dev)
    padded[:8] = torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8).to(dev)
    padded[8 : 8 + payload.numel()] = payload
    me = rank() == dst
    bufs = (
        [torch.zeros_like(padded) for _ in range(torch.distributed.get_world_size(group))]
        if me
        else None
    )
    torch.distributed.gather(padded, bufs, dst=dst, group=group)
    if bufs is None:
        return None
    out = []
    for b in bufs:
        size = int(b[:8].cpu().view(torch.int64).item())
        out.append(_decode(b[8 : 8 + size]))
    return out


def broadcast_json(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of rank ``src`` (global rank) on every rank."""
    if not is_initialized():
        return obj
    dev = _device(group)
    mine = rank() == src
    payload = _encode(obj, dev) if mine else torch.empty(0, dtype=torch.uint8, device=dev)
    frame = _framed(payload, dev)
    torch.distributed.broadcast(frame, src, group=group)
    size = _length(frame)
    if size <= INLINE - 8:
        return _decode(frame[8 : 8 + size])  # on src too: every rank sees the JSON form
    buf = payload if mine else torch.empty(size, dtype=torch.uint8, device=dev)
    torch.distributed.broadcast(buf, src, group=group)
    return _decode(buf)


def any_true(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    return any_each([flag])[0]


def any_each(flags: list[bool]) -> list[bool]:
    """For each flag, true on every rank if it is true on any rank (one all-reduce)."""
    if not is_initialized():
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def max_each(values: list[int]) -> list[int]:
    """For each int64 value, its maximum over the ranks (one all-reduce)."""
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def barrier() -> None:
    if is_initialized():
        torch.distributed.barrier()
