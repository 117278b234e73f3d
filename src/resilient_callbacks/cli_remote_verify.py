"""``resilient-ckpt verify URL``: check a remote store's checkpoints where they lie, every
checksum read from the store. Imported only when it runs."""

from __future__ import annotations

import argparse

from .cli_format import iso_time
from .cli_remote import _damage, store
from .cli_scan import report_verified
from .errors import CheckpointNotFoundError


def verify(args: argparse.Namespace) -> int:
    """``verify URL``: read the remote copies where they lie and check every checksum."""
    from .remote_verify import check_remote

    st = store(args.dir, args.option)
    remote = st.scan()
    committed = [e for e in remote if e.manifest is not None]
    if not committed:
        unreadable = len(_damage(remote)[1])
        some = f" ({unreadable} with an unreadable manifest)" if unreadable else ""
        raise CheckpointNotFoundError(f"no checkpoints in {st.url}{some}")
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
        failed_hint=f"; `resilient-ckpt push DIR {st.url} --verify` uploads a damaged copy "
        "again from a valid local one",
        matched="every checksum matches, read from the store",
    )
