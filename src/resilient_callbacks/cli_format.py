"""How ``resilient-ckpt`` shows things: sizes, times, checkpoint states and JSON.

Standard library only, so that ``--help``, ``--version`` and usage errors never import torch.

States, the same words everywhere (``status`` in JSON, the STATUS column in text):

========== ============================= ====================================================
JSON       text                          meaning
========== ============================= ====================================================
valid      ``valid``                     every listed file present with its size and checksum
unverified ``sizes ok, not verified``    sizes match, checksums not read (``--fast``, remote)
unverified ``not verified``              only the manifest was read
corrupt    ``CORRUPT``                   a file is missing, or its size or checksum is wrong,
                                         or the manifest cannot be read
incomplete ``incomplete``                no manifest: being written, or left by a crash
========== ============================= ====================================================
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from .retention import ABANDONED

PROG = "resilient-ckpt"  # the command's name in its messages
# what a command's DIR is, in every command's --help (export's too)
DIR_HELP = "the checkpoint directory (the one given to Checkpointer or ResilientCheckpoint)"
DIR_OR_ONE_HELP = DIR_HELP + ", or one checkpoint in it"

VALID = "valid"
UNVERIFIED = "unverified"
CORRUPT = "corrupt"
INCOMPLETE = "incomplete"

# what was compared with the manifest to reach a status
CHECKSUMS = "checksums"
SIZES = "sizes"
MANIFEST = "manifest"


def status_text(status: str, checked: str | None) -> str:
    """The text form of a JSON ``status``: never says "valid" unless checksums were read."""
    if status == VALID:
        return VALID if checked == CHECKSUMS else "sizes ok, not verified"
    if status == UNVERIFIED:
        return "sizes ok, not verified" if checked == SIZES else "not verified"
    if status == CORRUPT:
        return "CORRUPT"
    return status


def fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def iso_time(t: float | None) -> str | None:
    """ISO-8601 with a time zone (UTC): ``2026-11-23T06:50:34+00:00``; JSON output."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def local_time(t: float | None) -> str:
    """Local time with the zone's name, ``2026-11-23 07:50:34 CET``; text output."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def fmt_metrics(metrics: dict[str, Any]) -> str:
    if not metrics:
        return "-"
    return ", ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def jsonable(x: Any) -> Any:
    """``x`` with the values strict JSON cannot hold replaced: a NaN or infinite float becomes
    the string ``"nan"``, ``"inf"`` or ``"-inf"``; tuples become lists; keys become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def print_json(obj: Any) -> None:
    """``obj`` as JSON on stdout, whole: a Ctrl-C (SIGINT) that arrives while it is written
    (a reader slower than the command: a pipe) is held until every byte is out, then raised
    (the command exits 130), so the reader never gets cut-off JSON. A second Ctrl-C stops it
    at once (a reader that stopped reading)."""
    text = json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n"
    with _sigint_held():
        _write_whole(text)


def _write_whole(text: str) -> None:
    """Write ``text`` to stdout and flush it. To a real file descriptor, with ``os.write`` until
    every byte is out: Python's buffered writer drops the rest of a write that a signal
    interrupted part-way, even when the signal's handler returns. A reader that has gone (a
    closed pipe) gets nothing more, and the command goes on, as ``cli._PipeSafe`` does."""
    out = sys.stdout
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a StringIO
        out.write(text)
        out.flush()
        return
    out.flush()
    data = memoryview(text.encode(getattr(out, "encoding", None) or "utf-8"))
    try:
        while data:
            data = data[os.write(fd, data) :]
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # later writes (at exit too) go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold the first SIGINT until the block is done, then raise KeyboardInterrupt; only in
    the main thread with Python's own handler installed (an embedding program's is left
    alone)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    hits: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if hits:  # the second one: at once
            raise KeyboardInterrupt
        hits.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hits:
        raise KeyboardInterrupt


def table(header: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> str:
    """Columns padded to their widest cell; the last column is not padded."""
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1:
                out.append(c)
            else:
                out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


INCOMPLETE_NOTE = "not kept: removed when the next writer opens the directory, or by gc"
NOT_OURS_NOTE = "not ours (nothing here was written by resilient_callbacks): gc leaves it alone"
NO_MANIFEST_NOTE = (
    "not a committed checkpoint (never loaded): writers leave it alone, gc removes it"
)


def row_note(r: dict[str, Any], foreign: set[str]) -> str:
    """The last column of a row of ``ls``: why a checkpoint is kept (locally, and by the remote
    retention where ``--remote`` gave its reasons), or what it is."""
    if r["status"] == INCOMPLETE and r.get("tier") == "uploading" and "://" in r["path"]:
        return f"remote only: {r['problem']}"  # the remote row of an upload a crash cut off
    if r["status"] == INCOMPLETE and r["name"] in foreign:
        return f"{r['problem']}; {NOT_OURS_NOTE}"
    if r["status"] == INCOMPLETE:
        hidden = r["name"].startswith(".")  # staging or trash: ours, swept by the next writer
        return f"{r['problem']}; {INCOMPLETE_NOTE if hidden else NO_MANIFEST_NOTE}"
    if r["status"] == CORRUPT:
        return r["problem"] or "-"
    if r.get("tier") == "remote":
        why = r.get("remote_kept_by")  # by the remote retention (None: none recorded)
        return f"remote only: {'; '.join(why)}" if why else f"remote only: {r['path']}"
    if r.get("copy"):
        return (
            "a copy under a name of yours: a run never resumes from it or deletes it, nor does gc"
        )
    why = r.get("remote_kept_by")  # a copy on both tiers: the remote's reasons where they differ
    remote = f"; remote: {'; '.join(why)}" if why and why != r["kept_by"] else ""
    if r["kept"]:
        return "; ".join(r["kept_by"]) + remote
    return f"not kept{f' ({ABANDONED})' * bool(r.get('abandoned'))}: gc would delete it{remote}"


def as_run(why: str, *words: object) -> str:
    """``why`` (a retention reason) with the placeholder command of
    :data:`~.retention.CORRUPT_KEPT` named as it is run: ``gc`` WORDS ``--remove-corrupt``
    (DIR, and ``--remote URL`` for a remote checkpoint, which gc DIR alone leaves)."""
    from .redact import command
    from .retention import CORRUPT_KEPT

    said = command("gc", *words, "--remove-corrupt")
    return why.replace(
        CORRUPT_KEPT, CORRUPT_KEPT.replace("`resilient-ckpt gc DIR --remove-corrupt`", said)
    )
