"""Node-local mode's restore from the remote tier (docs/multinode.md): a node that lacks a
checkpoint downloads only its own ranks' files of it (and the replicated ``shared.*``),
verifies them and commits them as a local checkpoint.

Which ranks call what: :func:`download` is called by a node's leader only (from
:meth:`~.node_restore.NodeRestorer.restore`, which says which node fetches what); nothing
collective.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

from . import catalog, stall
from .catalog import Depth
from .commit import STAGING_PREFIX
from .errors import CheckpointCorruptError
from .manifest import Manifest
from .nodelocal import REMOTE_MANIFEST, NodeDirectory, is_shared, needed
from .tensorfile import encode_json, write_bytes

log = logging.getLogger("resilient_callbacks")


def download(d: NodeDirectory, name: str, c: dict[str, Any]) -> tuple[str, int, int]:
    """Leader: fetch this node's ranks' files (and the replicated ones) of the remote
    checkpoint ``name``, verify every checksum, and commit them as a local checkpoint."""
    topo = d.topology
    assert d.remote is not None
    st = d.remote
    m = stall.run(lambda: st.read_manifest(name), f"reading {st.url}/{name}", preemptible=True)
    if [m.run_id, m.seq, m.step] != [*c["key"], c["step"]]:
        raise CheckpointCorruptError(f"{st.url}/{name} is another checkpoint now")
    ranks = needed(topo.node_ranks, m.world_size)
    need = [f for f in m.files if f.rank in ranks or is_shared(f.path)]
    staging = os.path.join(d.dirpath, f"{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    try:
        for f in need:
            os.makedirs(os.path.dirname(os.path.join(staging, f.path)), exist_ok=True)
        log.warning(
            "restoring this node's %d file(s) of step %d from the remote copy %s/%s",
            len(need),
            m.step,
            st.url,
            name,
        )
        srcs, dsts = [f"{st.root}/{name}/{f.path}" for f in need], [f.path for f in need]
        what = f"downloading this node's part of {st.url}/{name}"
        stall.tried_again(  # an error that may pass: each try given up once no byte arrived
            lambda: stall.run(  # for the outage limit, its progress logged
                lambda: st.fs.get(srcs, [os.path.join(staging, f) for f in dsts]),
                what,
                lambda: stall.on_disk(
                    d.dirpath, os.path.basename(staging), {f.path: f.size for f in need}
                ),
                preemptible=True,  # (a request ends it: node_restore raises it on every rank)
            ),
            what,
        )
        raw = encode_json(m.to_json())  # (the remote manifest, kept beside the node's own)
        node_m = Manifest.from_json(json.loads(raw))  # (a copy)
        node_m.files = need
        node_m.extra = dict(m.extra)
        node_m.extra["node"] = {
            "ranks": sorted(ranks),
            "nodes": len(topo.nodes),
            "remote_name": name,
        }
        catalog.verify(staging, node_m, Depth.FULL)
        write_bytes(os.path.join(staging, REMOTE_MANIFEST), raw)
        final = d.commit.commit(staging, m.step, encode_json(node_m.to_json()))
    except BaseException:
        d.commit.abort(staging)
        raise
    return final, len(need), sum(f.size for f in need)
