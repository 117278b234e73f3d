"""``resilient-ckpt verify URL``: check a remote store's checkpoints where they lie, every
checksum read from the store. Imported only when it runs."""

from __future__ import annotations

import argparse
import posixpath
import sys

from . import remote_paths
from .catalog import PLAIN_DCP_METADATA
from .cli_format import iso_time
from .cli_remote import UPLOADING_OR_CUT, _damage, store
from .cli_scan import report_verified
from .errors import CheckpointNotFoundError, ConfigError, nothing_found
from .redact import command, url_text
from .remote import RemoteEntry, RemoteStore


def verify(args: argparse.Namespace) -> int:
    """``verify URL``: read the remote copies where they lie and check every checksum. With
    nothing to check and ``--json``, the object a script parses still (as ``verify DIR``)."""
    try:
        return _verify(args)
    except (CheckpointNotFoundError, ConfigError) as nothing:  # (a URL of one checkpoint: 2)
        if not args.json:
            raise
        scope = "step" if args.step is not None else "all" if args.all else "newest"
        where = url_text(args.dir.rstrip("/"))  # (as the store shows its URL: no secrets)
        report_verified(args, where, scope, [], 0, what="remote checkpoint(s)")
        print(f"resilient-ckpt verify: {nothing}", file=sys.stderr)
        return nothing.exit_code  # (3: the store holds none)


def _verify(args: argparse.Namespace) -> int:
    from .remote_verify import check_remote

    st = store(args.dir, args.option, step_option=True)
    remote = st.scan()
    committed = [e for e in remote if e.manifest is not None]
    if not committed:
        unreadable = len(_damage(remote)[1])
        some = f" ({unreadable} with an unreadable manifest)" if unreadable else ""
        note = plain_dcp_note(st, remote)
        raise nothing_found(CheckpointNotFoundError(f"no checkpoints in {st.url}{some}{note}"))
    steps = {e.name: e.manifest.step for e in committed if e.manifest is not None}
    if args.step is not None:
        scope, chosen = "step", [e for e in committed if steps[e.name] == args.step]
        if not chosen:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {args.step} in {st.url} (its steps: "
                f"{', '.join(map(str, sorted(set(steps.values()))))})"
            )
    else:
        scope, chosen = ("all", committed) if args.all else ("newest", committed[-1:])
        _say_uploads(st, remote, max(steps.values()))
    rows = []
    for e in chosen:
        m = e.manifest
        assert m is not None
        # a listed size already wrong needs no reading
        problem = e.problem if e.problem is not None else check_remote(st, e).problem
        rows.append(
            {
                "name": e.name,
                "step": m.step,
                "seq": m.seq,
                "status": "valid" if problem is None else "corrupt",
                "checked": "checksums",
                "time": iso_time(m.created),
                "bytes": m.total_bytes,
                "run_id": m.run_id,
                "problem": problem,
                "url": f"{st.url}/{e.name}",
            }
        )
    return report_verified(
        args,
        st.url,
        scope,
        rows,
        len(committed),
        what="remote checkpoint(s)",
        shown="url",
        failed_hint=f"; {command('push', 'DIR', st.url, '--verify')} uploads a damaged copy "
        "again from a valid local one",
        matched="every checksum matches, read from the store",
    )


def _say_uploads(st: RemoteStore, remote: list[RemoteEntry], newest: int) -> None:
    """Name on stderr the checkpoints of a step after the newest committed one that have no
    manifest (an upload in progress, or one a crash cut off): not checked, as "the newest"
    could read as the store's newest."""
    from .remote import NO_MANIFEST
    from .remote_claims import REMOTE_CKPT_RE

    for e in remote:
        step = REMOTE_CKPT_RE.match(e.name)
        if e.problem == NO_MANIFEST and step and int(step.group(1)) > newest:
            print(
                f"resilient-ckpt verify: not checked: {st.url}/{e.name}: {e.problem}: "
                f"{UPLOADING_OR_CUT}",
                file=sys.stderr,
            )


def plain_dcp_note(st: RemoteStore, remote: list[RemoteEntry]) -> str:
    """What to add to "no checkpoints in URL" where the URL holds what plain ``dcp.save``
    (``FsspecWriter``) writes: its checkpoints (a pickled ``.metadata`` beside ``*.distcp``
    files) and torn ones (``*.distcp`` files without the ``.metadata`` DCP writes last), the
    URL itself or its folders; ``""`` where it holds none. As ``verify DIR`` says of a local
    directory (:func:`catalog.plain_dcp_note`), with the reader for a URL."""
    files = {e.name: e.sizes for e in remote if e.manifest is None}
    try:  # (a hint: a listing that fails does not replace the error it adds to)
        top = [posixpath.basename(p.rstrip("/")) for p in st.fs.ls(st.root, detail=False)]
        marks = st.fs.glob(posixpath.join(remote_paths.escape(st.root), "*", PLAIN_DCP_METADATA))
    except OSError:
        top, marks = [], []
    files[""] = {name: 0 for name in top}
    for mark in marks:  # (RemoteStore.scan leaves them out: not ours)
        files[posixpath.basename(posixpath.dirname(mark))] = {PLAIN_DCP_METADATA: 0}
    whole = sorted(n for n, f in files.items() if PLAIN_DCP_METADATA in f)
    torn = [
        n
        for n, f in sorted(files.items())
        if PLAIN_DCP_METADATA not in f and any(x.endswith(".distcp") for x in f)
    ]
    if not whole and not torn:
        return ""

    def where(names: list[str], one: str, many: str) -> str:
        if names == [""]:
            return f"{st.url} {one}"
        shown = ", ".join(n or "." for n in names[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
        return f"{shown} in {st.url} {one if len(names) == 1 else many}"

    said = []
    if whole:
        said.append(
            where(whole, "is a checkpoint", "are checkpoints")
            + " written by plain dcp.save (FsspecWriter: a pickled .metadata and *.distcp "
            "files), which resilient_callbacks neither lists nor verifies (it has no checksums "
            "to check); to carry one over, copy it to a local directory, load it with "
            "dcp.load(sd, storage_reader=plain_dcp_reader(DIR, allow_pickle=True)) (from "
            "resilient_callbacks.dcp; it unpickles: only a checkpoint you trust) and save it "
            "again with ResilientStorageWriter or a Checkpointer"
        )
    if torn:
        said.append(
            where(torn, "holds", "hold")
            + " *.distcp files without a .metadata: a plain dcp.save that did not finish (DCP "
            "writes .metadata last), which no reader loads; delete it, or save it again"
        )
    return "; " + "; ".join(said)
